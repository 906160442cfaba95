"""KVCache / BatchKVCache / ConcatenateKVCache (and mlx-vlm's SimpleKVCache) <-> DenseKV."""

from __future__ import annotations

from types import ModuleType
from typing import Any

from mlx_lm.models.cache import BatchKVCache, ConcatenateKVCache, KVCache

from kvstate import DenseKV
from kvstate.kinds import trusted

from .compat import refuse_mid_prompt
from .registry import LM, fresh, register_from, to_cache


@register_from(KVCache)
def _(cache: KVCache, appended: int = 0) -> DenseKV:
    keys, values = cache.keys, cache.values
    if keys is None or values is None:  # before the first forward
        return trusted(DenseKV)(None, None, None, cache.offset, appended)
    # keys[...] is `fresh` inlined: this runs for every layer of every decode step.
    return trusted(DenseKV)(keys[...], values[...], None, cache.offset, appended)


@register_from(ConcatenateKVCache)
def _(cache: ConcatenateKVCache, appended: int = 0) -> DenseKV:
    return trusted(DenseKV)(
        fresh(cache.keys), fresh(cache.values), None, cache.offset, appended, True
    )


@register_from(BatchKVCache)
def _(cache: BatchKVCache, appended: int = 0) -> DenseKV:
    right_padding = getattr(cache, "_right_padding", None)
    if right_padding is not None:
        # Between prepare(right_padding=...) and finalize() the rows are right-padded; a
        # DenseKV is left-padded only, and finalize() would find nothing to roll.
        refuse_mid_prompt(cache, "_right_padding", right_padding.tolist())
    # offset == _idx - left_padding in every BatchKVCache, so the state derives it.
    return trusted(DenseKV)(
        fresh(cache.keys), fresh(cache.values), fresh(cache.left_padding), cache._idx, appended
    )


@to_cache.register
def _(state: DenseKV, lib: ModuleType = LM) -> Any:
    if state.left_padding is not None:
        batch = lib.BatchKVCache.__new__(lib.BatchKVCache)
        batch.keys, batch.values = fresh(state.keys), fresh(state.values)
        batch.left_padding = fresh(state.left_padding)
        batch.offset = state.length - state.left_padding
        batch._idx = state.length
        batch._right_padding = None
        return batch
    if state.simple and hasattr(lib, "SimpleKVCache"):  # mlx-vlm's; mlx-lm has none
        simple = lib.SimpleKVCache()
        # No tokens is `keys is None` there: florence2's cross-attention reads a cache whose
        # keys are not None as filled, so a state committed back to 0 gives a fresh cache.
        if state.keys is not None and state.values is not None and state.length > 0:
            simple.keys = state.keys[..., : state.length, :]
            simple.values = state.values[..., : state.length, :]
        simple.cache_length = state.length
        return simple
    if state.concatenate:
        concat = lib.ConcatenateKVCache()
        if state.keys is not None and state.values is not None:
            concat.keys = state.keys[..., : state.length, :]
            concat.values = state.values[..., : state.length, :]
        concat.offset = state.length
        return concat
    cache = lib.KVCache()
    cache.keys, cache.values, cache.offset = fresh(state.keys), fresh(state.values), state.length
    return cache
