"""PooledKV: mlx-vlm's PoolingCache / BatchPoolingCache (deepseek_v4, glm5_next).

A compressing attention layer pools every `ratio` consecutive tokens of a row into one
pooled token. The cache holds, per row, the pooled tokens so far (`pooled[b, :P_b]`) and the
`remainder` tokens of the window not yet complete (`buf_kv[b, :r_b]`, `buf_gate[b, :r_b]`;
slots past r_b are stale). Row b has consumed P_b * ratio + r_b tokens.

Two forms, like mlx-vlm's two classes:
- single (PoolingCache): every row at the same place; `remainder` is a static and P is
  `pooled.shape[1]`; the per-row arrays are None;
- batched (BatchPoolingCache): per-row `remainders`, `pool_lengths` (pooled is right-padded
  to the longest) and `left_padding` (padding the next forward's inputs still carry, consumed
  as they arrive) as (B,) int32 arrays.

Rollback. A pooled token depends only on its window's tokens, so after a forward the first
windows the kept tokens complete are exact; what a partial commit needs besides is the raw
tokens of the kept, still incomplete window. They are in the buffer when that window is the
one the forward ended in (or when nothing of the forward is kept: the state before it,
`previous`, which `record_forward` keeps). Otherwise the forward pooled them and kept no raw
copy, and `commit_prefix` refuses with a `CommitError` (mlx-vlm's own `trim` refuses any
rollback once a window is pooled; its speculation transaction records the raw inputs,
which a cache converted between forwards never has).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from ._errors import CommitError
from ._shared import shared_appended, uniform_count
from ._tree import State, host_ints, replace, trusted
from ._validation import (
    array_problems,
    previous_rows_problems,
    rows_problems,
    static_int,
    typed_statics,
)
from .kinds import (
    Capabilities,
    batch_size_of,
    capabilities_of,
    commit_rows,
    config_of,
    extend_states,
    extract_row,
    merge_states,
    problems,
    record_forward,
    state_class,
    static_field,
    take_rows,
)

Row = tuple[int, int, int]  # (remainder, pool length, pending left padding)


@state_class(Capabilities(trimmable=False, ragged_commit=True, batchable=True))
class PooledKV(State):
    """Pooled keys plus the remainder buffers of an incomplete window (see module docstring).

    buf_kv (B, ratio, D1), buf_gate (B, ratio, D2): the incomplete window's raw inputs.
    pooled (B, P, D): the pooled tokens. remainders / pool_lengths / left_padding (B,) int32:
    the batched form's per-row bookkeeping (None in the single form, which uses `remainder`).
    previous: the state before the last forward (`record_forward`), for its rollback.
    """

    buf_kv: mx.array | None = None
    buf_gate: mx.array | None = None
    pooled: mx.array | None = None
    remainders: mx.array | None = None
    pool_lengths: mx.array | None = None
    left_padding: mx.array | None = None
    previous: PooledKV | None = None
    ratio: int = static_field(default=1)
    remainder: int = static_field(default=0)
    appended: int = static_field(default=0)


def is_batched(state: PooledKV) -> bool:
    return state.remainders is not None


def rows_of(state: PooledKV, batch: int | None = None) -> list[Row]:
    """(remainder, pool length, pending padding) of every row (batched: one host sync).
    `batch` gives an empty single-form state (no arrays, no batch axis) that many rows."""
    if state.remainders is not None:
        assert state.pool_lengths is not None and state.left_padding is not None
        columns = (state.remainders, state.pool_lengths, state.left_padding)
        return list(zip(*(host_ints(a) for a in columns), strict=True))
    width = 0 if state.pooled is None else int(state.pooled.shape[1])
    return [(state.remainder, width, 0)] * (batch or batch_size_of(state))


def _ints(values: Sequence[int]) -> mx.array:
    return mx.array(list(values), dtype=mx.int32)


def with_rows(state: PooledKV, rows: Sequence[Row], batched: bool, **arrays: Any) -> PooledKV:
    """`state` with `arrays` replaced and the bookkeeping of `rows`, in the given form."""
    if batched:
        rem, pool, pad = zip(*rows, strict=True) if rows else ((), (), ())
        return replace(
            state,
            remainders=_ints(rem),
            pool_lengths=_ints(pool),
            left_padding=_ints(pad),
            **arrays,
        )
    return replace(
        state,
        remainders=None,
        pool_lengths=None,
        left_padding=None,
        remainder=rows[0][0] if rows else 0,
        **arrays,
    )


# ---------------------------------------------------------------------------------------
# Check, batch, config, capabilities
# ---------------------------------------------------------------------------------------


@problems.register
def _(state: PooledKV, values: bool) -> list[str]:
    found = typed_statics(state, ratio=1, remainder=0, appended=0)
    if found:
        return found
    bufs = (state.buf_kv, state.buf_gate)
    if (bufs[0] is None) != (bufs[1] is None):
        found.append("buf_kv and buf_gate must both be arrays or both None")
    for name, a in (("buf_kv", bufs[0]), ("buf_gate", bufs[1]), ("pooled", state.pooled)):
        if a is not None:
            found += array_problems(name, a, 3, True)
    if found:
        return found
    if (
        bufs[0] is not None
        and bufs[1] is not None
        and (bufs[0].shape[1] != state.ratio or bufs[1].shape[1] != state.ratio)
    ):
        found.append(
            f"buf_kv {tuple(bufs[0].shape)} / buf_gate {tuple(bufs[1].shape)}: axis 1 "
            f"must be ratio={state.ratio}"
        )
    batches = {int(a.shape[0]) for a in (*bufs, state.pooled) if a is not None}
    if len(batches) > 1:
        found.append(f"buf_kv, buf_gate and pooled disagree in batch: {sorted(batches)}")
    batch = batch_size_of(state)
    per_row = (state.remainders, state.pool_lengths, state.left_padding)
    if is_batched(state):
        if any(a is None for a in per_row):
            found.append("remainders, pool_lengths and left_padding: all arrays or all None")
        else:
            # The field batch_size_of reads the rows from (remainders, at the latest).
            fields = ("buf_kv", "pooled", "remainders")
            source = next(n for n in fields if getattr(state, n) is not None)
            for name, a in zip(
                ("remainders", "pool_lengths", "left_padding"), per_row, strict=True
            ):
                found += rows_problems(name, a, batch, source)
        if not found and values:
            found += _row_value_problems(state)
    else:
        if any(a is not None for a in per_row):
            found.append("remainders, pool_lengths and left_padding: all arrays or all None")
        found += static_int("remainder", state.remainder, 0, state.ratio - 1)
        if state.remainder and state.buf_kv is None:
            found.append(f"remainder {state.remainder} needs buf_kv / buf_gate; they are None")
    return found + _previous_problems(state, values)


def _row_value_problems(state: PooledKV) -> list[str]:
    width = 0 if state.pooled is None else int(state.pooled.shape[1])
    found = []
    for b, (rem, pool, pad) in enumerate(rows_of(state)):
        if not 0 <= rem < state.ratio:
            found.append(f"remainders[{b}]: {rem} is outside [0, {state.ratio - 1}]")
        if rem and state.buf_kv is None:
            found.append(f"remainders[{b}]: {rem} needs buf_kv / buf_gate; they are None")
        if not 0 <= pool <= width:
            found.append(f"pool_lengths[{b}]: {pool} is outside [0, pooled width {width}]")
        if pad < 0:
            found.append(f"left_padding[{b}]: {pad} is negative")
    return found


def _previous_problems(state: PooledKV, values: bool) -> list[str]:
    prev = state.previous
    if prev is None:
        return []
    if not isinstance(prev, PooledKV):
        return [f"previous: must be a PooledKV or None; got a {type(prev).__name__}"]
    found = [f"previous.{m}" for m in problems(prev, values)]
    if prev.ratio != state.ratio or prev.previous is not None or prev.appended:
        found.append("previous: one state of the same ratio, with nothing pending")
    return found + previous_rows_problems(state, prev)


@batch_size_of.register
def _(state: PooledKV) -> int:
    for a in (state.buf_kv, state.pooled, state.remainders):
        if a is not None:
            return int(a.shape[0])
    return 1


def _dims(a: mx.array | None) -> tuple[str | None, int | None]:
    return (None, None) if a is None else (str(a.dtype), int(a.shape[2]))


@config_of.register
def _(state: PooledKV) -> dict[str, Any]:
    (kv_dtype, kv_dim), (gate_dtype, gate_dim) = _dims(state.buf_kv), _dims(state.buf_gate)
    pooled_dtype, pooled_dim = _dims(state.pooled)
    return {
        "kind": "PooledKV",
        "ratio": state.ratio,
        "kv_dtype": kv_dtype,
        "kv_dim": kv_dim,
        "gate_dtype": gate_dtype,
        "gate_dim": gate_dim,
        "pooled_dtype": pooled_dtype,
        "pooled_dim": pooled_dim,
    }


@capabilities_of.register
def _(state: PooledKV) -> Capabilities:
    n = state.appended
    batch = batch_size_of(state)
    rolls_back = all(_refusal(state, (c,) * batch) is None for c in range(n))
    return Capabilities(
        trimmable=False, ragged_commit=is_batched(state), batchable=True, can_roll_back=rolls_back
    )


# ---------------------------------------------------------------------------------------
# Forward record and commit
# ---------------------------------------------------------------------------------------


@record_forward.register
def _(state: PooledKV, before: PooledKV, n: int) -> PooledKV:
    previous = replace(before, previous=None, appended=0) if n else None
    return replace(state, previous=previous, appended=n)


def _plan(state: PooledKV, counts: tuple[int, ...]) -> tuple[list[Row], list[str]] | str:
    """Per row, the bookkeeping after keeping `counts[b]` tokens of the last forward and where
    its buffer comes from ("after" / "before"), or the reason it cannot be done."""
    n, ratio, batch = state.appended, state.ratio, batch_size_of(state)
    if all(c == n for c in counts):
        return rows_of(state), ["after"] * batch
    prev = state.previous
    if prev is None:
        return (
            "this PooledKV has no record of the state before its last forward (`previous`); "
            "states the wrapped model or kvstate.kinds.record_forward return have one"
        )
    rows, sources = [], []
    for b, (count, (rem0, pool0, pad0), (_, pool_after, _)) in enumerate(
        zip(counts, rows_of(prev, batch), rows_of(state), strict=True)
    ):
        pad_consumed = min(pad0, n)
        kept = max(0, count - pad_consumed)  # real tokens kept (padding comes first)
        total = rem0 + kept
        rem, pool = total % ratio, pool0 + total // ratio
        rows.append((rem, pool, pad0 - min(pad0, count)))
        if pool == pool_after or rem == 0:
            sources.append("after")  # the buffer holds the window's tokens (or none are needed)
        elif kept == 0:
            sources.append("before")
        else:
            return (
                f"row {b}: keeping {count} of the {n} tokens leaves {rem} tokens of pooled "
                f"window {pool} incomplete, but the forward completed that window (and "
                f"{pool_after - pool - 1} more) and pooled its raw tokens; the raw keys no "
                "longer exist in the state. Commit counts that end on a window boundary or in "
                "the forward's last window, or keep the state before the forward "
                "(kvstate.snapshot) and re-run the accepted tokens"
            )
    return rows, sources


def _refusal(state: PooledKV, counts: tuple[int, ...]) -> str | None:
    plan = _plan(state, counts)
    return plan if isinstance(plan, str) else None


@commit_rows.register
def _(state: PooledKV, counts: tuple[int, ...], checkpoints: Any) -> PooledKV:
    if not is_batched(state):
        counts = (uniform_count(state, counts),) * len(counts)
    if all(c == state.appended for c in counts):
        return replace(state, previous=None, appended=0)
    plan = _plan(state, counts)
    if isinstance(plan, str):
        raise CommitError(f"commit_prefix: {plan}")
    rows, sources = plan
    buf_kv, buf_gate = state.buf_kv, state.buf_gate
    if "before" in sources:
        prev = state.previous
        assert prev is not None and prev.buf_kv is not None and prev.buf_gate is not None
        # (no buffer after: an extracted row whose window just closed; no row reads it)
        after_kv = mx.zeros_like(prev.buf_kv) if buf_kv is None else buf_kv
        after_gate = mx.zeros_like(prev.buf_gate) if buf_gate is None else buf_gate
        use_before = mx.array([s == "before" for s in sources])[:, None, None]
        buf_kv = mx.where(use_before, prev.buf_kv, after_kv)
        buf_gate = mx.where(use_before, prev.buf_gate, after_gate)
    width = max((pool for _, pool, _ in rows), default=0)
    pooled = state.pooled
    if width == 0:
        pooled = None  # as mlx-vlm's commit_speculation leaves it
    elif pooled is not None and pooled.shape[1] != width:
        pooled = pooled[:, :width]
    committed = with_rows(
        state, rows, is_batched(state), buf_kv=buf_kv, buf_gate=buf_gate, pooled=pooled
    )
    return replace(committed, previous=None, appended=0)


# ---------------------------------------------------------------------------------------
# Rows
# ---------------------------------------------------------------------------------------


def _is_empty_single(state: PooledKV) -> bool:
    return not is_batched(state) and state.buf_kv is None and state.pooled is None


@take_rows.register
def _(state: PooledKV, rows: tuple[int, ...]) -> PooledKV:
    previous = None if state.previous is None else take_rows(state.previous, rows)
    if _is_empty_single(state):
        if rows == (0,):
            return replace(state, previous=previous)
        # No batch axis yet: the rows exist only as bookkeeping (BatchPoolingCache's lists).
        return with_rows(state, rows_of(state, len(rows)), True, previous=previous)
    index = mx.array(rows, mx.int32)

    def gather(a: mx.array | None) -> mx.array | None:
        return None if a is None else a[index]

    return replace(
        state,
        buf_kv=gather(state.buf_kv),
        buf_gate=gather(state.buf_gate),
        pooled=gather(state.pooled),
        remainders=gather(state.remainders),
        pool_lengths=gather(state.pool_lengths),
        left_padding=gather(state.left_padding),
        previous=previous,
    )


def _stack(parts: Sequence[tuple[PooledKV, int]], zero_fill: bool) -> PooledKV:
    """The rows of every (state, batch) part in one batched state. `zero_fill`: slots past a
    row's remainder / pool length are zeros, and rows with nothing in them give no arrays
    (mlx-vlm's `merge`); else each part's buffers are kept as they are (its `extend`).
    Missing buffers are zeros."""
    ratio = parts[0][0].ratio
    rows = [r for s, batch in parts for r in rows_of(s, batch)]
    made = trusted(PooledKV)(ratio=ratio)
    if zero_fill and all(rem == 0 and pool == 0 for rem, pool, _ in rows):
        return with_rows(made, rows, True)
    if zero_fill:
        width = max(pool for _, pool, _ in rows)
    else:
        width = max((int(s.pooled.shape[1]) for s, _ in parts if s.pooled is not None), default=0)

    def column(field: str, slots: int, used: int) -> mx.array | None:
        like = next((getattr(s, field) for s, _ in parts if getattr(s, field) is not None), None)
        if like is None or slots == 0:
            return None
        pieces = []
        for s, batch in parts:
            a = getattr(s, field)
            if a is None:
                pieces.append(mx.zeros((batch, slots, like.shape[2]), like.dtype))
                continue
            a = a[:, :slots]
            if a.shape[1] < slots:
                pad = mx.zeros((batch, slots - a.shape[1], a.shape[2]), a.dtype)
                a = mx.concatenate([a, pad], axis=1)
            if zero_fill:
                limit = _ints([r[used] for r in rows_of(s, batch)])[:, None, None]
                a = mx.where(mx.arange(slots)[None, :, None] < limit, a, mx.zeros_like(a))
            pieces.append(a)
        return mx.concatenate(pieces, axis=0)

    made = trusted(PooledKV)(
        column("buf_kv", ratio, 0),
        column("buf_gate", ratio, 0),
        column("pooled", width, 1),
        ratio=ratio,
    )
    return with_rows(made, rows, True)


def _pending(merged: PooledKV, states: Sequence[PooledKV], zero_fill: bool) -> PooledKV:
    """`merged` with the inputs' shared pending forward and their merged records."""
    n = shared_appended(states)
    records = [s.previous for s in states]
    if not n or any(p is None for p in records):
        return merged
    record = _stack(
        [(p, batch_size_of(s)) for p, s in zip(records, states, strict=True) if p], zero_fill
    )
    return replace(merged, previous=record, appended=n)


@merge_states.register
def _(first: PooledKV, rest: Sequence[PooledKV]) -> PooledKV:
    states = [first, *rest]
    merged = _stack([(s, batch_size_of(s)) for s in states], zero_fill=True)
    return _pending(merged, states, zero_fill=True)


@extend_states.register
def _(a: PooledKV, b: PooledKV) -> PooledKV:
    extended = _stack([(a, batch_size_of(a)), (b, batch_size_of(b))], zero_fill=False)
    return _pending(extended, [a, b], zero_fill=False)


@extract_row.register
def _(state: PooledKV, row: int) -> PooledKV:
    """Row `row` in the single form, as mlx-vlm's `extract` makes it: pooled[:P] (None when
    P is 0), the whole buffer row when its remainder is not 0 (else None). Left padding the
    row's next inputs would carry is dropped: a single-sequence state takes unpadded inputs."""
    rem, pool, _ = rows_of(state)[row]
    bufs: tuple[mx.array | None, mx.array | None] = (None, None)
    if rem and state.buf_kv is not None and state.buf_gate is not None:
        bufs = (
            mx.contiguous(state.buf_kv[row : row + 1]),
            mx.contiguous(state.buf_gate[row : row + 1]),
        )
    pooled = None
    if state.pooled is not None and pool > 0:
        pooled = mx.contiguous(state.pooled[row : row + 1, :pool])
    previous, appended = state.previous, state.appended
    if previous is not None:
        if rows_of(previous, batch_size_of(state))[row][2]:
            # The forward consumed padding of this row: without it the unpadded row cannot
            # tell which of its tokens were padding, so the forward is settled (kept whole).
            previous, appended = None, 0
        else:
            previous = extract_row(take_rows(previous, (row,)), 0)
    return trusted(PooledKV)(
        *bufs, pooled, previous=previous, ratio=state.ratio, remainder=rem, appended=appended
    )
