"""What a wrapped model decides once, when it is wrapped: `wrap(model, **options)`, or the
defaults `wrap_options` gives every model wrapped inside a `with` block.

- `buckets`: multi-token forwards attend over a key length bucketed to a multiple of 256, so
  that MLX's CUDA attention meets few new lengths (`instruments.buckets`); None: on a CUDA
  GPU (the default device at each forward).
- `verify_kernel`: a bucketed verify forward routes its attention to kvstate's verify kernel
  (MLX's own attention off CUDA); None: where CUDA is available.
- `record_mixers`: a capturing forward records the recurrent state after every token inside
  the mixers kvstate knows (`instruments.capture.KNOWN_MIXERS`); False replays every recurrent
  layer token by token instead, as it does any layer it does not know (the slow path, the
  reference the recording is tested against).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, NamedTuple

from ..instruments.buckets import Bucketing


class WrapOptions(NamedTuple):
    buckets: bool | None = None
    verify_kernel: bool | None = None
    record_mixers: bool = True


_LIBRARY_DEFAULTS = WrapOptions()
_DEFAULTS: ContextVar[WrapOptions] = ContextVar("kvstate_wrap_options", default=_LIBRARY_DEFAULTS)
_KEEP: Any = object()  # an option left out: the defaults in effect decide


@contextmanager
def wrap_options(
    *, buckets: Any = _KEEP, verify_kernel: Any = _KEEP, record_mixers: Any = _KEEP
) -> Iterator[WrapOptions]:
    """Inside the block, `wrap` gives the models it wraps these options (the ones left out
    stay as they were; a keyword given to `wrap` itself wins). Yields the defaults now in
    effect. See the module docstring for each option."""
    given = {"buckets": buckets, "verify_kernel": verify_kernel, "record_mixers": record_mixers}
    changes = {k: v for k, v in given.items() if v is not _KEEP}
    token = _DEFAULTS.set(_DEFAULTS.get()._replace(**changes))
    try:
        yield _DEFAULTS.get()
    finally:
        _DEFAULTS.reset(token)


def chosen(
    buckets: bool | None, verify_kernel: bool | None, record_mixers: bool | None
) -> tuple[Bucketing, bool]:
    """(the bucketing, whether to record mixers) of a model wrapped now with these options
    (None: the defaults in effect)."""
    defaults = _DEFAULTS.get()
    force = defaults.buckets if buckets is None else buckets
    kernel = defaults.verify_kernel if verify_kernel is None else verify_kernel
    record = defaults.record_mixers if record_mixers is None else record_mixers
    return Bucketing.resolved(force, kernel), bool(record)
