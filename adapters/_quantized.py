"""QuantizedKVCache / QuantizedStateCache <-> QuantizedKV.

A QuantizedKV in mlx-lm's form (equal key and value bits and group sizes, no rotation, no
pad channels, no left padding) becomes mlx-lm's own QuantizedKVCache, with mlx-lm's packing
fixed on the instance: mlx-lm 0.32 allocates `dim // (32 // bits)` uint32 words per row, but
`mx.quantize` emits `dim * bits // 32`; they differ for 3 bits at head dims 192 / 256 and for
5 / 6 bits at most head dims, where mlx-lm's slice write fails. `update_and_fetch` is
`packed_update_and_fetch`, identical but for that allocation, set as an instance attribute
(not a subclass) so that mlx-lm's `save_prompt_cache` records the class `QuantizedKVCache`.

Every other QuantizedKV becomes a `QuantizedStateCache`, whose attention is kvstate's
`quantized_attention` (see `_attention_routing.route_attention`: the wrapped model's
attention modules are routed to it; mlx-lm's own quantized attention has one bits for keys
and values and knows no rotation).
"""

from __future__ import annotations

from types import MethodType
from typing import Any

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import QuantizedKVCache, _BaseCache, dynamic_roll

from kvstate import QuantizedKV, StateError, packed_width, quantized_attention
from kvstate.kinds import replace
from kvstate.quantization import is_mlx_lm_form, key_codec, value_codec, with_pads

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


class QuantizedStateCache(_BaseCache):
    """The cache object of a QuantizedKV that mlx-lm's QuantizedKVCache cannot hold (keys and
    values at different bits or group sizes, a rotation, pad channels or left padding).

    Like BatchKVCache with left padding: `offset` is each row's next position ((B,) array)
    and `make_mask` masks the padding. A model reads it through its attention, routed to
    `attend` (kvstate's `quantized_attention`); it has no `bits`, so an attention that was
    not routed fails with a message instead of reading the buffers with the wrong bits.
    """

    step = 256

    def __init__(self, state: QuantizedKV) -> None:
        self.spec = replace(state, keys=None, values=None, left_padding=None, appended=0)
        self.keys = _triple(state.keys)
        self.values = _triple(state.values)
        self.left_padding = fresh(state.left_padding)
        self._idx = state.length
        self._right_padding: mx.array | None = None

    @property
    def offset(self) -> Any:
        if self.left_padding is None:
            return self._idx
        return self._idx - self.left_padding

    @property
    def bits(self) -> int:
        raise StateError(
            "this model's attention read a kvstate QuantizedStateCache as if it were mlx-lm's "
            "QuantizedKVCache (keys and values at one bits, no rotation), which it is not; run "
            "the model through kvstate.adapters.wrap(model), or route its attention first with "
            "kvstate.adapters.route_attention(model)"
        )

    def state_now(self) -> QuantizedKV:
        """The QuantizedKV this cache holds now (arrays shared, not copied)."""
        return replace(
            self.spec,
            keys=self.keys,
            values=self.values,
            left_padding=self.left_padding,
            length=self._idx,
        )

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Quantized, Quantized]:
        if self.keys is None:
            self.spec = with_pads(self.spec, int(keys.shape[-1]), int(values.shape[-1]))
        q_keys = key_codec(self.spec).encode(keys)
        q_values = value_codec(self.spec).encode(values)
        prev, n = self._idx, int(keys.shape[2])
        if self.keys is None or self.values is None or prev + n > self.keys[0].shape[2]:
            self.keys = _grown(self.keys, q_keys, prev, n, self.step)
            self.values = _grown(self.values, q_values, prev, n, self.step)
        keys_buf, values_buf = list(self.keys), list(self.values)
        for buf, new in ((keys_buf, q_keys), (values_buf, q_values)):
            for i in range(3):
                buf[i][..., prev : prev + n, :] = new[i]
        self.keys = (keys_buf[0], keys_buf[1], keys_buf[2])
        self.values = (values_buf[0], values_buf[1], values_buf[2])
        self._idx = prev + n
        return self.keys_and_values()

    def keys_and_values(self) -> tuple[Quantized, Quantized]:
        assert self.keys is not None and self.values is not None
        n = self._idx

        def cut(q: Quantized) -> Quantized:
            return (
                q if q[0].shape[2] == n else (q[0][..., :n, :], q[1][..., :n, :], q[2][..., :n, :])
            )

        return cut(self.keys), cut(self.values)

    def attend(self, queries: mx.array, scale: float, mask: Any) -> mx.array:
        """kvstate's quantized attention of `queries` over what this cache holds."""
        return quantized_attention(queries, self.state_now(), scale=scale, mask=mask)

    def make_mask(
        self, N: int, return_array: bool = False, window_size: int | None = None, **_: Any
    ) -> Any:
        if self.left_padding is None and window_size is None and not return_array:
            return None if N == 1 else "causal"
        return create_causal_mask(
            N, offset=self._idx, left_padding=self.left_padding, window_size=window_size
        )

    # right-padded prompt batches (wrap(model)(tokens, state, lengths=...)), as BatchKVCache
    def prepare(
        self,
        *,
        left_padding: Any = None,
        lengths: Any = None,
        right_padding: Any = None,
    ) -> None:
        if left_padding is not None:
            raise StateError("QuantizedStateCache.prepare: left padding comes from the state")
        if right_padding is not None and max(right_padding) > 0:
            self._right_padding = mx.array(right_padding)

    def finalize(self) -> None:
        padding = self._right_padding
        if padding is None or self.keys is None or self.values is None:
            return
        roll = padding[:, None]
        self.keys = tree_map(lambda a: dynamic_roll(a, roll, axis=2), self.keys)
        self.values = tree_map(lambda a: dynamic_roll(a, roll, axis=2), self.values)
        lp = self.left_padding
        self.left_padding = padding if lp is None else lp + padding
        self._right_padding = None

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self._idx, n)
        self._idx -= n
        return n

    def size(self) -> int:
        return self._idx

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for q in (self.keys, self.values) if q is not None for a in q)


def _grown(current: Quantized | None, new: Quantized, prev: int, n: int, step: int) -> Quantized:
    """Buffers (of `new`'s widths and dtypes) with room for n more positions after the first
    `prev`, grown like mlx-lm's: by whole steps of 256 positions, the used part kept."""
    steps = (step + n - 1) // step * step

    def grow(i: int) -> mx.array:
        extra = mx.zeros((*new[i].shape[:2], steps, new[i].shape[3]), new[i].dtype)
        if current is None:
            return extra
        return mx.concatenate([current[i][..., :prev, :], extra], axis=2)

    return (grow(0), grow(1), grow(2))


@register_from(QuantizedKVCache)
def _(cache: QuantizedKVCache, appended: int = 0) -> QuantizedKV:
    return QuantizedKV(
        _triple(cache.keys),
        _triple(cache.values),
        length=cache.offset,
        appended=appended,
        key_bits=cache.bits,
        value_bits=cache.bits,
        key_group_size=cache.group_size,
        value_group_size=cache.group_size,
    )


@register_from(QuantizedStateCache)
def _(cache: QuantizedStateCache, appended: int = 0) -> QuantizedKV:
    if cache._right_padding is not None:
        raise StateError(
            "from_mlx_lm: this QuantizedStateCache is between prepare() and finalize(); call "
            "cache.finalize() after the padded prompt forward, then convert"
        )
    return replace(
        cache.spec,
        keys=_triple(cache.keys),
        values=_triple(cache.values),
        left_padding=fresh(cache.left_padding),
        length=cache._idx,
        appended=appended,
    )


@to_cache.register
def _(state: QuantizedKV) -> QuantizedKVCache | QuantizedStateCache:
    if not is_mlx_lm_form(state):
        return QuantizedStateCache(state)
    cache: Any = packed_quantized_cache(state.key_group_size, state.key_bits)
    cache.keys, cache.values = _triple(state.keys), _triple(state.values)
    cache.offset = state.length
    return cache
