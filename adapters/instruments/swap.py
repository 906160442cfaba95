"""Instance surgery for one forward: an object gets a subclass of its own class for the length
of a block, then its class back.

Every instrument works this way (capture's mixers and convolutions, hidden's output
projections, the tree forward's rope modules and masks, the buckets' caches, routed
attention): the subclasses are made once per class and role (`subclass`), and are copies of
the library's own code where they change what a method reads (`reading`). Library classes and
modules are never changed, and other instances of the same classes are not affected.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Hashable, Iterable
from typing import Any

import mlx.nn as nn

# object's `__setattr__`: nn.Module's own is Python code, ~1 us a module, on every verify.
_SET_CLASS = object.__setattr__

_SUBCLASSES: dict[tuple[str, type, Hashable], type | None] = {}


def subclass(
    role: str, cls: type, make: Callable[[type, Any], type | None], key: Hashable = None
) -> Any:
    """The subclass of `cls` an instrument (`role`, plus its own `key`) gives its instances,
    made by `make(cls, key)` the first time it is asked for (None: `cls` needs none)."""
    memo = (role, cls, key)
    try:
        return _SUBCLASSES[memo]
    except KeyError:
        made = _SUBCLASSES[memo] = make(cls, key)
        return made


def with_body(cls: type, body: dict[str, Any]) -> type:
    """A subclass of `cls` of the same name and module, with `body`'s attributes."""
    return type(cls.__name__, (cls,), {"__module__": cls.__module__, **body})


def with_global(fn: types.FunctionType, name: str, value: Any) -> types.FunctionType:
    """A copy of `fn` whose global `name` is `value` (its module is left untouched)."""
    scope = {**fn.__globals__, name: value}
    copy = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__qualname__ = fn.__qualname__
    return copy


def reading(cls: type, name: str, value: Callable[[Any], Any]) -> dict[str, types.FunctionType]:
    """Copies of the methods of `cls` (its own and its bases', up to nn.Module) that call the
    module-level function `name`, each reading `value(the function it read)` under that name
    instead; a method for which `value` gives None is left out."""
    body: dict[str, types.FunctionType] = {}
    for klass in cls.__mro__:
        if klass is nn.Module:
            break
        for attr, fn in vars(klass).items():
            calls = isinstance(fn, types.FunctionType) and name in fn.__code__.co_names
            if calls and attr not in body:
                replacement = value(fn.__globals__.get(name))
                if replacement is not None:
                    body[attr] = with_global(fn, name, replacement)
    return body


class swapped:
    """For the length of a `with` block, give each object of `pairs` (object, class or None)
    that class (None: leave the object as it is); the objects get their own classes back
    afterwards, last first, however the block ends. `with` gives `result`.

    A class rather than a generator-based context manager: it is entered on every verify."""

    __slots__ = ("_pairs", "_result", "_swapped")

    def __init__(self, pairs: Iterable[tuple[Any, type | None]], result: Any = None) -> None:
        self._pairs = pairs
        self._result = result
        self._swapped: list[tuple[Any, type]] = []

    def __enter__(self) -> Any:
        done = self._swapped
        try:
            for obj, cls in self._pairs:
                if cls is not None:
                    own = type(obj)
                    _SET_CLASS(obj, "__class__", cls)
                    done.append((obj, own))
        except BaseException:
            self._restore()
            raise
        return self._result

    def __exit__(self, *exc: object) -> None:
        self._restore()

    def _restore(self) -> None:
        done = self._swapped
        while done:
            obj, own = done.pop()
            _SET_CLASS(obj, "__class__", own)
