"""QuantizedKVCache <-> QuantizedKV, with mlx-lm's packing fixed on the instances we make.

mlx-lm 0.32's QuantizedKVCache allocates `dim // (32 // bits)` uint32 words per row, but
`mx.quantize` emits `dim * bits // 32`. The two agree for 2, 4 and 8 bits, and for 3, 5 and
6 bits only at some head dims (64 works; 192 and 256 do not), where the slice write into the
buffer fails. `to_mlx_lm` therefore hands models QuantizedKVCache objects whose
`update_and_fetch` is `packed_update_and_fetch`, identical but for that allocation. It is an
instance attribute, not a subclass, so that mlx-lm's `save_prompt_cache` records the class
name `QuantizedKVCache`, which its `load_prompt_cache` can load.
"""

from __future__ import annotations

from types import MethodType
from typing import Any

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.models.cache import QuantizedKVCache

from kvstate import QuantizedKV, packed_width

from ._convert import fresh, register_from, to_cache

Quantized = tuple[mx.array, mx.array, mx.array]


def packed_update_and_fetch(self: Any, keys: mx.array, values: mx.array) -> Any:
    """mlx-lm's QuantizedKVCache.update_and_fetch with only `init_quant`'s width changed."""
    B, n_kv_heads, num_steps, k_head_dim = keys.shape
    v_head_dim = values.shape[-1]
    prev = self.offset

    if self.keys is None or (prev + num_steps) > self.keys[0].shape[-2]:
        new_steps = (self.step + num_steps - 1) // self.step * self.step
        shape = (B, n_kv_heads, new_steps)

        def init_quant(dim: int) -> tuple[mx.array, mx.array, mx.array]:
            return (
                mx.zeros((*shape, packed_width(dim, self.bits)), dtype=mx.uint32),
                mx.zeros((*shape, dim // self.group_size), dtype=keys.dtype),
                mx.zeros((*shape, dim // self.group_size), dtype=keys.dtype),
            )

        def expand_quant(x: mx.array) -> mx.array:
            new_x = mx.zeros((*shape, x.shape[-1]), dtype=x.dtype)
            return mx.concatenate([x, new_x], axis=-2)

        if self.keys is not None:
            if prev % self.step != 0:
                self.keys, self.values = tree_map(
                    lambda x: x[..., :prev, :], (self.keys, self.values)
                )
            self.keys, self.values = tree_map(expand_quant, (self.keys, self.values))
        else:
            self.keys, self.values = init_quant(k_head_dim), init_quant(v_head_dim)

    self.offset += num_steps

    q_keys = mx.quantize(keys, group_size=self.group_size, bits=self.bits)
    q_values = mx.quantize(values, group_size=self.group_size, bits=self.bits)
    for i in range(len(self.keys)):
        self.keys[i][..., prev : self.offset, :] = q_keys[i]
        self.values[i][..., prev : self.offset, :] = q_values[i]

    return self.keys_and_values()


def _triple(q: Any) -> Quantized | None:
    """A cache's (list or tuple) triple as a tuple of fresh arrays."""
    if q is None:
        return None
    packed, scales, biases = q
    return (fresh(packed), fresh(scales), fresh(biases))


def packed_quantized_cache(group_size: int, bits: int) -> QuantizedKVCache:
    """An mlx-lm QuantizedKVCache whose buffers hold `dim * bits // 32` words per row."""
    cache = QuantizedKVCache(group_size=group_size, bits=bits)
    cache.update_and_fetch = MethodType(packed_update_and_fetch, cache)  # type: ignore[method-assign]
    return cache


@register_from(QuantizedKVCache)
def _(cache: QuantizedKVCache, appended: int = 0) -> QuantizedKV:
    return QuantizedKV(
        _triple(cache.keys),
        _triple(cache.values),
        length=cache.offset,
        group_size=cache.group_size,
        bits=cache.bits,
        appended=appended,
    )


@to_cache.register
def _(state: QuantizedKV) -> QuantizedKVCache:
    cache: Any = packed_quantized_cache(state.group_size, state.bits)
    cache.keys, cache.values = _triple(state.keys), _triple(state.values)
    cache.offset = state.length
    return cache
