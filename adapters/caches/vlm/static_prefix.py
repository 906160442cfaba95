"""mlx-vlm's StaticPrefixKVCache <-> StaticPrefixKV (imports mlx_vlm)."""

from __future__ import annotations

from typing import Any

from mlx_vlm.models import cache as vlm

from kvstate import StaticPrefixKV
from kvstate.kinds import trusted

from ..registry import fresh, register_from


@register_from(vlm.StaticPrefixKVCache)
def _(cache: vlm.StaticPrefixKVCache, appended: int = 0) -> StaticPrefixKV:
    # The whole allocation, stale entries past offset included: decoder_state reads it.
    return trusted(StaticPrefixKV)(
        fresh(cache.keys),
        fresh(cache.values),
        max_size=int(cache.max_size),
        step=int(cache.step),
        offset=int(cache.offset),
        read_only=bool(cache.read_only),
        appended=appended,
    )


def to_static_prefix_cache(state: StaticPrefixKV) -> Any:
    cache = vlm.StaticPrefixKVCache(state.max_size, state.step, read_only=state.read_only)
    cache.keys, cache.values, cache.offset = fresh(state.keys), fresh(state.values), state.offset
    return cache
