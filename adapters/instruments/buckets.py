"""Attention over a bucketed key length in multi-token forwards, on CUDA.

MLX's CUDA attention for a query of several tokens pays ~36 ms the first time it sees a key
length (measured on the H200: benchmarks/probes/sdpa_shapes.py; 0.2-0.5 ms once that length was
seen). A speculative verify always meets a new length, so every round paid it. Here the dense
KV caches of a multi-token forward attend over their buffer up to the next multiple of
`STEP` instead, with mlx-lm's own mask extended by False over the extra positions: the
result is the same attention, and a length repeats for ~STEP / K rounds.

The caches get a subclass for the length of one forward (instance surgery: `swap`),
and only when the model asks one of them for its mask: a model that builds its own mask gets
the exact key length, as before. All dense caches of a forward share one `Bucket`, since a
model computes one mask (from one cache) for all its attention layers.

A verify of up to `kernels.verify_attention.MAX_QUERIES` tokens over a `KVCache` whose mask is
mlx-lm's plain causal one, or over a `BatchKVCache` whose mask is causal from each row's left
padding on (a ragged batch's), skips the buckets on CUDA: the model's attention is routed for
that forward (`routing.attention_routed`) to kvstate's verify kernel, which reads the exact
key length with no per-length cost and launches one kernel per layer where cuDNN (or, in
float32, unfused ops) costs the host more. cuDNN also builds a graph per (rows, queries, key
bucket): a serving batch, whose rows and verify widths change every few rounds, met such a
build (40-85 ms on the H200) again and again. The batch cache's mask is then the string
"causal" (its route reads the padding from the cache; should the kernel not take the call,
the route runs MLX's attention with the array mask itself, never mlx-lm's "causal").
Masks given as arrays otherwise (a tree, a window) keep the buckets.

Whether a wrapped model buckets, and routes to the kernel, is its `Bucketing` (chosen when
it is wrapped: `kvstate.adapters.wrap(model, buckets=..., verify_kernel=...)`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import BatchKVCache, KVCache

from ..caches.walk import leaves
from ..kernels.verify_attention import attention_for_device, causal_attention, supported, takes
from .routing import ROUTES, attention_routed
from .swap import swapped

STEP = 256


class Bucketing(NamedTuple):
    """Where a wrapped model's multi-token forwards bucket their key length (`force`: always
    or never; None: on a CUDA GPU, the default device at each forward), and whether a
    bucketed forward routes its attention to the verify kernel (`kernel`; off CUDA the same
    function is MLX's own attention, which is what the tests route through)."""

    force: bool | None = None
    kernel: bool = False

    @classmethod
    def resolved(cls, force: bool | None = None, kernel: bool | None = None) -> Bucketing:
        """The choice for a model wrapped now: `kernel` None means where CUDA is available."""
        return cls(force, mx.cuda.is_available() if kernel is None else kernel)

    def enabled(self, tokens: int) -> bool:
        """Whether a forward of `tokens` tokens buckets."""
        if tokens < 2:
            return False
        if self.force is not None:
            return self.force
        return mx.default_device() == mx.gpu and mx.cuda.is_available()


AUTO = Bucketing.resolved()  # what a forward run without a wrapped model's choice uses


class Bucket:
    """The key length every dense cache of one forward attends over (None: exact), and
    the verify attention the model's attention is routed to for this forward (None: not
    routed)."""

    def __init__(self) -> None:
        self.width: int | None = None
        self.kernel: Any = None


def _width(end: int) -> int:
    return -(-end // STEP) * STEP


def padded_mask(mask: Any, width: int) -> mx.array:
    """mlx-lm's causal mask (..., N, end), extended by False to (..., N, width)."""
    extra = width - mask.shape[-1]
    if extra == 0:
        return mask
    return mx.pad(mask, [(0, 0)] * (mask.ndim - 1) + [(0, extra)], constant_values=False)


def _for_attention(mask: mx.array, cache: Any, return_array: bool) -> mx.array:
    """The bucketed mask as the model's attention will use it. A caller that asked for an
    array may combine it (the tree forward ANDs it): it gets booleans. Otherwise it goes
    straight to `scaled_dot_product_attention`, which on CUDA turns a boolean mask into an
    additive one in every layer (one more kernel per layer and forward): made additive here
    once, in the keys' dtype."""
    if return_array or cache.keys is None:
        return mask
    dtype = cache.keys.dtype
    return mx.where(mask, mx.array(0, dtype), mx.array(-float("inf"), dtype))


def _fetch(cache: Any, width: int) -> tuple[mx.array, mx.array]:
    """The buffer's first `width` positions, growing it (zeros) if it is shorter."""
    short = width - cache.keys.shape[2]
    if short > 0:
        shape = (*cache.keys.shape[:2], short)
        cache.keys = mx.concatenate(
            [cache.keys, mx.zeros((*shape, cache.keys.shape[3]), cache.keys.dtype)], 2
        )
        cache.values = mx.concatenate(
            [cache.values, mx.zeros((*shape, cache.values.shape[3]), cache.values.dtype)], 2
        )
    return cache.keys[..., :width, :], cache.values[..., :width, :]


def _kernel_takes(cache: Any, tokens: int, return_array: bool, window_size: Any) -> bool:
    """Whether a causal mask for `tokens` over `cache` can go to the verify kernel (checked
    again, with the queries, where the attention is routed)."""
    keys = cache.keys
    return (
        cache._kvstate_bucket.kernel is not None
        and not return_array
        and window_size is None
        and keys is not None
        and takes(tokens, keys.shape[-1])
    )


class _BucketedKV(KVCache):
    _kvstate_bucket: Bucket

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None) -> Any:
        if _kernel_takes(self, N, return_array, window_size):
            return "causal"  # exact keys, attended by the verify kernel (`_verify_route`)
        end = self.offset + N
        self._kvstate_bucket.width = _width(end)
        mask = create_causal_mask(N, self.offset, window_size=window_size)
        return _for_attention(padded_mask(mask, _width(end)), self, return_array)

    def keys_and_values(self) -> tuple[mx.array, mx.array]:  # what update_and_fetch returns
        width = self._kvstate_bucket.width
        return KVCache.keys_and_values(self) if width is None else _fetch(self, width)


class _BucketedBatchKV(BatchKVCache):
    _kvstate_bucket: Bucket

    def make_mask(self, N: int, return_array: bool = False, **kwargs: Any) -> Any:
        if _kernel_takes(self, N, return_array, kwargs.get("window_size")):
            return "causal"  # exact keys from each row's padding on (`_batch_verify_route`)
        end = self._idx + N
        self._kvstate_bucket.width = _width(end)
        mask = create_causal_mask(N, offset=self._idx, left_padding=self.left_padding, **kwargs)
        return _for_attention(padded_mask(mask, _width(end)), self, return_array)

    def keys_and_values(self) -> tuple[mx.array, mx.array]:
        width = self._kvstate_bucket.width
        return BatchKVCache.keys_and_values(self) if width is None else _fetch(self, width)


def _verify_route(queries: Any, keys: Any, values: Any, cache: Any, scale: float, mask: Any,
                  sinks: Any) -> Any:  # fmt: skip
    """The routed attention of a `_BucketedKV` (see `routing.ROUTES`): the verify
    kernel for a plain causal mask, else None (mlx-lm's function, bucketed mask and all)."""
    attend = cache._kvstate_bucket.kernel
    causal = isinstance(mask, str) and mask == "causal"
    if causal and sinks is None and attend is not None and supported(queries, keys):
        return attend(queries, keys, values, scale)
    return None


def _batch_verify_route(queries: Any, keys: Any, values: Any, cache: Any, scale: float,
                        mask: Any, sinks: Any) -> Any:  # fmt: skip
    """The routed attention of a `_BucketedBatchKV`: for its "causal" mask (the rows' left
    padding is the cache's) the verify kernel, or where it cannot take the call MLX's
    attention with that mask as an array; else None (mlx-lm's function, bucketed mask)."""
    if not (isinstance(mask, str) and mask == "causal"):
        return None
    attend = cache._kvstate_bucket.kernel
    first = cache.left_padding
    if sinks is None and attend is not None and supported(queries, keys):
        return attend(queries, keys, values, scale, first)
    return causal_attention(queries, keys, values, scale, first, sinks)


ROUTES[_BucketedKV] = _verify_route
ROUTES[_BucketedBatchKV] = _batch_verify_route

_BUCKETED = {KVCache: _BucketedKV, BatchKVCache: _BucketedBatchKV}


@contextmanager
def bucketing(caches: list[Any], model: Any = None) -> Iterator[None]:
    """Give the forward's dense caches their bucketing class, then take it back. With the
    `model`, its attention is routed to the verify kernel meanwhile (a model with no
    routable attention keeps the buckets)."""
    bucket = Bucket()
    dense = [c for c in leaves(caches) if type(c) in _BUCKETED]
    try:
        with swapped([(c, _BUCKETED[type(c)]) for c in dense]):
            for cache in dense:
                cache._kvstate_bucket = bucket
            if model is None:
                yield
            else:
                with attention_routed(model) as routed:
                    bucket.kernel = attention_for_device() if routed else None
                    yield
    finally:
        for cache in dense:
            cache.__dict__.pop("_kvstate_bucket", None)
