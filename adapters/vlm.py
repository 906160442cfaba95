"""mlx-vlm: its cache objects <-> kvstate states, and `wrap` for its models.

Importing this module imports mlx_vlm (the `vlm` extra); `kvstate.adapters` itself never
does. `kvstate.adapters.wrap` and `from_mlx_lm` hand mlx-vlm objects here on their own, so
most code needs only `to_mlx_vlm` from this module.
"""

from __future__ import annotations

from typing import Any

from kvstate import ModelState

from .caches.convert import from_mlx_lm
from .caches.vlm import to_vlm_cache
from .wrapped.vlm import VLMWrappedModel


def from_mlx_vlm(caches: Any) -> Any:
    """mlx-vlm caches -> a state: a list gives a `ModelState`, one cache its layer's state.
    The same state `from_mlx_lm` gives for mlx-lm's caches of the same model configuration
    (and `from_mlx_lm` accepts mlx-vlm's caches too). The state is checked before it is
    returned."""
    return from_mlx_lm(caches)


def to_mlx_vlm(state: Any) -> Any:
    """A state -> new mlx-vlm cache objects (`mlx_vlm.models.cache`): a list for a
    `ModelState`, else one cache. `kvstate.adapters.to_mlx_lm` gives mlx-lm's instead."""
    if isinstance(state, ModelState):
        return [to_vlm_cache(s) for s in state.layers]
    return to_vlm_cache(state)


def wrap(
    model: Any,
    *,
    buckets: bool | None = None,
    verify_kernel: bool | None = None,
    record_mixers: bool | None = None,
) -> VLMWrappedModel:
    """A pure view of an mlx-vlm model (see `VLMWrappedModel`; the options as in
    `kvstate.adapters.wrap`)."""
    return VLMWrappedModel(
        model, buckets=buckets, verify_kernel=verify_kernel, record_mixers=record_mixers
    )


__all__ = ["VLMWrappedModel", "from_mlx_vlm", "to_mlx_vlm", "wrap"]
