"""TurboQuantKV -> a cache through `to_mlx_lm` too: mlx-lm has no TurboQuant cache, so it
gives mlx-vlm's (`_vlm_turboquant`, which imports mlx_vlm only when such a state is met)."""

from __future__ import annotations

from typing import Any

from kvstate import TurboQuantKV

from ._convert import to_cache


@to_cache.register
def _(state: TurboQuantKV) -> Any:
    from ._vlm_turboquant import to_turboquant_cache

    return to_turboquant_cache(state)
