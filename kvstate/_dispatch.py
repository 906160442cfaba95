"""`generic`: `functools.singledispatch` with a plain dictionary of resolved implementations.

The generic functions of the kind contract run once per layer per transform, and a decode or
speculative loop calls transforms every step: singledispatch's own cache is a
WeakKeyDictionary, which makes a weak reference on every lookup (~0.7 us a call, a third of
`commit_prefix` on a 16-layer state). State classes live as long as the program, so a plain
dictionary keyed by class serves them; it is emptied whenever an implementation is
registered, so a kind registered late (mlx-vlm's) is found like any other.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import singledispatch, update_wrapper
from typing import Any


def generic(default: Callable[..., Any]) -> Any:
    """A decorator like `functools.singledispatch`, with the same `register`, `dispatch` and
    `registry`."""
    dispatcher = singledispatch(default)
    resolved: dict[type, Callable[..., Any]] = {}

    def dispatch(cls: type) -> Callable[..., Any]:
        impl = resolved.get(cls)
        if impl is None:
            impl = resolved[cls] = dispatcher.dispatch(cls)
        return impl

    def call(first: Any, *args: Any, **kwargs: Any) -> Any:
        impl = resolved.get(first.__class__)
        return (impl or dispatch(first.__class__))(first, *args, **kwargs)

    def register(cls: Any, func: Callable[..., Any] | None = None) -> Any:
        if func is None and isinstance(cls, type):  # @f.register(Cls)
            return lambda f: register(cls, f)
        made = dispatcher.register(cls, func)
        resolved.clear()
        return made

    call.dispatch = dispatch  # type: ignore[attr-defined]
    call.register = register  # type: ignore[attr-defined]
    call.registry = dispatcher.registry  # type: ignore[attr-defined]
    return update_wrapper(call, default)
