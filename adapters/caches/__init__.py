"""Cache objects <-> kvstate states, one converter per kind for both libraries.

    registry        the tables (cache class -> converter; kind -> `to_cache(state, lib)`)
    walk            the one walk over a model's caches (cache lists' parts in place)
    compat          upstream fixes and the refusals of caches caught mid-forward
    dense rotating recurrent chunked quantized quantized_cache   one kind each (mlx-lm's classes)
    quantized_rotating   kvstate's own cache of a quantized sliding window
    vlm_only        kinds only mlx-vlm has caches for
    vlm/            mlx-vlm's classes (imports mlx_vlm; loaded when one of its caches arrives)
    convert         from_mlx_lm / to_mlx_lm

Importing this package registers every mlx-lm converter. A new kind with its own cache class
registers here too (examples/custom_kind.py): `register_from(CacheClass)` for cache -> state,
`to_cache.register` for state -> cache, `fresh` for the arrays on either side.
"""

from . import (  # noqa: F401
    chunked,
    dense,
    quantized,
    quantized_rotating,
    recurrent,
    rotating,
    vlm_only,
)
from .convert import from_mlx_lm, to_mlx_lm
from .registry import fresh, register_from, to_cache

__all__ = ["fresh", "from_mlx_lm", "register_from", "to_cache", "to_mlx_lm"]
