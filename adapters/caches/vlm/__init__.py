"""mlx-vlm cache objects <-> kvstate states (`mlx_vlm.models.cache`), O(1) like mlx-lm's.

mlx-vlm keeps its own copy of every mlx-lm cache class. Where a class holds the same fields
with the same meaning, it maps to the same kind, so a state made from either library's caches
is the same state (tests/test_vlm_caches.py checks the fields, and the classes' own
update_and_fetch / trim / make_mask / filter / extend / extract against the state's):

    KVCache, BatchKVCache, ConcatenateKVCache  -> DenseKV              (copies)
    SimpleKVCache                              -> DenseKV (concatenate, simple)
    RotatingKVCache, BatchRotatingKVCache      -> RotatingKV
    ArraysCache                                -> RecurrentState
    CacheList                                  -> ListState
    ChunkedKVCache                             -> ChunkedKV
    QuantizedKVCache, BatchQuantizedKVCache    -> QuantizedKV
    PoolingCache, BatchPoolingCache            -> PooledKV             (pooling)
    BufferedRotatingKVCache (keep=0)           -> BufferedWindowKV     (buffered_window)
    StaticPrefixKVCache                        -> StaticPrefixKV       (static_prefix)
    TurboQuantKVCache, BatchTurboQuantKVCache,
    HybridQuantKVCache (mlx_vlm.turboquant)    -> TurboQuantKV         (turboquant)

State -> cache: `to_vlm_cache(state)` is `to_cache(state, VLM)`, each kind's converter with
mlx-vlm's cache module; `kvstate.adapters.to_mlx_lm` keeps giving mlx-lm's. This package
imports mlx_vlm: only `kvstate.adapters.vlm`, the mlx-vlm wrapped model and the caches face
(when it meets an mlx-vlm object) import it.
"""

from __future__ import annotations

from typing import Any

from mlx_vlm.models import cache as VLM

from ..registry import to_cache
from . import buffered_window, copies, pooling, static_prefix, turboquant  # noqa: F401


def to_vlm_cache(state: Any) -> Any:
    """One layer state -> a new mlx-vlm cache object holding fresh arrays."""
    return to_cache(state, VLM)


__all__ = ["VLM", "to_vlm_cache"]
