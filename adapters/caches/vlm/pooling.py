"""mlx-vlm's PoolingCache / BatchPoolingCache <-> PooledKV (imports mlx_vlm).

BatchPoolingCache keeps its per-row bookkeeping in Python lists; its `_processed` counts are
always `pool_length * ratio + remainder` between forwards (update_and_fetch, merge and trim
keep it so), so the state holds the two and the cache made back recomputes the third. A cache
between prepare() and finalize() (per-row `_lengths` set) or inside mlx-vlm's own speculation
transaction is refused (`compat`): both describe a forward in progress, not a state.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_vlm.models import cache as vlm

from kvstate import PooledKV, StateError
from kvstate.kinds import host_ints, trusted

from ..compat import check_settled, refuse_mid_prompt
from ..registry import fresh, register_from

_NO_LIMIT = 2**31  # BatchPoolingCache's per-row `_lengths` outside prepare() / finalize()


@register_from(vlm.PoolingCache)
def _(cache: vlm.PoolingCache, appended: int = 0) -> PooledKV:
    check_settled(cache)
    return trusted(PooledKV)(
        fresh(cache.buf_kv),
        fresh(cache.buf_gate),
        fresh(cache.pooled),
        ratio=int(cache.ratio),
        remainder=int(cache.remainder),
        appended=appended,
    )


@register_from(vlm.BatchPoolingCache)
def _(cache: vlm.BatchPoolingCache, appended: int = 0) -> PooledKV:
    check_settled(cache)
    if any(length != _NO_LIMIT for length in cache._lengths):
        refuse_mid_prompt(cache, "_lengths", cache._lengths)
    expected = [
        p * cache.ratio + r for p, r in zip(cache._pool_lengths, cache.remainder, strict=True)
    ]
    if list(cache._processed) != expected:
        raise StateError(
            f"from_mlx_vlm: this BatchPoolingCache's _processed {list(cache._processed)} is "
            f"not pool_lengths * ratio + remainder = {expected}: it is between "
            "accumulate_windows() and update_and_fetch() of one forward; convert after the "
            "forward"
        )
    return trusted(PooledKV)(
        fresh(cache.buf_kv),
        fresh(cache.buf_gate),
        fresh(cache.pooled),
        mx.array(list(cache.remainder), dtype=mx.int32),
        mx.array(list(cache._pool_lengths), dtype=mx.int32),
        mx.array(list(cache.left_padding), dtype=mx.int32),
        ratio=int(cache.ratio),
        appended=appended,
    )


def to_pooling_cache(state: PooledKV) -> Any:
    """A PooledKV -> a new PoolingCache (single form) or BatchPoolingCache (batched form)."""
    if state.remainders is None:
        single = vlm.PoolingCache(state.ratio)
        single.buf_kv, single.buf_gate = fresh(state.buf_kv), fresh(state.buf_gate)
        single.pooled, single.remainder = fresh(state.pooled), state.remainder
        return single
    assert state.pool_lengths is not None and state.left_padding is not None
    remainders, pool_lengths, padding = (
        host_ints(a) for a in (state.remainders, state.pool_lengths, state.left_padding)
    )
    batch = vlm.BatchPoolingCache(state.ratio, padding)
    batch.buf_kv, batch.buf_gate = fresh(state.buf_kv), fresh(state.buf_gate)
    batch.pooled = fresh(state.pooled)
    batch.remainder, batch._pool_lengths = remainders, pool_lengths
    batch._processed = [p * state.ratio + r for p, r in zip(pool_lengths, remainders, strict=True)]
    return batch
