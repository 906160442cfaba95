"""Routing a model's attention to kvstate's own, without changing mlx-lm.

mlx-lm's attention modules call the module-level `scaled_dot_product_attention(queries,
keys, values, cache=..., scale=..., mask=...)` of `mlx_lm.models.base`, which sends a cache
with `bits` to its own quantized attention (one bits for keys and values, no rotation).
A routed attention module gets a subclass whose methods are copies of mlx-lm's own, reading
under that name a function that looks the cache's class up in `ROUTES`: a
`QuantizedStateCache` goes to `cache.attend` (kvstate's `quantized_attention`), mlx-lm's
`QuantizedKVCache` to it too on a GPU (where mlx-lm's own reads it wrongly), the caches of
a CUDA verify forward to the verify kernel (`buckets`), every other cache to mlx-lm's
function, unchanged. mlx-lm's classes and modules are left untouched, and other instances of
the same classes are not affected.

`route_attention(model)` routes a model for good (a QuantizedKV state needs it at every
step); `attention_routed(model)` routes it for the length of one forward (a verify), so that
decode steps keep mlx-lm's function with no lookup in between.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import QuantizedKVCache

from kvstate import NotSupportedError, quantized_attention

from ..caches.quantized_cache import QuantizedStateCache
from ..caches.quantized_rotating import QuantizedRotatingCache
from ..caches.registry import from_cache
from ..caches.routes import ROUTED_FOR_GOOD, ROUTES
from ..caches.walk import leaves
from .swap import reading, subclass, swapped, with_body

NAME = "scaled_dot_product_attention"

_ROUTED = "_kvstate_attention_routed"  # set on a routed model (an nn.Module is unhashable)


def _quantized(queries: Any, keys: Any, values: Any, cache: Any, scale: float, mask: Any,
               sinks: Any) -> Any:  # fmt: skip
    if sinks is not None:
        raise NotSupportedError("kvstate's quantized attention does not support attention sinks")
    return cache.attend(queries, scale, mask)


def _quantized_window(queries: Any, keys: Any, values: Any, cache: Any, scale: float,
                      mask: Any, sinks: Any) -> Any:  # fmt: skip
    if sinks is not None:
        raise NotSupportedError("kvstate's quantized attention does not support attention sinks")
    return cache.attend(queries, keys, values, scale, mask)


def mlx_lm_quantized_attention_is_right() -> bool:
    """Whether mlx-lm's own quantized attention reads a QuantizedKVCache rightly on the
    default device. On MLX CUDA 0.32 it does not: it broadcasts the keys over the GQA repeats
    and hands quantized_matmul the buffers cut at the offset, which CUDA's kernel reads as if
    every batch were batch 0 (SmolLM2, head dim 64, K4/V4 group 32: perplexity 1.4 million
    instead of 14) or refuses ("No implementation for problem shape" at group 64)."""
    return mx.default_device().type != mx.DeviceType.gpu


def _mlx_lm_quantized(queries: Any, keys: Any, values: Any, cache: Any, scale: float,
                      mask: Any, sinks: Any) -> Any:  # fmt: skip
    """A QuantizedKVCache (a state in mlx-lm's form) read by mlx-lm's function where that is
    right, else by kvstate's quantized attention over the same quantized triples."""
    if sinks is not None or mlx_lm_quantized_attention_is_right():
        return None
    # the cache's own state (its registered converter), read by kvstate's attention
    return quantized_attention(queries, from_cache(cache), scale=scale, mask=mask)


ROUTES[QuantizedStateCache] = _quantized
ROUTES[QuantizedRotatingCache] = _quantized_window
ROUTES[QuantizedKVCache] = _mlx_lm_quantized
ROUTED_FOR_GOOD.update((QuantizedStateCache, QuantizedRotatingCache, QuantizedKVCache))


def routed_function(original: Callable[..., Any]) -> Callable[..., Any]:
    """mlx-lm's attention function `original`, routed: a cache whose class has a route in
    `ROUTES` goes to it (when the route declines, with None, to `original`)."""

    def scaled_dot_product_attention(
        queries: Any, keys: Any, values: Any, *args: Any, **kw: Any
    ) -> Any:
        cache = args[0] if args else kw.get("cache")
        route = ROUTES.get(type(cache))
        if route is None:
            return original(queries, keys, values, *args, **kw)
        # mlx-lm's modules pass keywords; positional arguments are named first.
        given = (
            dict(zip(("cache", "scale", "mask", "sinks"), args, strict=False)) | kw if args else kw
        )
        out = route(
            queries, keys, values, cache, given["scale"], given.get("mask"), given.get("sinks")
        )
        return original(queries, keys, values, *args, **kw) if out is None else out

    return scaled_dot_product_attention


def _routed_class(cls: type) -> type | None:
    """A subclass of `cls` whose methods calling `NAME` read the routing function (None when
    no method of `cls` calls it)."""
    return subclass("routing", cls, _make_routed)


def _make_routed(cls: type, _: None) -> type | None:
    body: dict[str, Any] = reading(
        cls, NAME, lambda original: None if original is None else routed_function(original)
    )
    if not body:
        return None
    return with_body(cls, {**body, "__qualname__": cls.__qualname__, "_kvstate_routed": True})


def route_attention(model: nn.Module) -> nn.Module:
    """Route every attention module of `model` that calls mlx-lm's
    `scaled_dot_product_attention` to kvstate's quantized attention for QuantizedKV states
    that mlx-lm's QuantizedKVCache cannot hold, and for those it holds where mlx-lm's
    attention reads them wrongly (MLX CUDA); other caches: mlx-lm's function, as before.
    Idempotent; `wrap(model)` does it when such a state first runs. Returns `model`."""
    if getattr(model, _ROUTED, False):
        return model
    for module in model.modules():
        if getattr(type(module), "_kvstate_routed", False):
            continue
        routed = _routed_class(type(module))
        if routed is not None:
            module.__class__ = routed
    object.__setattr__(model, _ROUTED, True)
    return model


_MODULES = "_kvstate_attention_modules"  # a model's routable modules, found once


def attention_routed(model: nn.Module) -> swapped:
    """Route `model`'s attention modules for the length of a `with` block (those routed for
    good stay so); the block gets whether it has any."""
    if not isinstance(model, nn.Module):  # mlx-vlm's language step: its own attention
        return swapped((), False)
    modules = getattr(model, _MODULES, None)
    if modules is None:
        modules = [m for m in model.modules() if _routed_class(type(m)) is not None]
        object.__setattr__(model, _MODULES, modules)
    pairs = []
    for module in modules:  # a plain loop: this runs on every verify, for every layer
        cls = type(module)
        if not getattr(cls, "_kvstate_routed", False):  # not routed for good already
            pairs.append((module, subclass("routing", cls, _make_routed)))
    return swapped(pairs, bool(modules))


def needs_routing(model: nn.Module, caches: list[Any]) -> bool:
    """Whether `caches` hold a cache routed for good (a QuantizedStateCache, a
    QuantizedRotatingCache, mlx-vlm's TurboQuant caches) and `model` is not routed yet
    (mlx-vlm's language step never is: its models read their own caches)."""
    if getattr(model, _ROUTED, False) or not isinstance(model, nn.Module):
        return False
    for c in leaves(caches):  # noqa: SIM110  (a loop, not any(): this runs every verify)
        if type(c) in ROUTED_FOR_GOOD:
            return True
    return False
