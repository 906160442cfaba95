"""QuantizedKVCache (and mlx-vlm's BatchQuantizedKVCache) <-> QuantizedKV.

A QuantizedKV in mlx-lm's form (equal key and value bits and group sizes, no rotation, no
pad channels, no left padding) becomes the library's own QuantizedKVCache (mlx-lm's with its
packing fixed: `compat.packed_quantized_cache`). Every other QuantizedKV becomes kvstate's
`QuantizedStateCache` for mlx-lm (whose attention is kvstate's: mlx-lm's own quantized
attention has one bits for keys and values and knows no rotation); for mlx-vlm a left-padded
one becomes its BatchQuantizedKVCache where that class can hold it, and the rest is refused.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from mlx_lm.models.cache import QuantizedKVCache

from kvstate import NotSupportedError, QuantizedKV
from kvstate.kinds import trusted
from kvstate.quantization import is_mlx_lm_form

from .compat import packed_quantized_cache
from .quantized_cache import QuantizedStateCache
from .registry import LM, fresh, register_from, to_cache, triple


@register_from(QuantizedKVCache)
def _(cache: QuantizedKVCache, appended: int = 0) -> QuantizedKV:
    return trusted(QuantizedKV)(
        triple(cache.keys),
        triple(cache.values),
        length=cache.offset,
        appended=appended,
        key_bits=cache.bits,
        value_bits=cache.bits,
        key_group_size=cache.group_size,
        value_group_size=cache.group_size,
    )


@to_cache.register
def _(state: QuantizedKV, lib: ModuleType = LM) -> Any:
    if state.left_padding is not None and hasattr(lib, "BatchQuantizedKVCache"):
        return _batch_quantized(state, lib)  # mlx-vlm's batched class (mlx-lm has none)
    if not is_mlx_lm_form(state):
        if lib is LM:
            return QuantizedStateCache(state)
        raise NotSupportedError(
            "to_mlx_vlm: this QuantizedKV becomes an mlx-lm QuantizedStateCache, which "
            "mlx-vlm's QuantizedKVCache (one group_size and bits for keys and values) "
            "cannot hold"
        )
    if lib is LM:
        cache: Any = packed_quantized_cache(state.key_group_size, state.key_bits)
    else:  # mlx-vlm allocates `dim * bits // 32` words per row: no packing fix is needed
        cache = lib.QuantizedKVCache(group_size=state.key_group_size, bits=state.key_bits)
    cache.keys, cache.values = triple(state.keys), triple(state.values)
    cache.offset = state.length
    return cache


def _batch_quantized(state: QuantizedKV, lib: ModuleType) -> Any:
    # seed included: a state keeps it even without a rotation, and this class cannot hold it
    statics = (state.key_pad, state.value_pad, state.rotation, state.seed, state.exact_latest)
    plain = statics == (0, 0, "none", 0, 0)
    if not plain or (state.key_bits, state.key_group_size) != (
        state.value_bits,
        state.value_group_size,
    ):
        raise NotSupportedError(
            "to_mlx_vlm: mlx-vlm's BatchQuantizedKVCache has one bits and group_size for keys "
            "and values and no padded channels, rotation, seed or exact tail; this QuantizedKV "
            "has "
            f"key_bits={state.key_bits}, value_bits={state.value_bits}, key_group_size="
            f"{state.key_group_size}, value_group_size={state.value_group_size}, key_pad="
            f"{state.key_pad}, value_pad={state.value_pad}, rotation={state.rotation!r}, "
            f"seed={state.seed}, exact_latest={state.exact_latest}"
        )
    padding = fresh(state.left_padding)
    batch = lib.BatchQuantizedKVCache.__new__(lib.BatchQuantizedKVCache)
    batch.keys, batch.values = triple(state.keys), triple(state.values)
    batch.left_padding, batch.offset = padding, state.length - padding
    batch._idx = state.length
    batch.group_size, batch.bits = state.key_group_size, state.key_bits
    batch._right_padding = None
    return batch
