"""One forward of an mlx-lm model over a kvstate state: the one place a model runs.

state -> fresh mlx-lm cache objects (O(1)) -> the model -> a new state, each layer stamped
with the tokens it appended (`from_cache(cache, width)`, and `record_forward` for kinds that
have their own). Options: `lengths` for a right-padded prompt batch (mlx-lm's prepare /
finalize around the call), `capture` for a verify forward that also returns recurrent
checkpoints (see `instruments.capture`), `projections` for the final hidden states (see
`instruments.hidden`), `caches` for cache objects that already hold the state (see
`kept_caches`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import ExitStack
from typing import Any, NamedTuple

import mlx.core as mx
import mlx.nn as nn

from kvstate import ModelState, RecurrentState
from kvstate.kinds import Composite, record_forward, trusted

from ..caches.registry import CONVERTERS, converter_of, to_cache
from ..caches.walk import arrays_caches
from ..instruments.buckets import AUTO, Bucketing, bucketing
from ..instruments.capture import Mixer, Record, recording, step_checkpoints
from ..instruments.hidden import Projection, hidden_states, recording_hidden
from ..instruments.routing import needs_routing, route_attention


class Forward(NamedTuple):
    logits: mx.array
    state: ModelState
    checkpoints: Any  # None unless capture=True
    hidden: mx.array | None = None  # (B, K, D) when projections were given
    caches: list[Any] | None = None  # the cache objects the model ran on, now holding `state`


def run(
    model: nn.Module,
    tokens: mx.array,
    state: ModelState,
    *,
    lengths: Sequence[int] | None = None,
    capture: bool = False,
    mixers: list[tuple[nn.Module, Mixer]] | None = None,
    convert: Callable[[Any], Any] = to_cache,
    projections: list[Projection] | None = None,
    caches: list[Any] | None = None,
    policy: Bucketing = AUTO,
) -> Forward:
    """Run `tokens` (B, K) through `model` from `state` (both already checked).

    With `capture`, `mixers` are the model's known mixer instances (`instruments.capture.known_mixers`).
    `model(tokens, cache=caches)` returns the logits; `convert` makes its cache objects
    (mlx-lm's by default; the mlx-vlm model passes mlx-vlm's). With `projections` (the model's
    `instruments.hidden.output_projections`), also the input of its output projection. `caches`: cache
    objects that already hold exactly `state` (those a previous plain forward returned), used
    instead of converting it. `policy`: where the key length is bucketed (see `buckets`).
    """
    if caches is None:
        caches = open_caches(model, state, convert)
    width = tokens.shape[1]
    padded = lengths is not None and any(n != width for n in lengths)
    if padded:
        assert lengths is not None
        for c in caches:
            c.prepare(lengths=list(lengths), right_padding=[width - n for n in lengths])
    records: list[Record] | None = None
    sink: list[mx.array] | None = None
    with ExitStack() as scope:
        if policy.enabled(width):
            scope.enter_context(bucketing(caches, model if policy.kernel else None))
        if capture and not any(c.lengths is not None for c in arrays_caches(caches)):
            records = scope.enter_context(recording(mixers or [], caches))
        if projections is not None:
            sink = scope.enter_context(recording_hidden(projections))
        logits = model(tokens, cache=caches)
    hidden = None if sink is None else hidden_states(sink, logits, model)
    if padded:
        for c in caches:
            c.finalize()
    new = read_back(caches, state.layers, width)
    if not capture:
        return Forward(logits, new, None, hidden, caches)
    if records is not None and all(r.complete() for r in records):
        made = iter(records)
        checkpoints = per_recurrent(
            state, new, lambda b, a: step_checkpoints(next(made), b.arrays, a)
        )
        return Forward(logits, new, checkpoints, hidden)
    return Forward(logits, new, replay_checkpoints(model, tokens, state, new, convert), hidden)


def open_caches(
    model: nn.Module, state: ModelState, convert: Callable[[Any], Any] = to_cache
) -> list[Any]:
    """New cache objects holding `state` (`convert` per layer), with kvstate's attention
    routed in where a QuantizedKV needs it."""
    caches = [convert(layer) for layer in state.layers]
    if needs_routing(model, caches):  # a QuantizedKV that only kvstate's attention reads
        route_attention(model)
    return caches


def read_back(caches: list[Any], befores: Sequence[Any], width: int) -> ModelState:
    """The state `caches` hold after a forward of `width` tokens from the layers `befores`:
    each layer stamped with the tokens it appended (this runs every decode step: only kinds
    with their own `record_forward` pay for a second dispatch, and only they read `befores`)."""
    layers = []
    for c, before in zip(caches, befores, strict=True):
        layer = (CONVERTERS.get(c.__class__) or converter_of(c))(c, width)
        layers.append(record_forward(layer, before, width) if own_stamp(layer) else layer)
    return trusted(ModelState)(tuple(layers))


_STAMPS: dict[type, bool] = {}


def own_stamp(layer: Any) -> bool:
    """Whether `layer`'s kind has its own `record_forward` (windows keep what a multi-token
    forward evicted); for the others `from_cache(cache, width)` already stamped it."""
    cls = type(layer)
    own = _STAMPS.get(cls)
    if own is None:
        own = _STAMPS[cls] = record_forward.dispatch(cls) is not record_forward.dispatch(object)
    return own


def replay_checkpoints(
    model: nn.Module,
    tokens: mx.array,
    state: ModelState,
    final: ModelState,
    convert: Callable[[Any], Any] = to_cache,
) -> Any:
    """Checkpoints of a recurrent layer kvstate cannot record: tokens 0..K-2 again, one at a
    time, from the state before the forward, keeping only the recurrent arrays of each step
    (the rest of each replayed state is dropped at once, so MLX updates the replay's KV
    buffers in place). Cost: K-1 single-token forwards."""
    steps = [_recurrent_arrays(state)]
    current = state
    for t in range(tokens.shape[1] - 1):
        current = run(model, tokens[:, t : t + 1], current, convert=convert).state
        steps.append(_recurrent_arrays(current))
    del current
    steps.append(_recurrent_arrays(final))
    position = iter(range(len(steps[0])))

    def stacked(before: RecurrentState, after: RecurrentState) -> Any:
        i = next(position)
        return _stacked([s[i] for s in steps], after)

    return per_recurrent(state, final, stacked)


def _recurrent_arrays(state: ModelState) -> list[tuple[mx.array | None, ...]]:
    """The arrays of every RecurrentState of `state`, in state order."""
    found: list[tuple[mx.array | None, ...]] = []
    per_recurrent(state, state, lambda b, a: found.append(a.arrays))
    return found


def per_recurrent(
    before: Any, after: Any, fn: Callable[[RecurrentState, RecurrentState], Any]
) -> Any:
    """`fn(before, after)` at every RecurrentState, in the checkpoints' structure (a tuple per
    composite, None at every other part)."""
    if isinstance(after, Composite):
        pairs = zip(before.parts, after.parts, strict=True)
        return tuple(per_recurrent(b, a, fn) for b, a in pairs)
    if isinstance(after, RecurrentState):
        return fn(before, after)
    return None


def _stacked(steps: list[tuple[mx.array | None, ...]], after: RecurrentState) -> Any:
    """Per-step arrays of one RecurrentState -> one (B, K+1, ...) checkpoint per array. None
    before a layer's first forward means zeros to every mlx-lm recurrent layer."""

    def filled(step: mx.array | None, final: mx.array) -> mx.array:
        return mx.zeros_like(final) if step is None else step.astype(final.dtype)

    return tuple(
        None if final is None else mx.stack([filled(s[i], final) for s in steps], 1)
        for i, final in enumerate(after.arrays)
    )
