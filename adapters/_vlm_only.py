"""Kinds only mlx-vlm has a cache for (PooledKV, BufferedWindowKV, StaticPrefixKV): through
`to_mlx_lm` too they become mlx-vlm's classes (imported only when such a state is met)."""

from __future__ import annotations

from typing import Any

from kvstate import BufferedWindowKV, PooledKV, StaticPrefixKV

from ._convert import to_cache


@to_cache.register
def _(state: PooledKV) -> Any:
    from ._vlm_pooling import to_pooling_cache

    return to_pooling_cache(state)


@to_cache.register
def _(state: BufferedWindowKV) -> Any:
    from ._vlm_buffered_window import to_buffered_window_cache

    return to_buffered_window_cache(state)


@to_cache.register
def _(state: StaticPrefixKV) -> Any:
    from ._vlm_static_prefix import to_static_prefix_cache

    return to_static_prefix_cache(state)
