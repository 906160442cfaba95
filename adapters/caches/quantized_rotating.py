"""QuantizedRotatingKV <-> QuantizedRotatingCache: kvstate's cache object for a quantized
sliding window (mlx-lm has none: `RotatingKVCache.to_quantized` raises).

The cache holds three of mlx-lm's own window caches, one per lane of the state (packed
words, scales, biases of keys and values; see `kvstate._quantized_rotating`): an update
quantizes the new keys and values once and hands each lane's part to its window cache, so
the ring's writes, trims, rotation and padding are mlx-lm's, slot for slot, for the unpadded
(RotatingKVCache) and the batched (BatchRotatingKVCache) form. Positions, masks and
right-padded prompts are the packed lane's. A model reads it through its attention, routed
to kvstate's `quantized_attention` over the lanes' keys and values as mlx-lm's window cache
returned them (`instruments.routing`); it has no `bits`, so an attention that was not routed
fails with a message instead of reading the buffers with the wrong bits.

A state with an exact ring (`exact_latest` R) has a fourth cache, mlx-lm's own window cache of
R slots over the raw keys and values. Before an update, the masks of "within the latest R"
come from mlx-lm's `make_mask(N, window_size=R)` on both the packed lane's layout (the keys
read raw instead) and the ring's (which of its keys each query reads): mlx-lm computes
window masks narrower than a ring for Gemma's own layers, for one token and for many.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import _BaseCache

from kvstate import QuantizedKV, QuantizedRotatingKV, StateError, quantized_attention
from kvstate.kinds import replace, trusted
from kvstate.quantization import (
    attention_with_raw_keys,
    codec_of,
    joined,
    key_codec,
    lanes,
    value_codec,
    with_pads,
)

from .registry import Quantized, converter_of, register_from, to_cache


class QuantizedRotatingCache(_BaseCache):
    """The cache object of a QuantizedRotatingKV (see the module docstring)."""

    def __init__(self, state: QuantizedRotatingKV) -> None:
        self.spec = replace(
            state,
            keys=None,
            values=None,
            left_padding=None,
            offsets=None,
            previous=None,
            exact=None,
        )
        self.lanes = [to_cache(w) for w in lanes(state)]
        self.exact = None if state.exact is None else to_cache(state.exact)
        self._raw: tuple[Any, Any, Any, Any] | None = None  # keys, values, masks of a forward

    # ------------------------------------------------------------------ what a model reads

    @property
    def offset(self) -> Any:
        return self.lanes[0].offset

    @property
    def max_size(self) -> int:
        return int(self.spec.max_size)

    @property
    def bits(self) -> int:
        raise StateError(
            "this model's attention read a kvstate QuantizedRotatingCache as if it were one of "
            "mlx-lm's caches; run the model through kvstate.adapters.wrap(model), or route its "
            "attention first with kvstate.adapters.route_attention(model)"
        )

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Quantized, Quantized]:
        if self.lanes[0].keys is None:
            # The first forward fixes the pads (zero channels up to whole groups).
            as_quantized = trusted(QuantizedKV)(**codec_of(self.spec))
            padded = with_pads(as_quantized, int(keys.shape[-1]), int(values.shape[-1]))
            self.spec = replace(self.spec, key_pad=padded.key_pad, value_pad=padded.value_pad)
        if self.exact is not None:
            n, r = int(keys.shape[2]), self.spec.exact_latest
            read_raw = self.lanes[0].make_mask(n, window_size=r, return_array=True)
            ring_mask = self.exact.make_mask(n, window_size=r, return_array=True)
            raw_keys, raw_values = self.exact.update_and_fetch(keys, values)
            self._raw = (raw_keys, raw_values, read_raw, ring_mask)
        q_keys = key_codec(self.spec).encode(keys)
        q_values = value_codec(self.spec).encode(values)
        out = [
            c.update_and_fetch(k, v) for c, k, v in zip(self.lanes, q_keys, q_values, strict=True)
        ]
        return (out[0][0], out[1][0], out[2][0]), (out[0][1], out[1][1], out[2][1])

    def attend(
        self, queries: mx.array, keys: Quantized, values: Quantized, scale: float, mask: Any
    ) -> mx.array:
        """kvstate's quantized attention of `queries` over the window `update_and_fetch`
        returned (keys, values), masked by `mask` (the window's own, from `make_mask`)."""
        view = trusted(QuantizedKV)(
            keys, values, length=int(keys[0].shape[2]), **codec_of(self.spec)
        )
        if self._raw is None:
            return quantized_attention(queries, view, scale=scale, mask=mask)
        raw_keys, raw_values, read_raw, ring_mask = self._raw
        if read_raw is None:  # every key of the window is one of the latest R
            read_raw = mx.ones((view.length,), mx.bool_)
        return attention_with_raw_keys(
            queries,
            view,
            raw_keys,
            raw_values,
            scale=scale,
            mask=mask,
            read_raw=read_raw,
            raw_mask=ring_mask,
        )

    def make_mask(self, *args: Any, **kwargs: Any) -> Any:
        return self.lanes[0].make_mask(*args, **kwargs)

    # ------------------------------------------------------------------ prompt batches

    def prepare(self, **kwargs: Any) -> None:
        for c in self._all():
            c.prepare(**kwargs)

    def finalize(self) -> None:
        for c in self._all():
            c.finalize()

    def _all(self) -> list[Any]:
        return self.lanes if self.exact is None else [*self.lanes, self.exact]

    # ------------------------------------------------------------------ the rest of mlx-lm's

    def read(self, appended: int = 0) -> QuantizedRotatingKV:
        """The QuantizedRotatingKV this cache holds, in fresh arrays, stamped `appended`."""
        windows = [converter_of(c)(c, appended) for c in self.lanes]
        state = joined(codec_of(self.spec), windows)
        if self.exact is None:
            return state
        ring = converter_of(self.exact)(self.exact, appended)
        return replace(state, exact=ring, exact_latest=self.spec.exact_latest)

    def is_trimmable(self) -> bool:
        # mlx-lm trims a window only before it wraps: the exact ring of R slots wraps first
        return all(bool(c.is_trimmable()) for c in self._all())

    def trim(self, n: int) -> int:
        trimmed = [c.trim(n) for c in self._all()]
        return int(trimmed[0])

    def size(self) -> int:
        return int(self.lanes[0].size())

    def empty(self) -> bool:
        return bool(self.lanes[0].keys is None)

    @property
    def keys(self) -> Any:
        first = self.lanes[0].keys
        return None if first is None else tuple(c.keys for c in self.lanes)

    @property
    def values(self) -> Any:
        first = self.lanes[0].values
        return None if first is None else tuple(c.values for c in self.lanes)

    @property
    def nbytes(self) -> int:
        return sum(int(c.nbytes) for c in self._all())


@register_from(QuantizedRotatingCache)
def _(cache: QuantizedRotatingCache, appended: int = 0) -> QuantizedRotatingKV:
    return cache.read(appended)


@to_cache.register
def _(state: QuantizedRotatingKV, lib: Any = None) -> Any:
    from .registry import LM

    if lib is not None and lib is not LM:
        from kvstate import NotSupportedError

        raise NotSupportedError(
            "to_mlx_vlm: a QuantizedRotatingKV (quantized sliding window) becomes kvstate's "
            "QuantizedRotatingCache for mlx-lm models; mlx-vlm has no quantized window cache"
        )
    return QuantizedRotatingCache(state)
