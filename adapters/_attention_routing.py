"""Routing a model's attention to kvstate's own, without changing mlx-lm.

mlx-lm's attention modules call the module-level `scaled_dot_product_attention(queries,
keys, values, cache=..., scale=..., mask=...)` of `mlx_lm.models.base`, which sends a cache
with `bits` to its own quantized attention (one bits for keys and values, no rotation).
A routed attention module gets a subclass whose methods are copies of mlx-lm's own, reading
under that name a function that looks the cache's class up in `ROUTES`: a
`QuantizedStateCache` goes to `cache.attend` (kvstate's `quantized_attention`), the caches of
a CUDA verify forward to the verify kernel (`_buckets`), every other cache to mlx-lm's
function, unchanged. mlx-lm's classes and modules are left untouched, and other instances of
the same classes are not affected.

`route_attention(model)` routes a model for good (a QuantizedKV state needs it at every
step); `attention_routed(model)` routes it for the length of one forward (a verify), so that
decode steps keep mlx-lm's function with no lookup in between.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import mlx.nn as nn
from mlx_lm.models.cache import CacheList

from ._capture import _reading
from .caches.quantized_cache import QuantizedStateCache

NAME = "scaled_dot_product_attention"

_ROUTED = "_kvstate_attention_routed"  # set on a routed model (an nn.Module is unhashable)
_CLASSES: dict[type, type] = {}


# (queries, keys, values, cache, scale, mask, sinks) -> output, or None for mlx-lm's function
Route = Callable[[Any, Any, Any, Any, float, Any, Any], Any]
ROUTES: dict[type, Route] = {}


def _quantized(queries: Any, keys: Any, values: Any, cache: Any, scale: float, mask: Any,
               sinks: Any) -> Any:  # fmt: skip
    if sinks is not None:
        raise ValueError("kvstate's quantized attention does not support attention sinks")
    return cache.attend(queries, scale, mask)


ROUTES[QuantizedStateCache] = _quantized


def _routing(original: Callable[..., Any]) -> Callable[..., Any]:
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
    if cls not in _CLASSES:
        body: dict[str, Any] = {}
        for klass in cls.__mro__:
            if klass is nn.Module:
                break
            for name, fn in vars(klass).items():
                calls = isinstance(fn, types.FunctionType) and NAME in fn.__code__.co_names
                if calls and name not in body and NAME in fn.__globals__:
                    body[name] = _reading(fn, NAME, _routing(fn.__globals__[NAME]))
        routed = None
        if body:
            body["__module__"] = cls.__module__
            body["__qualname__"] = cls.__qualname__
            body["_kvstate_routed"] = True
            routed = type(cls.__name__, (cls,), body)
        _CLASSES[cls] = routed  # type: ignore[assignment]
    return _CLASSES[cls]


def route_attention(model: nn.Module) -> nn.Module:
    """Route every attention module of `model` that calls mlx-lm's
    `scaled_dot_product_attention` to kvstate's quantized attention for QuantizedKV states
    that mlx-lm's QuantizedKVCache cannot hold (other caches: mlx-lm's function, as before).
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


@contextmanager
def attention_routed(model: nn.Module) -> Iterator[bool]:
    """Route `model`'s attention modules for the length of the block (those routed for good
    stay so); yields whether it has any."""
    if not isinstance(model, nn.Module):  # mlx-vlm's language step: its own attention
        yield False
        return
    modules = getattr(model, _MODULES, None)
    if modules is None:
        modules = [m for m in model.modules() if _routed_class(type(m)) is not None]
        object.__setattr__(model, _MODULES, modules)
    swapped = []
    # object's `__setattr__`: nn.Module's own is Python code, ~1 us a module, twice a verify.
    setattr_ = object.__setattr__
    try:
        for module in modules:
            cls = type(module)
            routed = None if getattr(cls, "_kvstate_routed", False) else _routed_class(cls)
            if routed is not None:
                setattr_(module, "__class__", routed)
                swapped.append((module, cls))
        yield bool(modules)
    finally:
        for module, cls in swapped:
            setattr_(module, "__class__", cls)


def needs_routing(model: nn.Module, caches: list[Any]) -> bool:
    """Whether `caches` hold a QuantizedStateCache and `model` is not routed yet."""
    return not getattr(model, _ROUTED, False) and any(_quantized_state_caches(caches))


def _quantized_state_caches(caches: list[Any]) -> Any:
    for c in caches:
        if isinstance(c, CacheList):
            yield from _quantized_state_caches(list(c.caches))
        elif isinstance(c, QuantizedStateCache):
            yield c
