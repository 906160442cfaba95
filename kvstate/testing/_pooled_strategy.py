"""The hypothesis strategy of `PooledKV` (mlx-vlm's PoolingCache / BatchPoolingCache)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from hypothesis import strategies as st

from .._pooled import PooledKV, with_rows
from ._strategies import _SEEDS, DTYPES, Knob, _knob, _noise, strategy_for


@strategy_for(PooledKV)
@st.composite
def pooled_kv_states(
    draw: Any,
    *,
    batch: Knob = None,
    ratio: Knob = None,
    kv_dim: Knob = None,
    pooled_dim: Knob = None,
    dtype: Knob = None,
    batched: Knob = None,
    appended: Knob = None,
) -> PooledKV:
    """A `PooledKV` made the way mlx-vlm's pooling caches change: an earlier state (per row
    0..3 pooled tokens and a remainder in 0..ratio-1; one shared row in the single form)
    goes through one forward of `appended` (0..3) tokens that fills the remainder window,
    pools each window it completes (a new pooled token) and leaves the rest of its inputs
    in the buffer. The state before that forward is kept in `previous`.

    Draws: batch in 1..3, ratio in 2..4, kv (= gate) dim in {2, 4}, pooled dim in {2, 4},
    dtype in `DTYPES`, `batched` (the BatchPoolingCache form); an empty batched state may
    carry pending left padding. buf_kv / buf_gate (B, ratio, dim), pooled (B, P, dim);
    slots past a row's remainder or pool length hold garbage.
    """
    batch = _knob(draw, batch, st.integers(1, 3))
    ratio = _knob(draw, ratio, st.integers(2, 4))
    kv_dim = _knob(draw, kv_dim, st.sampled_from([2, 4]))
    pooled_dim = _knob(draw, pooled_dim, st.sampled_from([2, 4]))
    dtype = _knob(draw, dtype, st.sampled_from(DTYPES))
    batched = _knob(draw, batched, st.booleans())
    appended = _knob(draw, appended, st.integers(0, 3))
    seed = draw(_SEEDS)
    shared = not batched
    n_rows = 1 if shared else batch
    starts = [(draw(st.integers(0, ratio - 1)), draw(st.integers(0, 3))) for _ in range(n_rows)] * (
        batch if shared else 1
    )
    empty = all(r == 0 and p == 0 for r, p in starts)
    pads = [0] * batch
    if batched and empty and not appended:
        pads = draw(st.lists(st.integers(0, 2), min_size=batch, max_size=batch))
    spare = draw(st.integers(0, 2)) if batched else 0
    width = max(p for _, p in starts) + spare

    def noise(shape: tuple[int, ...], salt: int) -> mx.array:
        return _noise(seed + salt, shape, dtype)

    has_buf = any(r for r, _ in starts) or (draw(st.booleans()) and not empty)
    before = PooledKV(
        noise((batch, ratio, kv_dim), 0) if has_buf else None,
        noise((batch, ratio, kv_dim), 1) if has_buf else None,
        noise((batch, width, pooled_dim), 2) if width else None,
        ratio=ratio,
    )
    before = with_rows(
        before, [(r, p, pad) for (r, p), pad in zip(starts, pads, strict=True)], batched
    )
    if not appended:
        return before
    # The forward: `appended` new tokens per row (no padding left to consume).
    kv, gate = noise((batch, appended, kv_dim), 3), noise((batch, appended, kv_dim), 4)
    fresh_pool = noise((batch, (ratio - 1 + appended) // ratio, pooled_dim), 5)
    old_kv = before.buf_kv if before.buf_kv is not None else noise((batch, ratio, kv_dim), 6)
    old_gate = before.buf_gate if before.buf_gate is not None else noise((batch, ratio, kv_dim), 7)
    rows, kv_rows, gate_rows, pool_rows = [], [], [], []
    after_width = max(p + (r + appended) // ratio for r, p in starts) + spare
    for b, (rem, pool) in enumerate(starts):
        total = rem + appended
        done = total // ratio
        rows.append((total % ratio, pool + done, 0))
        window_kv, window_gate = old_kv[b], old_gate[b]
        if done == 0:  # the inputs join the incomplete window
            window_kv = mx.concatenate([window_kv[:rem], kv[b], window_kv[total:]])
            window_gate = mx.concatenate([window_gate[:rem], gate[b], window_gate[total:]])
        else:  # the last inputs start a new window; the slots past them keep stale values
            tail = total % ratio
            window_kv = mx.concatenate([kv[b, appended - tail :], window_kv[tail:]])
            window_gate = mx.concatenate([gate[b, appended - tail :], window_gate[tail:]])
        kv_rows.append(window_kv)
        gate_rows.append(window_gate)
        held = before.pooled[b, :pool] if before.pooled is not None else fresh_pool[b, :0]
        row = mx.concatenate([held, fresh_pool[b, :done]])
        filler = noise((after_width - row.shape[0], pooled_dim), 8 + b)
        pool_rows.append(mx.concatenate([row, filler]))
    after = PooledKV(
        mx.stack(kv_rows),
        mx.stack(gate_rows),
        mx.stack(pool_rows) if after_width else None,
        previous=before,
        ratio=ratio,
        appended=appended,
    )
    return with_rows(after, rows, batched)
