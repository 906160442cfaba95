"""Recurrent checkpoints: the state of one recurrent array after every token of a verify
forward of K tokens, in one of three forms (each a pytree, so `kvstate.tree_map` gathers rows
of them like a state's):

- an mx.array (B, K+1, ...): entry t is the array after t tokens (t = 0: before the forward);
- `ConvWindow`: a convolution state is the last `width` inputs the convolution saw, so all K+1
  of them are windows of one widened input (B, width + K, C): no copies at all;
- `StepStates`: the state before the forward and the K states after each token, kept apart so
  that recording them does not copy the state before.

`pick` reads the state after `counts[b]` tokens for every row b, copying only that state.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from ._tree import State, frozen_state, static_field


@frozen_state
class ConvWindow(State):
    """A convolution state's checkpoints: after t tokens, inputs[:, t : t + width].
    inputs (B, width + K, C)."""

    inputs: mx.array
    width: int = static_field()


@frozen_state
class StepStates(State):
    """A recurrence's checkpoints: after t tokens, `before` (t = 0) or after[:, t - 1].
    before (B, ...), after (B, K, ...)."""

    before: mx.array
    after: mx.array


Checkpoint = mx.array | ConvWindow | StepStates


def problem(checkpoint: Any, array: mx.array, batch: int, steps: int) -> str | None:
    """Why `checkpoint` cannot give `array`'s value after 0..steps tokens (None if it can)."""
    if isinstance(checkpoint, ConvWindow):
        want = (batch, array.shape[1] + steps, *array.shape[2:])
        got, dtype = tuple(checkpoint.inputs.shape), checkpoint.inputs.dtype
        if checkpoint.width != array.shape[1]:
            return f"a ConvWindow of width {checkpoint.width} for a state of {array.shape[1]}"
    elif isinstance(checkpoint, StepStates):
        want = (batch, steps, *array.shape[1:])
        got, dtype = tuple(checkpoint.after.shape), checkpoint.after.dtype
        if tuple(checkpoint.before.shape) != tuple(array.shape):
            return f"StepStates.before has shape {tuple(checkpoint.before.shape)}"
    elif isinstance(checkpoint, mx.array):
        want = (batch, steps + 1, *array.shape[1:])
        got, dtype = tuple(checkpoint.shape), checkpoint.dtype
    else:
        return f"expected an array, ConvWindow or StepStates, got {type(checkpoint).__name__}"
    if got != want or dtype != array.dtype:
        return f"expected shape {want} dtype {array.dtype}, got shape {got} dtype {dtype}"
    return None


def checkpoint_at(checkpoint: Checkpoint, t: int) -> mx.array:
    """The recurrent array after `t` tokens of the verify forward, for every row (B, ...)."""
    return _pick_uniform(checkpoint, t)


def pick(checkpoint: Checkpoint, counts: tuple[int, ...]) -> mx.array:
    """The state after counts[b] tokens for every row b, in a buffer of its own (a view
    would keep the whole checkpoint alive as long as the state)."""
    if len(set(counts)) == 1:
        return _pick_uniform(checkpoint, counts[0])
    index = mx.array(counts, mx.int32)
    if isinstance(checkpoint, ConvWindow):
        positions = index[:, None] + mx.arange(checkpoint.width, dtype=mx.int32)[None]
        return mx.take_along_axis(checkpoint.inputs, positions[..., None], axis=1)
    if isinstance(checkpoint, StepStates):
        after = _along_axis_1(checkpoint.after, mx.maximum(index - 1, 0))
        chosen = (index == 0).reshape(-1, *([1] * (after.ndim - 1)))
        return mx.where(chosen, checkpoint.before, after)
    return _along_axis_1(checkpoint, index)


def _pick_uniform(checkpoint: Checkpoint, count: int) -> mx.array:
    if isinstance(checkpoint, ConvWindow):
        return mx.take(checkpoint.inputs, mx.arange(count, count + checkpoint.width), axis=1)
    if isinstance(checkpoint, StepStates):
        if count == 0:
            return checkpoint.before  # the pre-verify state holds this buffer anyway
        return mx.take(checkpoint.after, count - 1, axis=1)
    return mx.take(checkpoint, count, axis=1)


def _along_axis_1(a: mx.array, index: mx.array) -> mx.array:
    """a[b, index[b]] for every row b."""
    at = index.reshape(-1, 1, *([1] * (a.ndim - 2)))
    return mx.take_along_axis(a, at, axis=1).squeeze(1)
