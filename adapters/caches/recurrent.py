"""ArraysCache <-> RecurrentState and CacheList <-> ListState.

Both directions are O(1): every array is `fresh` (a new object over the same buffer), so
mlx-lm's in-place updates (`ArraysCache.advance` does `self.lengths -= n`, models assign
`cache[0] = ...`) never reach a state someone holds.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from mlx_lm.models.cache import ArraysCache, CacheList

from kvstate import ListState, RecurrentState
from kvstate.kinds import trusted

from .registry import LM, fresh, from_cache, register_from, to_cache


@register_from(ArraysCache)
def _(cache: ArraysCache, appended: int = 0) -> RecurrentState:
    return trusted(RecurrentState)(
        tuple(fresh(a) for a in cache.cache),
        fresh(cache.left_padding),
        fresh(cache.lengths),
        appended,
    )


@register_from(CacheList)
def _(cache: CacheList, appended: int = 0) -> ListState:
    return trusted(ListState)(tuple(from_cache(c, appended) for c in cache.caches))


@to_cache.register
def _(state: RecurrentState, lib: ModuleType = LM) -> Any:
    # Not __init__, which would turn left_padding into a list; mlx-vlm's __new__ zeroes its
    # advance counters.
    cache = lib.ArraysCache.__new__(lib.ArraysCache)
    cache.cache = [fresh(a) for a in state.arrays]
    cache.left_padding = fresh(state.left_padding)
    cache.lengths = fresh(state.lengths)
    return cache


@to_cache.register
def _(state: ListState, lib: ModuleType = LM) -> Any:
    return lib.CacheList(*(to_cache(s, lib) for s in state.states))
