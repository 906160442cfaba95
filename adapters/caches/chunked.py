"""ChunkedKVCache <-> ChunkedKV."""

from __future__ import annotations

from types import ModuleType
from typing import Any

from mlx_lm.models.cache import ChunkedKVCache

from kvstate import ChunkedKV
from kvstate.kinds import trusted

from .registry import LM, fresh, register_from, to_cache


@register_from(ChunkedKVCache)
def _(cache: ChunkedKVCache, appended: int = 0) -> ChunkedKV:
    return trusted(ChunkedKV)(
        fresh(cache.keys),
        fresh(cache.values),
        chunk_size=cache.chunk_size,
        offset=cache.offset,
        start_position=cache.start_position,
        appended=appended,
    )


@to_cache.register
def _(state: ChunkedKV, lib: ModuleType = LM) -> Any:
    # `previous` stays with the state: a cache object has no rollback.
    cache = lib.ChunkedKVCache(state.chunk_size)
    cache.keys, cache.values = fresh(state.keys), fresh(state.values)
    cache.offset, cache.start_position = state.offset, state.start_position
    return cache
