"""PooledKV -> a cache through `to_mlx_lm` too: mlx-lm has no pooling cache, so it gives
mlx-vlm's (`_vlm_pooling`, which imports mlx_vlm only when such a state is met)."""

from __future__ import annotations

from typing import Any

from kvstate import PooledKV

from ._convert import to_cache


@to_cache.register
def _(state: PooledKV) -> Any:
    from ._vlm_pooling import to_pooling_cache

    return to_pooling_cache(state)
