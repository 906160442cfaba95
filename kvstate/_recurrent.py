"""RecurrentState: mlx-lm's ArraysCache (conv windows, SSM / linear-attention states).

The arrays have a fixed size: a forward overwrites them, so the state cannot be trimmed.
Rolling back a verify forward of K tokens takes *checkpoints*: for each array, an array
(B, K+1, ...) whose entry t along axis 1 is the array after t tokens of that forward
(t = 0: before it). A capturing forward (`wrapped(tokens, state, capture=True)`) returns
them; `commit_prefix` picks entry `counts[b]` for row b.

Batch semantics follow ArraysCache exactly (merge / filter / extend / extract), generalised
to states of several rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from ._checkpoints import Checkpoint, checkpoint_at, pick, problem
from ._errors import CheckpointRequiredError, ShapeError
from ._shared import shared_appended
from ._tree import State, trusted
from ._validation import array_problems, rows_problems, typed_statics
from .kinds import (
    Capabilities,
    batch_size_of,
    commit_rows,
    config_of,
    extend_states,
    extract_row,
    keep_path,
    merge_states,
    problems,
    state_class,
    static_field,
    take_rows,
)


@state_class(
    Capabilities(trimmable=False, ragged_commit=True, batchable=True, needs_checkpoints=True)
)
class RecurrentState(State):
    """Fixed-size recurrent arrays (conv window, SSM / linear-attention state), each (B, ...).

    Not trimmable: `commit_prefix` needs the checkpoints a capturing forward returns.
    `left_padding` / `lengths` (B,) mirror mlx-lm's ArraysCache batch bookkeeping.
    """

    arrays: tuple[mx.array | None, ...] = ()
    left_padding: mx.array | None = None
    lengths: mx.array | None = None
    appended: int = static_field(default=0)


Checkpoints = tuple[Checkpoint | None, ...]
"""One entry per `RecurrentState.arrays` entry (see `_checkpoints`), or None."""


def is_empty(state: RecurrentState) -> bool:
    """Nothing written yet. (ArraysCache.empty() looks at the first array only, so its merge
    would drop the other arrays of a state whose first one is None; every array counts here.)"""
    return all(a is None for a in state.arrays)


@problems.register
def _(state: RecurrentState, values: bool) -> list[str]:
    found = typed_statics(state, appended=0)
    if not isinstance(state.arrays, tuple):
        return [*found, f"arrays: must be a tuple; got a {type(state.arrays).__name__}"]
    arrays = [(i, a) for i, a in enumerate(state.arrays) if a is not None]
    for i, a in arrays:
        found += array_problems(f"arrays[{i}]", a)
        if not found and a.ndim < 1:
            found.append(f"arrays[{i}]: needs a leading batch axis; got a scalar")
    if found:
        return found
    batches = {int(a.shape[0]) for _, a in arrays}
    if len(batches) > 1:
        shapes = [f"[{i}] {tuple(a.shape)}" for i, a in arrays]
        return [f"arrays: batch sizes {sorted(batches)} differ ({', '.join(shapes)})"]
    batch = batch_size_of(state)
    source = "arrays" if arrays else "left_padding"  # as batch_size_of reads them
    found += rows_problems("left_padding", state.left_padding, batch, source)
    found += rows_problems("lengths", state.lengths, batch, source)
    return found


@batch_size_of.register
def _(state: RecurrentState) -> int:
    # The order of ArraysCache.batch_size: arrays, then left_padding, then lengths.
    for a in state.arrays:
        if a is not None:
            return int(a.shape[0])
    for bookkeeping in (state.left_padding, state.lengths):
        if bookkeeping is not None:
            return int(bookkeeping.size)
    return 1


@config_of.register
def _(state: RecurrentState) -> dict[str, Any]:
    # None (an array not written yet) matches anything.
    arrays = tuple(
        None if a is None else {"dtype": str(a.dtype), "shape": tuple(int(n) for n in a.shape[1:])}
        for a in state.arrays
    )
    return {"kind": "RecurrentState", "count": len(state.arrays), "arrays": arrays}


@take_rows.register
def _(state: RecurrentState, rows: tuple[int, ...]) -> RecurrentState:
    index = mx.array(rows, mx.int32)
    arrays = tuple(None if a is None else a[index] for a in state.arrays)
    left_padding = None if state.left_padding is None else state.left_padding[index]
    lengths = None if state.lengths is None else state.lengths[index]
    return _keeping_rows(
        trusted(RecurrentState)(arrays, left_padding, lengths, state.appended), len(rows)
    )


def _keeping_rows(state: RecurrentState, batch: int) -> RecurrentState:
    """An empty state without bookkeeping has no batch axis: give its `batch` rows zero left
    padding (as ArraysCache.merge does) so that they are not lost."""
    if (
        batch == 1
        or not is_empty(state)
        or state.left_padding is not None
        or state.lengths is not None
    ):
        return state
    return trusted(RecurrentState)(state.arrays, mx.zeros((batch,), mx.int32), None, state.appended)


def _zeros_like_rows(like: mx.array, batch: int) -> mx.array:
    return mx.zeros((batch, *like.shape[1:]), like.dtype)


def _concat_rows(parts: Sequence[mx.array | None], batches: Sequence[int]) -> mx.array | None:
    """Concatenate along the batch axis, zeros for the parts that are None (ArraysCache's `cat`)."""
    like = next((p for p in reversed(parts) if p is not None), None)
    if like is None:
        return None
    filled = [
        p if p is not None else _zeros_like_rows(like, b)
        for p, b in zip(parts, batches, strict=True)
    ]
    return mx.concatenate(filled)


@merge_states.register
def _(first: RecurrentState, rest: Sequence[RecurrentState]) -> RecurrentState:
    states = [first, *rest]
    batches = [batch_size_of(s) for s in states]
    if all(is_empty(s) for s in states):
        # ArraysCache.merge: an all-empty merge only records the rows, as zero left padding
        # (a state's own left padding, if it has one, is kept: it describes its next input).
        paddings = [
            s.left_padding if s.left_padding is not None else mx.zeros((b,), mx.int32)
            for s, b in zip(states, batches, strict=True)
        ]
        return trusted(RecurrentState)(
            (None,) * len(first.arrays),
            left_padding=mx.concatenate(paddings),
            appended=shared_appended(states),
        )
    # Otherwise every array is stacked (zeros for states that lack it); ArraysCache.merge
    # drops left_padding and lengths: a written recurrent state has no positions to pad.
    arrays = tuple(
        _concat_rows([s.arrays[e] for s in states], batches) for e in range(len(first.arrays))
    )
    return trusted(RecurrentState)(arrays, appended=shared_appended(states))


@extend_states.register
def _(a: RecurrentState, b: RecurrentState) -> RecurrentState:
    # ArraysCache.extend: concatenate every array and the bookkeeping, zeros where one is None.
    batches = [batch_size_of(a), batch_size_of(b)]
    arrays = tuple(_concat_rows([x, y], batches) for x, y in zip(a.arrays, b.arrays, strict=True))
    extended = trusted(RecurrentState)(
        arrays,
        _concat_rows([a.left_padding, b.left_padding], batches),
        _concat_rows([a.lengths, b.lengths], batches),
        shared_appended([a, b]),
    )
    return _keeping_rows(extended, sum(batches))


@extract_row.register
def _(state: RecurrentState, row: int) -> RecurrentState:
    # ArraysCache.extract: the row's arrays, no bookkeeping.
    arrays = tuple(None if a is None else a[row : row + 1] for a in state.arrays)
    return trusted(RecurrentState)(arrays, appended=state.appended)


def _check_checkpoints(state: RecurrentState, checkpoints: Any) -> Checkpoints:
    """Every mismatch between `checkpoints` and what `state` needs, reported at once."""
    n = len(state.arrays)
    if not isinstance(checkpoints, (tuple, list)) or len(checkpoints) != n:
        got = (
            f"{len(checkpoints)} entries"
            if isinstance(checkpoints, (tuple, list))
            else type(checkpoints).__name__
        )
        raise ShapeError(
            f"checkpoints for a RecurrentState of {n} arrays must be a tuple of {n} entries "
            f"(one per array); got {got}. Pass the checkpoints the capturing forward of this "
            "same state returned"
        )
    batch, steps = batch_size_of(state), state.appended
    problems = []
    for i, (a, c) in enumerate(zip(state.arrays, checkpoints, strict=True)):
        if a is None:
            if c is not None:
                problems.append(
                    f"[{i}]: the state has no array here, so the checkpoint must be None"
                )
            continue
        found = problem(c, a, batch, steps)
        if found:
            problems.append(f"[{i}]: {found}")
    if problems:
        raise ShapeError(
            f"checkpoints do not fit this RecurrentState (B={batch}, last forward appended "
            f"{state.appended} tokens, so K+1={steps + 1}): " + "; ".join(problems) + ". Pass "
            "the checkpoints the capturing forward that produced this state returned"
        )
    return tuple(checkpoints)


@commit_rows.register
def _(state: RecurrentState, counts: tuple[int, ...], checkpoints: Any) -> RecurrentState:
    checked = None if checkpoints is None else _check_checkpoints(state, checkpoints)
    if all(c == state.appended for c in counts):
        # Keep everything: nothing to roll back, so no checkpoints are needed.
        return trusted(RecurrentState)(state.arrays, state.left_padding, state.lengths)
    if checked is None:
        raise CheckpointRequiredError(
            f"a RecurrentState cannot be trimmed: keeping {list(counts)} of the "
            f"{state.appended} tokens its last forward appended needs the state after each "
            "token. Run the verify forward with `capture=True` "
            "(`logits, state, checkpoints = wrapped(tokens, state, capture=True)`) and pass "
            "its checkpoints: `commit_prefix(state, accepted, checkpoints)`"
        )
    # mlx-lm's advance(n) lowers left_padding and lengths by n per forward: a forward of
    # counts[b] tokens would have lowered them by that much, not by `appended`.
    rejected = mx.array([state.appended - c for c in counts], mx.int32)

    def unadvance(x: mx.array | None) -> mx.array | None:
        return None if x is None else x + rejected.astype(x.dtype)

    return trusted(RecurrentState)(
        tuple(None if c is None else pick(c, counts) for c in checked),
        unadvance(state.left_padding),
        unadvance(state.lengths),
        appended=0,
    )


@keep_path.register
def _(
    state: RecurrentState, positions: tuple[int, ...], checkpoints: Any, gathered: Any
) -> RecurrentState:
    """The checkpoint after the path's last position (nothing moves: no `gather_path`)."""
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
        arrays.append(checkpoint_at(c, positions[-1] + 1))
    if found:
        raise ShapeError("tree commit: checkpoints do not fit: " + "; ".join(found))
    return trusted(RecurrentState)(tuple(arrays), state.left_padding, state.lengths)
