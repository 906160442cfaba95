"""Recording the recurrent state after every token of a verify forward (`capture=True`).

Checkpoints mirror the state: a tuple per layer of a ModelState, a tuple per part of a
ListState, a tuple per RecurrentState with one entry per array (None where the state's array
is None, see `kvstate._checkpoints` for the forms), and None for every non-recurrent part.

For the recurrent mixers kvstate knows (`KNOWN_MIXERS`), the mixer runs once over all K
tokens, as mlx-lm wrote it, with two instruments:
- its convolution module records its input: the widened window (the last `width` inputs
  before the forward, then the K new ones), so every checkpoint of the convolution state is a
  window of it (`ConvWindow`);
- its recurrence (gated delta, the Mamba2 SSM) runs through a function that also returns the
  state after every token (`gated_delta_steps`, `ssm_steps`: a kernel on GPUs, ops on the CPU)
  and records those (`StepStates`).
Both are instance surgery for the length of one forward: the mixer and its convolution get a
subclass (the methods that call the recurrence are copies of mlx-lm's own, reading the
recording function under the recurrence's name), and get their classes back afterwards.
The projections, norms and masks are mlx-lm's code, run once over K tokens.

Any other recurrent layer (or a right-padded prompt's `lengths`) makes the forward fall back
to replaying the accepted prefix token by token through the whole model (see `wrapped.forward`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, NamedTuple

import mlx.core as mx
import mlx.nn as nn

from kvstate import ConvWindow, StepStates

from ..caches.walk import arrays_caches
from .swap import reading, subclass, swapped, with_body


class Mixer(NamedTuple):
    """Where a known mixer keeps its parts: the convolution submodule's attribute name and
    the module-level recurrence function its methods call (None: convolution only). By
    mlx-lm's convention the convolution state is cache[0] and the recurrence's cache[1]."""

    conv: str
    recurrence: str | None


KNOWN_MIXERS: dict[str, Mixer] = {
    "mlx_lm.models.qwen3_next.Qwen3NextGatedDeltaNet": Mixer("conv1d", "gated_delta_update"),
    "mlx_lm.models.qwen3_5.GatedDeltaNet": Mixer("conv1d", "gated_delta_update"),
    "mlx_lm.models.mamba2.Mamba2Block": Mixer("conv1d", "ssm_update"),
    "mlx_lm.models.nemotron_h.NemotronHMamba2Mixer": Mixer("conv1d", "ssm_update"),
    "mlx_lm.models.falcon_h1.FalconH1Mixer": Mixer("conv1d", "ssm_update"),
    "mlx_lm.models.granitemoehybrid.GraniteMoeHybridMamba2Mixer": Mixer("conv1d", "ssm_update"),
    "mlx_lm.models.lfm2.ShortConv": Mixer("conv", None),
    "mlx_lm.models.lfm2_moe.ShortConv": Mixer("conv", None),
    # mlx-vlm's copies of the same layers (tests/test_vlm_models.py checks each against replay).
    "mlx_vlm.models.qwen3_next.language.Qwen3NextGatedDeltaNet": Mixer(
        "conv1d", "gated_delta_update"
    ),
    "mlx_vlm.models.mamba2.language.Mamba2Block": Mixer("conv1d", "ssm_update"),
    "mlx_vlm.models.nemotron_h.language.NemotronHMamba2Mixer": Mixer("conv1d", "ssm_update"),
    "mlx_vlm.models.falcon_h1.language.FalconH1Mixer": Mixer("conv1d", "ssm_update"),
    "mlx_vlm.models.lfm2.language.ShortConv": Mixer("conv", None),
}
"""Mixers called as `mixer(hidden (B, S, D), mask=(B, S) bool or None, cache=ArraysCache)`."""


class Record:
    """What one recurrent cache's mixer recorded during a forward (`mixer` is None until a
    known mixer opens the record: then the forward falls back to replaying)."""

    def __init__(self) -> None:
        self.mixer: Mixer | None = None
        self.conv_input: mx.array | None = None
        self.states: mx.array | None = None
        self.tree: Any = None  # a `tree.Tree`: the tokens follow parent pointers
        self.conv_states: mx.array | None = None  # a tree forward's conv windows

    def complete(self) -> bool:
        if self.mixer is None or self.conv_input is None:
            return False
        return self.mixer.recurrence is None or self.states is not None


_RECORD: ContextVar[Record | None] = ContextVar("kvstate_record", default=None)
_RECORDS = "_kvstate_record"  # on an ArraysCache during a capture: its Record


# ---------------------------------------------------------------------------------------
# Recording recurrences: mlx-lm's signatures, plus the state after every token.
# ---------------------------------------------------------------------------------------


def _recording_gated_delta(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    a: mx.array,
    b: mx.array,
    A_log: mx.array,
    dt_bias: mx.array,
    state: mx.array | None = None,
    mask: mx.array | None = None,
    *,
    use_kernel: bool = True,
    lower_bound: float | None = None,
    allow_neg_eigval: bool = False,
) -> tuple[mx.array, mx.array]:
    """mlx-lm's `gated_delta_update` (same gates), recording the state after every token."""
    from mlx_lm.models.gated_delta import compute_g, compute_lower_bound_g

    from ..kernels.gated_delta import gated_delta_steps

    beta = mx.sigmoid(b)
    if allow_neg_eigval:
        beta = beta * 2.0
    if lower_bound is None:
        g = compute_g(A_log, a, dt_bias)
    else:
        g = compute_lower_bound_g(A_log, a, dt_bias, lower_bound)
    if state is None:
        batch, _, _, dk = q.shape
        hv, dv = v.shape[-2:]
        state = mx.zeros((batch, hv, dv, dk), dtype=mx.float32)
    tree = _tree()
    if tree is not None:
        y, states = tree.recurrence(gated_delta_steps, (q, k, v, g, beta), state, mask)
    else:
        y, states = gated_delta_steps(q, k, v, g, beta, state, mask)
    _recorded(states)
    return y, states[:, -1]


def _recording_ssm(
    hidden_states: mx.array,
    A_log: mx.array,
    B: mx.array,
    C: mx.array,
    D: mx.array,
    dt: mx.array,
    dt_bias: mx.array,
    state: mx.array | None = None,
    time_step_limit: tuple[float, float] = (0.001, 100.0),
    mask: mx.array | None = None,
    lengths: mx.array | None = None,
) -> tuple[mx.array, mx.array]:
    """mlx-lm's `ssm_update`, recording the state after every token."""
    from ..kernels.ssm import ssm_steps

    if lengths is not None:  # a right-padded prompt: not a verify, leave no record
        from mlx_lm.models.ssm import ssm_update

        return ssm_update(
            hidden_states, A_log, B, C, D, dt, dt_bias, state, time_step_limit, mask, lengths
        )
    tree = _tree()
    if tree is not None:

        def steps(x: mx.array, b: mx.array, c: mx.array, t: mx.array, s: Any, m: Any) -> Any:
            return ssm_steps(x, A_log, b, c, D, t, dt_bias, s, time_step_limit, m)

        y, states = tree.recurrence(steps, (hidden_states, B, C, dt), state, mask)
    else:
        y, states = ssm_steps(
            hidden_states, A_log, B, C, D, dt, dt_bias, state, time_step_limit, mask
        )
    _recorded(states)
    # mlx-lm's y is `... + x * D`: the dtype x and D promote to (float32 for a float32 D).
    return y.astype((hidden_states[:1, :1, :1, :1] * D[:1]).dtype), states[:, -1]


_RECURRENCES: dict[str, Callable[..., Any]] = {
    "gated_delta_update": _recording_gated_delta,
    "ssm_update": _recording_ssm,
}


def _tree() -> Any:
    record = _RECORD.get()
    return None if record is None else record.tree


def _recorded(states: mx.array) -> None:
    record = _RECORD.get()
    if record is not None:
        record.states = states


# ---------------------------------------------------------------------------------------
# The recording subclasses (one per mlx-lm class, made once).
# ---------------------------------------------------------------------------------------


def _recording_conv(cls: type) -> type:
    """A subclass of convolution class `cls` that records its input while a record is open."""
    return subclass("capture.conv", cls, _make_recording_conv)


def _make_recording_conv(cls: type, _: None) -> type:

    def __call__(self: nn.Module, x: mx.array) -> mx.array:
        record = _RECORD.get()
        if record is not None:
            record.conv_input = x
            if record.tree is not None:  # each token convolves its own ancestors' inputs
                out, record.conv_states = record.tree.conv(lambda w: cls.__call__(self, w), x)
                return out
        return cls.__call__(self, x)

    return with_body(cls, {"__call__": __call__})


def _recording_mixer(cls: type, spec: Mixer) -> type:
    """A subclass of mixer class `cls` whose call opens the record of its cache, and whose
    methods that call the recurrence are copies of mlx-lm's reading the recording one."""
    return subclass("capture.mixer", cls, _make_recording_mixer, spec)


def _make_recording_mixer(cls: type, spec: Mixer) -> type:
    body: dict[str, Any] = {}
    recurrence = spec.recurrence
    if recurrence is not None:
        recording_fn = _RECURRENCES[recurrence]
        body |= reading(cls, recurrence, lambda _: recording_fn)
    call = body.get("__call__", cls.__call__)
    signature = inspect.signature(call)

    def __call__(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        cache = signature.bind(self, *args, **kwargs).arguments.get("cache")
        record = getattr(cache, _RECORDS, None)
        if record is not None:
            record.mixer = spec
        token = _RECORD.set(record)
        try:
            return call(self, *args, **kwargs)
        finally:
            _RECORD.reset(token)

    body["__call__"] = __call__
    return with_body(cls, body)


# ---------------------------------------------------------------------------------------
# A recording forward
# ---------------------------------------------------------------------------------------


def known_mixers(model: nn.Module) -> list[tuple[nn.Module, Mixer]]:
    """The model's mixer instances kvstate knows how to record."""
    found = []
    for module in model.modules():
        spec = KNOWN_MIXERS.get(f"{type(module).__module__}.{type(module).__qualname__}")
        if spec is not None:
            found.append((module, spec))
    return found


@contextmanager
def recording(mixers: list[tuple[nn.Module, Mixer]], caches: list[Any]) -> Iterator[list[Record]]:
    """Open a record on every recurrent cache and give the known mixers their recording
    classes for the length of one forward. Yields the records, in state order."""
    recurrent = list(arrays_caches(caches))
    records = [Record() for _ in recurrent]
    try:
        for cache, record in zip(recurrent, records, strict=True):
            setattr(cache, _RECORDS, record)
        with swapped(_recording_classes(mixers)):
            yield records
    finally:
        for cache in recurrent:
            cache.__dict__.pop(_RECORDS, None)


def _recording_classes(mixers: list[tuple[nn.Module, Mixer]]) -> Iterator[tuple[Any, type]]:
    for mixer, spec in mixers:
        conv = getattr(mixer, spec.conv)
        yield mixer, _recording_mixer(type(mixer), spec)
        yield conv, _recording_conv(type(conv))


def step_checkpoints(record: Record, before: tuple[mx.array | None, ...], after: Any) -> Any:
    """One RecurrentState's checkpoints from its record: the convolution state (array 0) as a
    window of the recorded input, the recurrence's (array 1) as the recorded states."""
    assert record.conv_input is not None and record.mixer is not None
    width = after.arrays[0].shape[1]
    entries: list[Any] = [ConvWindow(record.conv_input, width=width)]
    if record.mixer.recurrence is not None:
        assert record.states is not None
        first = before[1] if before[1] is not None else mx.zeros_like(after.arrays[1])
        entries.append(StepStates(first.astype(record.states.dtype), record.states))
    entries += [None] * (len(after.arrays) - len(entries))
    return tuple(entries)
