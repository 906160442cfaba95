"""Pytree machinery for frozen attrs states.

A state class is an `attrs.frozen(eq=False)` class whose fields are either *children*
(`mx.array`, `None`, a tuple of children, or another state) or *statics* (hashable Python
scalars marked with `static_field()`). The split is computed once, when the class is made,
so flatten/unflatten never inspect metadata on the hot path.

`mx.eval` silently skips attrs objects and `mx.compile` rejects them, so every boundary with
MLX goes through `tree_flatten` (a list of arrays plus a hashable `TreeDef`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, TypeVar, cast, dataclass_transform

import attrs
import mlx.core as mx

_STATIC = "kvstate.static"

T = TypeVar("T")


def static_field(**kwargs: Any) -> Any:
    """An attrs field holding a hashable Python scalar (bits, window size, a count...)."""
    metadata = dict(kwargs.pop("metadata", {}) or {})
    metadata[_STATIC] = True
    return attrs.field(metadata=metadata, **kwargs)


@dataclass_transform(frozen_default=True, field_specifiers=(attrs.field, static_field))
def state_class(cls: type[T]) -> type[T]:
    """Make `cls` a frozen state pytree: `attrs.frozen(eq=False)` plus its child/static split."""
    cls = attrs.frozen(eq=False)(cls)
    fields = attrs.fields(cls)  # type: ignore[arg-type]
    cls.__kvstate_children__ = tuple(f.name for f in fields if not f.metadata.get(_STATIC))  # type: ignore[attr-defined]
    cls.__kvstate_statics__ = tuple(f.name for f in fields if f.metadata.get(_STATIC))  # type: ignore[attr-defined]
    cls.__kvstate_fields__ = tuple(f.name for f in fields)  # type: ignore[attr-defined]
    return cls


def replace(state: T, **changes: Any) -> T:
    """A copy of `state` with some fields changed: `attrs.evolve` without its per-call
    introspection (this runs once per layer per decode step)."""
    cls = type(state)
    names = cls.__kvstate_fields__  # type: ignore[attr-defined]
    if not changes.keys() <= set(names):
        raise TypeError(f"{cls.__name__} has no field(s) {sorted(changes.keys() - set(names))}")
    return cls(*[changes[n] if n in changes else getattr(state, n) for n in names])


def host_ints(a: mx.array) -> list[int]:
    """A 1-d integer array as Python ints (no new graph node: cheap once `a` is evaluated)."""
    return [int(x) for x in cast(list, a.tolist())]


def is_state(x: object) -> bool:
    """True for instances of classes made with `state_class`."""
    return hasattr(type(x), "__kvstate_children__")


def children(state: Any) -> tuple[Any, ...]:
    return tuple(getattr(state, name) for name in type(state).__kvstate_children__)


def statics(state: Any) -> tuple[Any, ...]:
    return tuple(getattr(state, name) for name in type(state).__kvstate_statics__)


def rebuild(cls: type[T], child_values: tuple[Any, ...], static_values: tuple[Any, ...]) -> T:
    names = cls.__kvstate_children__ + cls.__kvstate_statics__  # type: ignore[attr-defined]
    return cls(**dict(zip(names, child_values + static_values, strict=True)))


# A TreeDef is a nested, hashable description of everything but the arrays:
#   "a" for an array leaf, None for None, ("t", (defs...)) for a tuple ("l" for a list),
#   (cls, statics, (defs...)) for a state.
TreeDef = Any
_LEAF = "a"


def _flatten(node: Any, leaves: list[mx.array]) -> TreeDef:
    if isinstance(node, mx.array):
        leaves.append(node)
        return _LEAF
    if node is None:
        return None
    if isinstance(node, (tuple, list)):
        tag = "t" if isinstance(node, tuple) else "l"
        return (tag, tuple(_flatten(c, leaves) for c in node))
    if is_state(node):
        return (type(node), statics(node), tuple(_flatten(c, leaves) for c in children(node)))
    raise TypeError(
        f"cannot flatten a {type(node).__name__}: state children must be mx.array, None, "
        "tuples of those, or kvstate states"
    )


def tree_flatten(tree: Any) -> tuple[list[mx.array], TreeDef]:
    """Split a state (or tuple of states) into its arrays and a hashable TreeDef."""
    leaves: list[mx.array] = []
    treedef = _flatten(tree, leaves)
    return leaves, treedef


def _unflatten(treedef: TreeDef, leaves: Iterator[mx.array]) -> Any:
    if treedef == _LEAF:
        return next(leaves)
    if treedef is None:
        return None
    if treedef[0] == "t":
        return tuple(_unflatten(d, leaves) for d in treedef[1])
    if treedef[0] == "l":
        return [_unflatten(d, leaves) for d in treedef[1]]
    cls, static_values, child_defs = treedef
    return rebuild(cls, tuple(_unflatten(d, leaves) for d in child_defs), static_values)


def tree_unflatten(treedef: TreeDef, leaves: list[mx.array] | tuple[mx.array, ...]) -> Any:
    """Inverse of `tree_flatten`."""
    it = iter(leaves)
    tree = _unflatten(treedef, it)
    if next(it, None) is not None:
        raise ValueError("tree_unflatten got more arrays than the TreeDef has leaves")
    return tree


def _collect(node: Any, leaves: list[mx.array]) -> None:
    if type(node) is mx.array:
        leaves.append(node)
    elif isinstance(node, (tuple, list)):
        for c in node:
            _collect(c, leaves)
    elif node is not None:
        for name in type(node).__kvstate_children__:
            _collect(getattr(node, name), leaves)


def tree_leaves(tree: Any) -> list[mx.array]:
    """The arrays of a state, in `tree_flatten` order (without building a TreeDef)."""
    leaves: list[mx.array] = []
    _collect(tree, leaves)
    return leaves


def tree_map(fn: Callable[[mx.array], mx.array], tree: Any) -> Any:
    """Apply `fn` to every array of a state, keeping the structure and the statics."""
    leaves, treedef = tree_flatten(tree)
    return tree_unflatten(treedef, [fn(a) for a in leaves])


def eval(tree: Any) -> Any:
    """Evaluate every array of a state (plain `mx.eval` skips attrs objects). Returns `tree`."""
    mx.eval(tree_leaves(tree))
    return tree


def nbytes(tree: Any) -> int:
    """Bytes held by the arrays of a state (capacity included, not only the used part)."""
    return sum(a.nbytes for a in tree_leaves(tree))
