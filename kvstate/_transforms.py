"""The public transforms. Each validates its input once, here, then dispatches on the state's
kind to the implementation that kind registered (see `kvstate.kinds`).

Every function is pure: it returns a new state and never changes its inputs.

A pending forward (`appended`: what the last forward added, and what a window needs to roll it
back) survives every transform that keeps rows: `row_select`, `tile`, `filter` and `extract`
keep it per row, and `merge` / `extend` keep it when every input has the same one (else the
result has none pending). So a verify can be split, regrouped and then committed; rearrange
its checkpoints the same way (`kvstate.tree_map(lambda c: c[rows], checkpoints)`).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from typing import Any, TypeVar

import mlx.core as mx

from ._errors import CommitError, ConfigMismatchError, RowError, StateError, require
from ._shared import config_mismatches
from ._tree import State, nbytes
from ._trust import inherit
from ._validation import as_int, as_ints
from .kinds import (
    Capabilities,
    Composite,
    appended_of,
    batch_size_of,
    capabilities_of,
    commit_rows,
    config_of,
    extend_states,
    extract_row,
    filter_rows,
    merge_states,
    refuse_unneeded_checkpoints,
    take_rows,
)

S = TypeVar("S")


def _counts(state: Any, accepted: Any) -> tuple[int, ...]:
    """`accepted` (an int, or one count per row) as one checked count per row."""
    batch = batch_size_of(state)
    appended = appended_of(state)
    values, scalar = as_ints(accepted, "commit_prefix: accepted", CommitError)
    if scalar:
        values = values * batch
    # `if ...: raise`, not `require`: its messages would be formatted on every call.
    if len(values) != batch:
        raise CommitError(
            f"accepted has {len(values)} counts for a state of {batch} rows; "
            "pass one count per row or a single int"
        )
    if min(values, default=0) < 0:
        raise CommitError(f"accepted counts must be >= 0; got {values}")
    if max(values, default=0) > appended:
        if appended == 0:
            raise CommitError(
                f"commit_prefix: accepted {values}, but this state has no pending forward "
                "(appended=0): it was already committed, or it was merged / extended from "
                "states whose pending forwards differed. Commit each state before combining "
                "them"
            )
        raise CommitError(
            f"accepted {values} exceeds the {appended} tokens the last forward appended; "
            f"each count must be in [0, {appended}]"
        )
    return tuple(values)


def _rows(state: Any, rows: Any, what: str) -> tuple[int, ...]:
    batch = batch_size_of(state)
    values, _ = as_ints(rows, f"{what}: rows", RowError)
    require(len(values) > 0, RowError, f"{what}: no rows given; pass at least one row index")
    out = [v for v in values if not -batch <= v < batch]
    require(
        not out,
        RowError,
        f"{what}: rows {out} out of range for a state of {batch} rows "
        f"(valid: 0..{batch - 1} or negative from the end)",
    )
    return tuple(v % batch for v in values)


def _state(state: Any, what: str) -> None:
    if not isinstance(state, State):
        raise StateError(
            f"{what}: expected a kvstate state; got a {type(state).__name__} (convert mlx-lm "
            "caches with kvstate.adapters.from_mlx_lm)"
        )


def _same_config(states: Sequence[Any], what: str) -> None:
    first = config_of(states[0])
    for i, s in enumerate(states[1:], start=1):
        other = config_of(s)
        found = (
            [] if other == first else config_mismatches(first, other)
        )  # `==` first: the common case
        if found:
            raise ConfigMismatchError(
                f"{what}: state {i} does not match state 0: {'; '.join(found)}; only states "
                "of the same kind and configuration (bits, group size, window, dtype, head "
                "dims) can be batched together"
            )


# ---------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------


def snapshot(state: S) -> S:
    """A value that later calls can never change.

    States are immutable and adapters never hand their arrays to a model, so the state
    itself is already that value: O(1) time, zero bytes. Use it to say what you mean.
    Anything else is refused: mlx-lm's cache objects, say, are mutable, and handing them back
    as a "snapshot" would be a promise broken (convert them with `from_mlx_lm`).
    """
    _state(state, "snapshot")
    return state


def batch_size(state: Any) -> int:
    """Number of rows (the leading axis of every array)."""
    return batch_size_of(state)


def capabilities(state: Any) -> Capabilities:
    """What `state` can do: trim, take ragged counts, batch states of different lengths,
    whether rolling back needs checkpoints, and whether its last forward can be undone."""
    return capabilities_of(state)


def commit_prefix(state: S, accepted: Any, checkpoints: Any = None) -> S:
    """After a forward of K tokens, keep only the first `accepted` of them.

    `accepted`: the number of the last forward's tokens to keep, 0 .. K: an int, or one
    count per row (ragged). After a speculative verify of each row's last token and its
    drafts that is the kept count, accepted drafts + 1 (`kvstate.speculative`'s glossary).
    KV kinds trim; sliding windows restore what the forward overwrote; recurrent kinds need
    `checkpoints`, the value a capturing forward (`wrapped(tokens, state, capture=True)`)
    returned.
    """
    counts = _counts(state, accepted)
    refuse_unneeded_checkpoints(state, checkpoints)
    return inherit(commit_rows(state, counts, checkpoints), state)


def tile(state: S, n: int) -> S:
    """Repeat every row `n` times along the batch axis: row b becomes rows b*n .. b*n+n-1.

    Time is O(rows) gathers; memory is n times the state (each copy is its own buffer, so
    the paths can diverge).
    """
    count = as_int(n, "tile: n", RowError)
    require(count >= 1, RowError, f"tile: n must be an int >= 1; got {count}")
    _state(state, "tile: state")
    _fits(state, count)
    rows = tuple(b for b in range(batch_size_of(state)) for _ in range(count))
    return inherit(take_rows(state, rows), state)


MAX_ROWS = 2**24  # a batch past this is no batch any device runs (and its row list alone is GBs)


def _fits(state: Any, count: int) -> None:
    """Refuse a `tile` by `count` whose result cannot fit, before allocating anything: more
    than MAX_ROWS rows, or more bytes than the device's memory (the machine's for the CPU)."""
    rows = batch_size_of(state) * count
    need = nbytes(state) * count
    memory = _memory_bytes()
    require(
        rows <= MAX_ROWS and (memory is None or need <= memory),
        RowError,
        f"tile: n={count} would make {rows} rows and {need / 2**30:.3g} GiB"
        + ("" if memory is None else f" (memory: {memory / 2**30:.3g} GiB)")
        + f"; a tiled state must fit in memory and hold at most {MAX_ROWS} rows: use a smaller n",
    )


@functools.cache
def _memory_bytes() -> int | None:
    """The device's memory (MLX's `memory_size`), else the machine's physical memory."""
    size = mx.device_info().get("memory_size")
    if isinstance(size, int) and size > 0:
        return size
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def row_select(state: S, rows: Any) -> S:
    """Keep the given rows, in the given order (an int keeps batch 1). Padding is kept."""
    return inherit(take_rows(state, _rows(state, rows, "row_select")), state)


def filter(state: S, rows: Any) -> S:
    """Keep the given rows of a batched state and drop the left padding they all share."""
    return inherit(filter_rows(state, _rows(state, rows, "filter")), state)


def merge(states: Sequence[S]) -> S:
    """Batch several states (of one kind and config), aligning them with left padding."""
    if isinstance(states, State) or not isinstance(states, (list, tuple)):
        raise StateError(
            f"merge: expected a list of states; got a {type(states).__name__}. Pass "
            "merge([a, b, ...]) (for two states, extend(a, b) works too)"
        )
    states = list(states)
    require(len(states) > 0, StateError, "merge: got no states; pass a non-empty list")
    for i, s in enumerate(states):
        _state(s, f"merge: states[{i}]")
    _same_config(states, "merge")
    return inherit(merge_states(states[0], states[1:]), *states)


def extend(a: S, b: S) -> S:
    """The rows of `a` followed by the rows of `b`, re-aligned to one left padding."""
    _state(a, "extend: a")
    _state(b, "extend: b")
    _same_config([a, b], "extend")
    return inherit(extend_states(a, b), a, b)


def extract(state: S, row: int) -> S:
    """Row `row` as an unpadded single-sequence state (batch 1)."""
    (checked,) = _rows(state, as_int(row, "extract: row", RowError), "extract")
    mx.eval(_left_paddings(state))  # one host sync for every layer's padding, not one each
    return inherit(extract_row(state, checked), state)


def _left_paddings(state: Any) -> list[mx.array]:
    if isinstance(state, Composite):
        return [lp for part in state.parts for lp in _left_paddings(part)]
    padding = getattr(state, "left_padding", None)
    return [] if padding is None else [padding]
