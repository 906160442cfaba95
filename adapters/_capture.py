"""The capturing forward: `logits, state, checkpoints = wrapped(tokens, state, capture=True)`.

Checkpoints mirror the state: a tuple per layer of a ModelState, a tuple per part of a
ListState, a tuple of (B, K+1, ...) arrays per RecurrentState (entry t along axis 1: the
array after t tokens of the verify, t = 0 before it; None where the state's array is None),
and None for every non-recurrent part. An array that is None before the verify (a layer
never run) is checkpointed as zeros, which is what every mlx-lm recurrent layer reads None as.

Two ways to get them, chosen automatically:

- Fast path, for the recurrent mixers kvstate knows (`KNOWN_MIXERS`: the Mamba2 mixers of
  mamba2 / nemotron_h / falcon_h1 / granitemoehybrid, the gated delta nets of qwen3_next /
  qwen3_5, lfm2's short convolutions). For the length of one forward, those layer
  *instances* (never the mlx-lm classes) get a subclass whose `__call__` runs its K tokens
  through the original mixer one at a time and records the cache arrays after each. A mixer
  is causal token by token, so the outputs are those of K decode steps; attention, MLP and
  every other layer still see all K tokens at once. One model forward, no replay.
- Fallback, for any other recurrent layer (or a mask the fast path does not know): the
  verify forward runs as a plain K-token forward (its logits and state are exactly those
  of `capture=False`), then tokens 0..K-2 are replayed one at a time through the whole
  model from the state before the verify, keeping only the recurrent arrays of each step
  (the rest of each replayed state is dropped at once, so MLX can update the replay's KV
  buffers in place). Entry K is the verify's own array. Cost: K-1 extra single-token
  forwards and, when the caller keeps the state it passed in, one copy of the KV buffers.

Either way the new state is what a K-token forward gives: KV layers appended K tokens,
window kinds keep `previous`, every part has `appended=K`; `commit_prefix` then trims the
KV layers and picks each recurrent array's checkpoint.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, CacheList

from kvstate import ModelState, RecurrentState
from kvstate.kinds import Composite, record_forward

from ._convert import from_mlx_lm, to_mlx_lm

if TYPE_CHECKING:
    from ._wrap import WrappedModel

KNOWN_MIXERS = frozenset(
    {
        "mlx_lm.models.mamba2.Mamba2Block",
        "mlx_lm.models.nemotron_h.NemotronHMamba2Mixer",
        "mlx_lm.models.falcon_h1.FalconH1Mixer",
        "mlx_lm.models.granitemoehybrid.GraniteMoeHybridMamba2Mixer",
        "mlx_lm.models.qwen3_next.Qwen3NextGatedDeltaNet",
        "mlx_lm.models.qwen3_5.GatedDeltaNet",
        "mlx_lm.models.lfm2.ShortConv",
        "mlx_lm.models.lfm2_moe.ShortConv",
    }
)
"""Mixers called as `mixer(hidden (B, S, D), ..., mask=(B, S) bool or None, cache=ArraysCache)`
whose output at token t depends only on token t and the cache: they can run token by token."""

_STEPS = "_kvstate_steps"  # on an ArraysCache during a capture: the arrays after each token


def forward_capturing(
    wrapped: WrappedModel, tokens: mx.array, state: ModelState
) -> tuple[mx.array, ModelState, Any]:
    """A verify forward of `tokens` (B, K) that also returns recurrent checkpoints.

    Returns `(logits (B, K, vocab), new_state, checkpoints)`; pass `checkpoints` to
    `commit_prefix(new_state, accepted, checkpoints)`.
    """
    k = tokens.shape[1]
    caches = to_mlx_lm(state)
    recurrent = list(_arrays_caches(caches))
    for c in recurrent:
        setattr(c, _STEPS, [])
    with _recording_mixers(wrapped.model):
        logits = wrapped.model(tokens, cache=caches)
    steps = [c.__dict__.pop(_STEPS) for c in recurrent]
    if recurrent and any(len(s) != k for s in steps):
        return _forward_replaying(wrapped, tokens, state)  # a layer the fast path missed
    final = record_forward(from_mlx_lm(caches), state, k)
    per_cache = iter(steps)
    recorded = _map_recurrent(state, lambda s: [s.arrays, *next(per_cache)])
    return logits, final, _stack(recorded, recurrent_arrays(final))


# ---------------------------------------------------------------------------------------
# Fast path: record inside known mixers.
# ---------------------------------------------------------------------------------------


def _arrays_caches(caches: Any) -> Iterator[ArraysCache]:
    """Every ArraysCache of a model's caches, in state order (CacheList parts included)."""
    for c in caches if isinstance(caches, list) else [caches]:
        if isinstance(c, CacheList):
            yield from _arrays_caches(list(c.caches))
        elif isinstance(c, ArraysCache):
            yield c


_RECORDING: dict[type, type] = {}


def _recording_class(cls: type) -> type:
    """A subclass of mixer class `cls` that runs tokens one at a time into a recording cache."""
    if cls in _RECORDING:
        return _RECORDING[cls]
    signature = inspect.signature(cls.__call__)
    hidden = list(signature.parameters)[1]  # the parameter after `self`
    original = cls.__call__

    def __call__(self: nn.Module, *args: Any, **kwargs: Any) -> mx.array:
        bound = signature.bind(self, *args, **kwargs)
        cache: Any = bound.arguments.get("cache")
        mask: Any = bound.arguments.get("mask")
        steps = getattr(cache, _STEPS, None)
        if steps is None or not (mask is None or (isinstance(mask, mx.array) and mask.ndim == 2)):
            return original(self, *args, **kwargs)  # not recording (or a mask we cannot split)
        x = bound.arguments[hidden]
        outputs = []
        for t in range(x.shape[1]):
            bound.arguments[hidden] = x[:, t : t + 1]
            if mask is not None:
                bound.arguments["mask"] = mask[:, t : t + 1]
            outputs.append(original(*bound.args, **bound.kwargs))
            steps.append(tuple(cache.cache))
        return outputs[0] if len(outputs) == 1 else mx.concatenate(outputs, axis=1)

    _RECORDING[cls] = type(
        cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__}
    )
    return _RECORDING[cls]


@contextmanager
def _recording_mixers(model: nn.Module) -> Iterator[None]:
    """Give the known mixer instances of `model` their recording subclass, then take it back."""
    patched = [
        (m, type(m))
        for m in model.modules()
        if f"{type(m).__module__}.{type(m).__qualname__}" in KNOWN_MIXERS
    ]
    try:
        for m, cls in patched:
            m.__class__ = _recording_class(cls)
        yield
    finally:
        for m, cls in patched:
            m.__class__ = cls


# ---------------------------------------------------------------------------------------
# Fallback: replay the whole model token by token.
# ---------------------------------------------------------------------------------------


def _forward_replaying(
    wrapped: WrappedModel, tokens: mx.array, state: ModelState
) -> tuple[mx.array, ModelState, Any]:
    logits, final = wrapped.forward(tokens, state)
    steps = [recurrent_arrays(state)]
    current = state
    for t in range(tokens.shape[1] - 1):
        _, current = wrapped.forward(tokens[:, t : t + 1], current)
        steps.append(recurrent_arrays(current))
    del current  # only the recurrent arrays are kept; the replayed KV buffers are not
    last = recurrent_arrays(final)
    steps.append(last)
    return logits, final, _stack(_per_step(state, steps), last)


# ---------------------------------------------------------------------------------------
# Checkpoint structure.
# ---------------------------------------------------------------------------------------


def _map_recurrent(state: Any, fn: Callable[[RecurrentState], Any]) -> Any:
    """`fn` of every RecurrentState, in the checkpoints' structure (None elsewhere)."""
    if isinstance(state, Composite):
        return tuple(_map_recurrent(s, fn) for s in state.parts)
    if isinstance(state, RecurrentState):
        return fn(state)
    return None


def recurrent_arrays(state: Any) -> Any:
    """The recurrent arrays of a state, in the checkpoints' structure (None elsewhere)."""
    return _map_recurrent(state, lambda s: s.arrays)


def _per_step(state: Any, steps: list[Any]) -> Any:
    """Per-step `recurrent_arrays` structures -> the checkpoints' structure with, at each
    RecurrentState, the list of its array tuples, one per step."""
    if isinstance(state, Composite):
        return tuple(_per_step(x, [s[i] for s in steps]) for i, x in enumerate(state.parts))
    if isinstance(state, RecurrentState):
        return list(steps)
    return None


def _stack(recorded: Any, final: Any) -> Any:
    """At each RecurrentState, its list of per-step array tuples (before, after 1, ...,
    after K) -> a tuple of (B, K+1, ...) arrays. `final` is `recurrent_arrays` of the new
    state."""
    if recorded is None:
        return None
    if isinstance(recorded, tuple):
        return tuple(_stack(r, f) for r, f in zip(recorded, final, strict=True))
    return tuple(
        None if f is None else _stack_arrays([step[i] for step in recorded], f)
        for i, f in enumerate(final)
    )


def _stack_arrays(steps: list[mx.array | None], final: mx.array) -> mx.array:
    # None before a layer's first forward means zeros to every recurrent layer.
    filled = [mx.zeros_like(final) if s is None else s.astype(final.dtype) for s in steps]
    return mx.stack(filled, axis=1)
