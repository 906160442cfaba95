"""The tables both directions of conversion register in, and the helpers every converter uses.

cache -> state: `CONVERTERS` maps a cache class (mlx-lm's, mlx-vlm's, kvstate's own) to
`(cache, appended) -> layer state`; a kind's module registers its classes with `register_from`.
state -> cache: `to_cache(state, lib)` dispatches on the state's kind; `lib` is the library's
cache module (`mlx_lm.models.cache`, the default, or `mlx_vlm.models.cache`), so each kind's
converter is written once for both libraries (`names(lib)` words its errors).

Neither direction ever hands the same `mx.array` object to both sides: `fresh(a)` is a new
array object over the same buffer, so a model's in-place slice write into a cache object
(`cache.keys[..., i:j, :] = k`) copies on write instead of reaching a state someone holds.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import singledispatch
from types import ModuleType
from typing import Any, NamedTuple

import mlx.core as mx
from mlx_lm.models import cache as mlx_lm_caches

from kvstate import NotSupportedError, StateError

LM: ModuleType = mlx_lm_caches
"""mlx-lm's cache module: the library `to_cache` makes caches of unless told otherwise."""


def fresh(a: Any) -> Any:
    """A new array object over the same buffer (None stays None; tuples map)."""
    if type(a) is mx.array:  # the hot case first: this runs for every array of every step
        return a[...]
    if a is None:
        return None
    if isinstance(a, tuple):
        return tuple(fresh(x) for x in a)
    if isinstance(a, list):
        return [fresh(x) for x in a]
    return a[...]


Quantized = tuple[mx.array, mx.array, mx.array]


def triple(q: Any) -> Quantized | None:
    """A quantized cache's (list or tuple) (packed, scales, biases) as a tuple of fresh
    arrays; None stays None."""
    if q is None:
        return None
    packed, scales, biases = q
    return (fresh(packed), fresh(scales), fresh(biases))


def is_mlx_vlm(obj: Any) -> bool:
    """Whether `obj` is an mlx-vlm object (its class, or a base of it, is defined in mlx_vlm):
    such objects go to the mlx-vlm converters and wrapped model, imported only then."""
    return any(c.__module__.startswith("mlx_vlm.") for c in type(obj).__mro__)


# ---------------------------------------------------------------------------------------
# cache -> state
# ---------------------------------------------------------------------------------------

FromCache = Callable[[Any, int], Any]
CONVERTERS: dict[type, FromCache] = {}  # cache class -> (cache, appended) -> layer state
IN_INPUT_ORDER: set[type] = set()  # classes a tree forward runs as they are (register_from)


def register_from(
    *cache_classes: type, in_input_order: bool = False
) -> Callable[[FromCache], FromCache]:
    """Register the decorated function as the cache -> state converter of `cache_classes`.

    Converters build their states with `kinds.trusted` (no construction check): what they
    return is either checked whole by `from_mlx_lm` or read back from caches the model has
    just written, once per layer of every forward, where the check would cost ~3 us a layer.

    `in_input_order`: the class stores one entry per token, values the model computed, in
    input order, and takes no part in attention masks: a tree forward (`instruments.tree`)
    runs it as it is, and its kind's `kinds.keep_path` keeps the winning path. Caches that
    attend (they build masks, or the model builds masks for them) must not say so."""

    def decorate(fn: FromCache) -> FromCache:
        for cls in cache_classes:
            CONVERTERS[cls] = fn
            if in_input_order:
                IN_INPUT_ORDER.add(cls)
        return fn

    return decorate


# Called with a cache of an unregistered class; True when it registered converters (the
# caches face adds the one that loads mlx-vlm's converters when an mlx-vlm cache arrives).
_LOADERS: list[Callable[[Any], bool]] = []


def add_loader(load: Callable[[Any], bool]) -> None:
    """Let `load(cache)` register converters when a cache of an unregistered class arrives."""
    _LOADERS.append(load)


def converter_of(cache: Any) -> FromCache:
    """The registered cache -> state converter of `cache`'s class (`CONVERTERS`), or why
    there is none."""
    convert = CONVERTERS.get(type(cache))
    if convert is None and any(load(cache) for load in _LOADERS):
        convert = CONVERTERS.get(type(cache))
    if convert is None:
        raise NotSupportedError(
            f"from_mlx_lm: no state for cache class {type(cache).__module__}."
            f"{type(cache).__qualname__}; supported: {supported()}"
        )
    return convert


def from_cache(cache: Any, appended: int = 0) -> Any:
    """One cache object -> a layer state holding fresh arrays, stamped with the tokens its
    last forward `appended` (see `kvstate.kinds.record_forward`)."""
    return converter_of(cache)(cache, appended)


def supported() -> str:
    """The cache classes with a registered converter, by module."""
    by_module: dict[str, list[str]] = {}
    for c in CONVERTERS:
        by_module.setdefault(c.__module__, []).append(c.__qualname__)
    return "; ".join(f"{m}: {', '.join(sorted(names))}" for m, names in sorted(by_module.items()))


# ---------------------------------------------------------------------------------------
# state -> cache
# ---------------------------------------------------------------------------------------


class Names(NamedTuple):
    """How errors name a library: its label, the function that gives its caches, and the
    one that reads them."""

    label: str
    to: str
    reader: str


_LM_NAMES = Names("mlx-lm", "to_mlx_lm", "kvstate.adapters.from_mlx_lm")
_VLM_NAMES = Names("mlx-vlm", "to_mlx_vlm", "from_mlx_vlm")


def names(lib: ModuleType) -> Names:
    """The names of cache module `lib`'s library, for error messages."""
    return _VLM_NAMES if lib.__name__.startswith("mlx_vlm.") else _LM_NAMES


@singledispatch
def to_cache(state: Any, lib: ModuleType = LM) -> Any:
    """One layer state -> a new cache object of `lib` (a library's cache module, mlx-lm's by
    default) holding fresh arrays. Kinds only mlx-vlm has a cache for give mlx-vlm's."""
    raise StateError(
        f"{names(lib).to}: cannot convert a {type(state).__name__}; expected a kvstate layer state"
    )
