"""ChunkedKV: mlx-lm's ChunkedKVCache (llama4's chunked-attention layers).

Positions [start_position, offset) sit at buffer indices [0, offset - start_position).
Before each forward the model drops the front past `chunk_size` (`maybe_trim_front`), so a
multi-token forward may lose entries that a rollback to "nothing accepted" needs: such a
forward keeps the state before it in `previous` (`record_forward`), and `commit_prefix`
restores it. Like mlx-lm's class it is unpadded: one length for all rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from ._errors import ConfigMismatchError, StateError, check
from ._states import ChunkedKV
from ._transforms import (
    array_kv_config,
    batch_size_of,
    commit_rows,
    config_of,
    extract_row,
    merge_states,
    record_forward,
    take_rows,
    uniform_count,
)
from ._tree import replace


def valid(state: ChunkedKV) -> int:
    """Buffer positions in use: offset - start_position."""
    return state.offset - state.start_position


def _used(a: mx.array, n: int) -> mx.array:
    return a if a.shape[2] == n else a[..., :n, :]


@batch_size_of.register
def _(state: ChunkedKV) -> int:
    return int(state.keys.shape[0]) if state.keys is not None else 1


@config_of.register
def _(state: ChunkedKV) -> dict[str, Any]:
    return array_kv_config("ChunkedKV", state.keys, state.values, chunk_size=state.chunk_size)


@record_forward.register
def _(state: ChunkedKV, before: ChunkedKV, n: int) -> ChunkedKV:
    # A one-token forward keeps no `previous`: holding the old buffer would make every decode
    # step copy it (copy-on-write). Its rejection is still exact for every later forward:
    # see the commit below.
    previous = replace(before, previous=None, appended=0) if n > 1 else None
    return replace(state, previous=previous, appended=n)


@commit_rows.register
def _(state: ChunkedKV, counts: tuple[int, ...], checkpoints: Any) -> ChunkedKV:
    accepted = uniform_count(state, counts)
    if accepted == 0 and state.previous is not None:
        # Nothing accepted: the state before the forward, front entries and all (the
        # forward's `maybe_trim_front` may have dropped some).
        return replace(state.previous, previous=None, appended=0)
    # Otherwise decoding only the accepted tokens would have trimmed the same front (it
    # depends only on the state before the forward), so trimming the end is exact, like
    # ChunkedKVCache.trim. After a one-token forward (no `previous`) rejecting the token
    # keeps the front that forward dropped dropped; the next forward's trim would drop
    # exactly those entries, so every later result is the same.
    rejected = state.appended - accepted
    return replace(state, offset=state.offset - rejected, previous=None, appended=0)


@take_rows.register
def _(state: ChunkedKV, rows: tuple[int, ...]) -> ChunkedKV:
    if state.keys is None or state.values is None:
        if rows == (0,):
            return state
        raise StateError(
            "row_select / tile: an empty ChunkedKV has no arrays, so no batch axis to gather "
            "rows along; run the first forward (prefill) before tiling or selecting rows "
            "(an empty state takes the batch size of its first forward)"
        )
    index = mx.array(rows, mx.int32)
    previous = state.previous
    if previous is not None:
        # An empty `previous` has no batch axis and needs none: it restores to empty.
        previous = take_rows(previous, rows) if previous.keys is not None else previous
    return replace(state, keys=state.keys[index], values=state.values[index], previous=previous)


@merge_states.register
def _(first: ChunkedKV, rest: Sequence[ChunkedKV]) -> ChunkedKV:
    states = [first, *rest]
    spans = [(s.start_position, s.offset) for s in states]
    check(
        len(set(spans)) == 1,
        ConfigMismatchError,
        f"merge: ChunkedKV states with (start_position, offset) {spans} cannot be batched: a "
        "ChunkedKV has no left padding (mlx-lm's ChunkedKVCache is unpadded and its chunk "
        "mask is shared by all rows), so every row must be at the same position; merge "
        "states at equal positions",
    )
    filled = [s for s in states if s.keys is not None and s.values is not None]
    if not filled:
        raise StateError(
            "merge: empty ChunkedKV states have no batch axis to merge along; merge after "
            "the first forward (prefill)"
        )
    k0, v0 = filled[0].keys, filled[0].values
    assert k0 is not None and v0 is not None
    n = valid(first)

    def part(s: ChunkedKV, a: mx.array | None, like: mx.array) -> mx.array:
        if a is None:  # an empty state at position 0: one row of nothing
            return mx.zeros((1, like.shape[1], 0, like.shape[3]), like.dtype)
        return _used(a, n)

    keys = mx.concatenate([part(s, s.keys, k0) for s in states])
    values = mx.concatenate([part(s, s.values, v0) for s in states])
    return ChunkedKV(
        keys,
        values,
        chunk_size=first.chunk_size,
        offset=first.offset,
        start_position=first.start_position,
    )


@extract_row.register
def _(state: ChunkedKV, row: int) -> ChunkedKV:
    if state.keys is None or state.values is None:
        return ChunkedKV(chunk_size=state.chunk_size)
    n = valid(state)
    return ChunkedKV(
        mx.contiguous(state.keys[row : row + 1, :, :n]),
        mx.contiguous(state.values[row : row + 1, :, :n]),
        chunk_size=state.chunk_size,
        offset=state.offset,
        start_position=state.start_position,
    )
