"""The one walk over a model's cache objects: every cache in state order, the parts of a
cache list (`CacheList`) in place of the list.

mlx-lm's `CacheList` and `ArraysCache` are known here; a library with copies of them (mlx-vlm)
registers its classes with `register_list` / `register_recurrent` when its converters load.
"""

from __future__ import annotations

from typing import Any

from mlx_lm.models.cache import ArraysCache, CacheList

_LISTS: tuple[type[Any], ...] = (CacheList,)  # classes whose `.caches` are the parts
_RECURRENT: tuple[type[Any], ...] = (ArraysCache,)  # the recurrent caches' classes


def register_list(cls: type) -> None:
    """Walk into caches of `cls` (a cache list class, its parts in `.caches`)."""
    global _LISTS
    if cls not in _LISTS:
        _LISTS = (*_LISTS, cls)


def register_recurrent(cls: type) -> None:
    """Count caches of `cls` as recurrent (an ArraysCache class) in `arrays_caches`."""
    global _RECURRENT
    if cls not in _RECURRENT:
        _RECURRENT = (*_RECURRENT, cls)


def leaves(caches: Any) -> list[Any]:
    """Every cache of `caches` (a model's list of caches, or one cache), in state order, the
    parts of a cache list in its place. Without cache lists that is `caches` itself (a list
    to read, not to change: every forward walks its caches several times)."""
    every = caches if isinstance(caches, list) else [caches]
    lists = _LISTS
    for c in every:
        if isinstance(c, lists):
            break
    else:
        return every
    found: list[Any] = []
    for c in every:
        if isinstance(c, lists):
            found += leaves(list(c.caches))
        else:
            found.append(c)
    return found


def arrays_caches(caches: Any) -> list[Any]:
    """Every recurrent cache (ArraysCache) of `caches`, in state order."""
    recurrent = _RECURRENT
    return [c for c in leaves(caches) if isinstance(c, recurrent)]
