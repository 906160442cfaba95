"""Commit one root-to-node path of a tree forward (`WrappedModel.tree_forward`).

A tree forward appended its T tokens to every attention layer in input order, and left in
each recurrent layer the state after its last input. Keeping the path at input positions
`kept` (0 first, increasing) means:
- KV layers (dense, and unpadded sliding windows, which a multi-token forward leaves in
  temporal order with its tokens last): gather the path's keys and values into place
  (positions start + i), then `commit_prefix` to the path's length (a window rebuilds from
  the state before the forward); the keys carry their RoPE at their depth, which is their
  final position;
- recurrent layers: the checkpoint after the path's last position (the tree forward's
  checkpoints are indexed by input position, entry t = after position t - 1).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import mlx.core as mx

from .._checkpoints import checkpoint_at, problem
from .._dense import DenseKV
from .._errors import ShapeError, StateError
from .._recurrent import RecurrentState
from .._rotating import RotatingKV
from .._transforms import commit_prefix
from .._tree import replace
from ..kinds import Composite, with_parts


def commit_path(state: Any, kept: Sequence[int], checkpoints: Any) -> Any:
    """`state` (batch 1, after a tree forward) keeping only input positions `kept`."""
    kept = tuple(kept)
    blocks = {}
    if list(kept) != list(range(len(kept))):  # the path is not already in place
        blocks = {id(layer): _gathered(layer, kept) for layer in _attention_layers(state)}
        # Evaluate the small gathered blocks first, all layers in one sync: with a gather
        # still pending MLX cannot write into the buffer in place and would copy the whole
        # context.
        mx.eval(list(blocks.values()))
    return _commit(state, kept, checkpoints, blocks)


def _attention_layers(state: Any) -> Iterator[DenseKV | RotatingKV]:
    """The KV layers whose path entries move (the others are refused by `_commit`)."""
    if isinstance(state, Composite):
        for part in state.parts:
            yield from _attention_layers(part)
    elif isinstance(state, (DenseKV, RotatingKV)) and state.keys is not None:
        padded_window = isinstance(state, RotatingKV) and state.left_padding is not None
        if not padded_window:
            yield state


def _start(state: DenseKV | RotatingKV) -> int:
    """Where the tree forward's first token sits in the layer's buffer."""
    if isinstance(state, RotatingKV):
        # A multi-token forward leaves the window in temporal order, its tokens last.
        assert state.keys is not None
        return int(state.keys.shape[2]) - state.appended
    return state.length - state.appended


def _gathered(state: DenseKV | RotatingKV, kept: tuple[int, ...]) -> list[mx.array]:
    """The path's keys and values, in path order."""
    start = _start(state)
    index = mx.array([start + q for q in kept], mx.int32)
    assert state.keys is not None and state.values is not None
    return [mx.take(a, index, axis=2) for a in (state.keys, state.values)]


def _commit(
    state: Any, kept: tuple[int, ...], checkpoints: Any, blocks: dict[int, list[mx.array]]
) -> Any:
    if isinstance(state, Composite):
        parts = state.parts
        per_part = checkpoints if checkpoints is not None else (None,) * len(parts)
        if not isinstance(per_part, (tuple, list)) or len(per_part) != len(parts):
            raise ShapeError(
                f"tree commit: checkpoints for a {type(state).__name__} of {len(parts)} parts "
                "must be a tuple of as many entries; pass what the tree forward returned"
            )
        pairs = zip(parts, per_part, strict=True)
        return with_parts(state, tuple(_commit(p, kept, c, blocks) for p, c in pairs))
    if isinstance(state, (DenseKV, RotatingKV)):
        return _commit_attention(state, kept, blocks.get(id(state)))
    if isinstance(state, RecurrentState):
        return _commit_recurrent(state, kept, checkpoints)
    raise StateError(
        f"tree commit: a {type(state).__name__} layer cannot keep a tree path (supported: "
        "DenseKV, unpadded RotatingKV and RecurrentState layers)"
    )


def _commit_attention(
    state: DenseKV | RotatingKV, kept: tuple[int, ...], moved: list[mx.array] | None
) -> Any:
    if state.keys is None or state.values is None:
        raise StateError("tree commit: a KV layer holds nothing; run the tree forward first")
    if isinstance(state, RotatingKV) and state.left_padding is not None:
        raise StateError("tree commit: a batched sliding window cannot keep a tree path")
    if moved is not None:  # gathered (and evaluated) by commit_path
        start = _start(state)

        def fill(a: mx.array, block: mx.array) -> mx.array:
            out = a[...]  # a fresh object: the assignment must not reach `state`
            out[..., start : start + len(kept), :] = block
            return out

        state = replace(state, keys=fill(state.keys, moved[0]), values=fill(state.values, moved[1]))
    return commit_prefix(state, len(kept))


def _commit_recurrent(
    state: RecurrentState, kept: tuple[int, ...], checkpoints: Any
) -> RecurrentState:
    n = len(state.arrays)
    if not isinstance(checkpoints, (tuple, list)) or len(checkpoints) != n:
        raise ShapeError(
            f"tree commit: a RecurrentState of {n} arrays needs a tuple of {n} checkpoints; "
            f"got {type(checkpoints).__name__}. Pass what the tree forward returned"
        )
    found = []
    arrays: list[mx.array | None] = []
    for i, (a, c) in enumerate(zip(state.arrays, checkpoints, strict=True)):
        if a is None or c is None:
            if (a is None) != (c is None):
                found.append(f"[{i}]: array and checkpoint must both be None or neither")
            arrays.append(None)
            continue
        why = problem(c, a, 1, state.appended)
        if why:
            found.append(f"[{i}]: {why}")
            continue
        arrays.append(checkpoint_at(c, kept[-1] + 1))
    if found:
        raise ShapeError("tree commit: checkpoints do not fit: " + "; ".join(found))
    return RecurrentState(tuple(arrays), state.left_padding, state.lengths)
