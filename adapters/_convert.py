"""mlx-lm cache objects <-> kvstate states, O(1): no data is copied.

Neither direction ever hands the same `mx.array` object to both sides: `fresh(a)` is a new
array object over the same buffer, so a model's in-place slice write into a cache object
(`cache.keys[..., i:j, :] = k`) copies on write instead of reaching a state someone holds.

Each kind's adapter module registers its pair of converters: `register_from(CacheClass)`
for cache -> state, `to_cache.register` for state -> cache.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import singledispatch
from typing import Any

import mlx.core as mx

from kvstate import ModelState, StateError, check


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


FromCache = Callable[[Any, int], Any]
CONVERTERS: dict[type, FromCache] = {}  # cache class -> (cache, appended) -> layer state


def register_from(cache_cls: type) -> Callable[[FromCache], FromCache]:
    def decorate(fn: FromCache) -> FromCache:
        CONVERTERS[cache_cls] = fn
        return fn

    return decorate


@singledispatch
def to_cache(state: Any) -> Any:
    """One layer state -> a new mlx-lm cache object holding fresh arrays."""
    raise StateError(
        f"to_mlx_lm: cannot convert a {type(state).__name__}; expected a kvstate layer state"
    )


# Cache classes known to have no exact state, with the reason (filled by the adapters that
# know them); from_cache says it next to the supported list.
REFUSED: dict[type, str] = {}


def from_cache(cache: Any, appended: int = 0) -> Any:
    """One mlx-lm cache object -> a layer state holding fresh arrays, stamped with the
    tokens its last forward `appended` (see `kvstate.kinds.record_forward`)."""
    return converter_of(cache)(cache, appended)


def converter_of(cache: Any) -> FromCache:
    """The registered cache -> state converter of `cache`'s class (`CONVERTERS`), or why
    there is none."""
    convert = CONVERTERS.get(type(cache))
    if convert is None:
        convert = CONVERTERS.get(type(cache)) if _registered_vlm(cache) else None
    if convert is None:
        reason = REFUSED.get(type(cache))
        because = f" ({reason})" if reason else ""
        raise StateError(
            f"from_mlx_lm: no state for cache class {type(cache).__module__}."
            f"{type(cache).__qualname__}{because}; supported: {supported()}"
        )
    return convert


def _registered_vlm(cache: Any) -> bool:
    """Register mlx-vlm's converters the first time one of its caches arrives (mlx_vlm is
    imported only then: kvstate.adapters never imports it on its own)."""
    if not type(cache).__module__.startswith("mlx_vlm."):
        return False
    from . import _vlm_caches  # noqa: F401  (registers on import)

    return True


def supported() -> str:
    """The cache classes with a registered converter, by module."""
    by_module: dict[str, list[str]] = {}
    for c in CONVERTERS:
        by_module.setdefault(c.__module__, []).append(c.__qualname__)
    return "; ".join(f"{m}: {', '.join(sorted(names))}" for m, names in sorted(by_module.items()))


def from_mlx_lm(caches: Any) -> Any:
    """mlx-lm caches -> a state. A list (a model's prompt cache) gives a `ModelState`;
    a single cache object gives that layer's state.

    The state is checked (`kvstate.check`: shapes, counts, and the per-row padding, which
    reads those small arrays back from the device) before it is returned.
    """
    if isinstance(caches, (list, tuple)):
        return check(ModelState(tuple(from_cache(c) for c in caches)))
    return check(from_cache(caches))


def to_mlx_lm(state: Any) -> Any:
    """A state -> new mlx-lm cache objects: a list for a `ModelState`, else one cache."""
    if isinstance(state, ModelState):
        return [to_cache(s) for s in state.layers]
    return to_cache(state)
