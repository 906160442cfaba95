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

from ._shared import array_kv_config, shared_appended, uniform_count
from ._tree import State, replace, trusted
from ._unpadded_kv import (
    held,
    kv_batch_size,
    no_batch_axis,
    require_one_span,
    take_kv_rows,
    trimmed,
    window_span_problems,
)
from ._validation import kv_pair_problems, previous_rows_problems, typed_statics
from .kinds import (
    Capabilities,
    batch_size_of,
    commit_rows,
    config_of,
    extract_row,
    merge_states,
    problems,
    record_forward,
    state_class,
    static_field,
    take_rows,
)


@state_class(Capabilities(trimmable=True, ragged_commit=False, batchable=False))
class ChunkedKV(State):
    """mlx-lm's ChunkedKVCache: a dense buffer whose front is dropped past `chunk_size`.

    Positions [start_position, offset) are held at buffer indices [0, offset - start_position).
    `previous`: the state before the last multi-token forward (see the module docstring).
    """

    keys: mx.array | None = None
    values: mx.array | None = None
    previous: ChunkedKV | None = None
    chunk_size: int = static_field(default=0)
    offset: int = static_field(default=0)
    start_position: int = static_field(default=0)
    appended: int = static_field(default=0)


def _used(a: mx.array, n: int) -> mx.array:
    return a if a.shape[2] == n else a[..., :n, :]


@problems.register
def _(state: ChunkedKV, values: bool) -> list[str]:
    found = typed_statics(state, chunk_size=1, offset=0, start_position=0, appended=0)
    found += kv_pair_problems(state.keys, state.values)
    if found:
        return found
    found += window_span_problems(state)
    prev = state.previous
    if prev is not None:
        if not isinstance(prev, ChunkedKV):
            return [*found, f"previous: must be a ChunkedKV or None; got a {type(prev).__name__}"]
        found += [f"previous.{m}" for m in problems(prev, values)]
        if prev.chunk_size != state.chunk_size or prev.previous is not None or prev.appended:
            found.append("previous: one state of the same chunk_size, with nothing pending")
        found += previous_rows_problems(state, prev)
    return found


batch_size_of.register(ChunkedKV, kv_batch_size)


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
    return trimmed(state, accepted, previous=None)


@take_rows.register
def _(state: ChunkedKV, rows: tuple[int, ...]) -> ChunkedKV:
    taken = take_kv_rows(state, rows)
    previous = state.previous
    # An empty `previous` has no batch axis and needs none: it restores to empty.
    if state.keys is None or previous is None or previous.keys is None:
        return taken
    return replace(taken, previous=take_rows(previous, rows))


@merge_states.register
def _(first: ChunkedKV, rest: Sequence[ChunkedKV]) -> ChunkedKV:
    states = [first, *rest]
    require_one_span(
        states,
        "a ChunkedKV has no left padding (mlx-lm's ChunkedKVCache is unpadded and its chunk "
        "mask is shared by all rows), so every row must be at the same position; merge "
        "states at equal positions",
    )
    filled = [s for s in states if s.keys is not None and s.values is not None]
    if not filled:
        raise no_batch_axis(first, "merge")
    k0, v0 = filled[0].keys, filled[0].values
    assert k0 is not None and v0 is not None
    n = held(first)

    def part(s: ChunkedKV, a: mx.array | None, like: mx.array) -> mx.array:
        if a is None:  # an empty state at position 0: one row of nothing
            return mx.zeros((1, like.shape[1], 0, like.shape[3]), like.dtype)
        return _used(a, n)

    keys = mx.concatenate([part(s, s.keys, k0) for s in states])
    values = mx.concatenate([part(s, s.values, v0) for s in states])
    merged = trusted(ChunkedKV)(
        keys,
        values,
        chunk_size=first.chunk_size,
        offset=first.offset,
        start_position=first.start_position,
    )
    return _keeping_pending(merged, states)


def _keeping_pending(merged: ChunkedKV, states: Sequence[ChunkedKV]) -> ChunkedKV:
    """`merged` with the inputs' shared pending forward, and their records merged, when
    those can be batched too (they can unless they sat at different positions)."""
    n = shared_appended(states)
    previous = [s.previous for s in states]
    if not n:
        return merged
    if all(p is None for p in previous):
        return replace(merged, appended=n)
    if (
        any(p is None for p in previous)
        or len({(p.start_position, p.offset) for p in previous if p}) > 1
    ):
        return merged
    filled = [p for p in previous if p is not None and p.keys is not None]
    if filled and len(filled) != len(previous):
        return merged
    record = merge_states(filled[0], filled[1:]) if filled else previous[0]
    return replace(merged, previous=record, appended=n)


@extract_row.register
def _(state: ChunkedKV, row: int) -> ChunkedKV:
    if state.keys is None or state.values is None:
        return trusted(ChunkedKV)(chunk_size=state.chunk_size)
    n = held(state)
    previous = state.previous
    if previous is not None and previous.keys is not None:
        previous = extract_row(previous, row)
    return trusted(ChunkedKV)(
        mx.contiguous(state.keys[row : row + 1, :, :n]),
        mx.contiguous(state.values[row : row + 1, :, :n]),
        previous,
        chunk_size=state.chunk_size,
        offset=state.offset,
        start_position=state.start_position,
        appended=state.appended,
    )
