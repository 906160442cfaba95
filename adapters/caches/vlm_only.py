"""The kinds only mlx-vlm has a cache for (PooledKV, BufferedWindowKV, StaticPrefixKV,
TurboQuantKV): `to_cache` gives mlx-vlm's classes for them whatever library it is asked for,
importing mlx-vlm's converters (`caches.vlm`, and mlx_vlm with them) only when such a state
is met."""

from __future__ import annotations

from types import ModuleType
from typing import Any

from kvstate import BufferedWindowKV, PooledKV, StaticPrefixKV, TurboQuantKV

from .registry import LM, to_cache


@to_cache.register
def _(state: PooledKV, lib: ModuleType = LM) -> Any:
    from .vlm.pooling import to_pooling_cache

    return to_pooling_cache(state)


@to_cache.register
def _(state: BufferedWindowKV, lib: ModuleType = LM) -> Any:
    from .vlm.buffered_window import to_buffered_window_cache

    return to_buffered_window_cache(state)


@to_cache.register
def _(state: StaticPrefixKV, lib: ModuleType = LM) -> Any:
    from .vlm.static_prefix import to_static_prefix_cache

    return to_static_prefix_cache(state)


@to_cache.register
def _(state: TurboQuantKV, lib: ModuleType = LM) -> Any:
    from .vlm.turboquant import to_turboquant_cache

    return to_turboquant_cache(state)
