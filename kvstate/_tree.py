"""Pytree machinery for frozen attrs states.

A state class is an `attrs.frozen(eq=False)` subclass of `State` whose fields are either
*children* (`mx.array`, `None`, a tuple of children, or another state) or *statics*
(hashable Python scalars marked with `static_field()`). The split is computed once, when the
class is made, so flatten/unflatten never inspect metadata on the hot path.

`mx.eval` silently skips attrs objects and `mx.compile` rejects them, so every boundary with
MLX goes through `tree_flatten` (a list of arrays plus a hashable `TreeDef`).
"""

from __future__ import annotations

from collections.abc import Callable
from operator import attrgetter
from typing import Any, ClassVar, ParamSpec, TypeVar, cast, dataclass_transform

import attrs
import mlx.core as mx

from ._errors import ShapeError, StateError

_STATIC = "kvstate.static"

T = TypeVar("T")
P = ParamSpec("P")


class State:
    """The base class of every state class (see `kvstate.kinds.state_class`)."""

    __slots__ = ()
    __kvstate_children__: ClassVar[tuple[str, ...]] = ()
    __kvstate_statics__: ClassVar[tuple[str, ...]] = ()
    __kvstate_fields__: ClassVar[tuple[str, ...]] = ()
    __kvstate_field_set__: ClassVar[frozenset[str]] = frozenset()
    __kvstate_field_index__: ClassVar[dict[str, int]] = {}


def static_field(**kwargs: Any) -> Any:
    """An attrs field holding a hashable Python scalar (bits, window size, a count...)."""
    metadata = dict(kwargs.pop("metadata", {}) or {})
    metadata[_STATIC] = True
    return attrs.field(metadata=metadata, **kwargs)


@dataclass_transform(frozen_default=True, field_specifiers=(attrs.field, static_field))
def frozen_state(cls: type[T], check: Callable[[Any], None] | None = None) -> type[T]:
    """`attrs.frozen(eq=False)` plus the child/static split, computed once, and the class's
    trusted builder (see `trusted`). `check(state)`, if given, runs at the end of every
    construction through the class itself (`cls(...)`, `attrs.evolve`), never through the
    trusted builder: it raises on fields that disagree (as equinox's `__check_init__`)."""
    if check is not None:
        own = cls.__dict__.get("__attrs_post_init__")
        cls.__attrs_post_init__ = check if own is None else _both(own, check)  # type: ignore[attr-defined]
    made = attrs.frozen(eq=False, repr=False)(cls)
    fields = attrs.fields(made)  # type: ignore[arg-type]
    made.__kvstate_children__ = tuple(f.name for f in fields if not f.metadata.get(_STATIC))  # type: ignore[attr-defined]
    made.__kvstate_statics__ = tuple(f.name for f in fields if f.metadata.get(_STATIC))  # type: ignore[attr-defined]
    made.__kvstate_fields__ = tuple(f.name for f in fields)  # type: ignore[attr-defined]
    made.__kvstate_field_set__ = frozenset(made.__kvstate_fields__)  # type: ignore[attr-defined]
    made.__kvstate_field_index__ = {n: i for i, n in enumerate(made.__kvstate_fields__)}  # type: ignore[attr-defined]
    made.__kvstate_field_values__ = _field_values(made.__kvstate_fields__)  # type: ignore[attr-defined]
    made.__kvstate_trusted__ = _builder(made, fields)  # type: ignore[attr-defined]
    return made


def _both(first: Callable[[Any], None], second: Callable[[Any], None]) -> Callable[[Any], None]:
    def post_init(state: Any) -> None:
        first(state)
        second(state)

    return post_init


def _builder(cls: type, fields: Any) -> Callable[..., Any]:
    """A function with the signature of `cls`'s constructor that makes an instance without
    running its `__attrs_post_init__`: attrs' own init, minus that call (generated once)."""
    scope: dict[str, Any] = {
        "_new": object.__new__,
        "_setter": object.__setattr__.__get__,
        "_cls": cls,
        "_NOTHING": attrs.NOTHING,
    }
    params, lines = [], []
    for i, f in enumerate(fields):
        name = f.alias  # the constructor's parameter name (attrs drops a leading "_")
        if f.kw_only and "*" not in params:
            params.append("*")
        if f.default is attrs.NOTHING:
            params.append(name)
        elif isinstance(f.default, attrs.Factory):  # type: ignore[arg-type]
            if f.default.takes_self:
                raise TypeError(f"{cls.__name__}.{f.name}: a default that takes self")
            scope[f"_factory{i}"] = f.default.factory
            params.append(f"{name}=_NOTHING")
            lines.append(f"    if {name} is _NOTHING: {name} = _factory{i}()")
        else:
            scope[f"_default{i}"] = f.default
            params.append(f"{name}=_default{i}")
    body = "".join(f"    _set({f.name!r}, {f.alias})\n" for f in fields)
    source = (
        f"def build({', '.join(params)}):\n"
        + "".join(line + "\n" for line in lines)
        + "    self = _new(_cls)\n    _set = _setter(self)\n"
        + body
        + "    return self\n"
    )
    exec(compile(source, f"<kvstate trusted builder of {cls.__qualname__}>", "exec"), scope)
    build: Callable[..., Any] = scope["build"]
    build.__qualname__ = f"trusted({cls.__qualname__})"
    init = getattr(cls.__init__, "__annotations__", {})  # type: ignore[misc]
    build.__annotations__ = {**{k: v for k, v in init.items() if k != "return"}, "return": cls}
    return build


def trusted(cls: Callable[P, T]) -> Callable[P, T]:
    """`cls`'s constructor without its construction check, for fields the caller knows
    agree: a transform's result, a state rebuilt from a checked one (as equinox's unflatten
    builds with `object.__new__`). Same signature: `trusted(DenseKV)(keys, values, ...)`.
    Anything built from outside goes through `cls(...)`, which checks, or `kvstate.check`."""
    build: Callable[P, T] = cls.__kvstate_trusted__  # type: ignore[attr-defined]
    return build


def _field_values(names: tuple[str, ...]) -> Callable[[Any], tuple[Any, ...]]:
    """A function reading every field of a state, in order (one C call: `attrgetter`)."""
    if len(names) > 1:
        return attrgetter(*names)
    return lambda state: tuple(getattr(state, n) for n in names)


def replace(state: T, **changes: Any) -> T:
    """A copy of `state` with some fields changed: `attrs.evolve` without its per-call
    introspection (this runs once per layer per decode step) and, like `trusted`, without
    the construction check: the caller keeps the fields in agreement."""
    cls = type(state)
    if not changes.keys() <= cls.__kvstate_field_set__:  # type: ignore[attr-defined]
        names = cls.__kvstate_fields__  # type: ignore[attr-defined]
        raise TypeError(f"{cls.__name__} has no field(s) {sorted(changes.keys() - set(names))}")
    values = list(cls.__kvstate_field_values__(state))  # type: ignore[attr-defined]
    index = cls.__kvstate_field_index__  # type: ignore[attr-defined]
    for name, value in changes.items():
        values[index[name]] = value
    # Trusted: a kind's own rebuild (the caller changes fields so that they still agree).
    made: T = cls.__kvstate_trusted__(*values)  # type: ignore[attr-defined]
    return made


def host_ints(a: mx.array) -> list[int]:
    """A 1-d integer array as Python ints (no new graph node: cheap once `a` is evaluated)."""
    return [int(x) for x in cast(list, a.tolist())]


def is_state(x: object) -> bool:
    """True for instances of state classes."""
    return isinstance(x, State)


def children(state: Any) -> tuple[Any, ...]:
    return tuple(getattr(state, name) for name in type(state).__kvstate_children__)


def statics(state: Any) -> tuple[Any, ...]:
    return tuple(getattr(state, name) for name in type(state).__kvstate_statics__)


def rebuild(cls: type[T], child_values: tuple[Any, ...], static_values: tuple[Any, ...]) -> T:
    """A `cls` from its children and statics, trusted (unchecked): callers that take them
    from outside (`tree_unflatten`, `load`) check the whole result afterwards, so that the
    messages name every problem by its path from the root."""
    names = cls.__kvstate_children__ + cls.__kvstate_statics__  # type: ignore[attr-defined]
    made: T = cls.__kvstate_trusted__(**dict(zip(names, child_values + static_values, strict=True)))  # type: ignore[attr-defined]
    return made


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
    raise StateError(
        f"cannot flatten a {type(node).__name__}: state children must be mx.array, None, "
        "tuples of those, or kvstate states"
    )


def tree_flatten(tree: Any) -> tuple[list[mx.array], TreeDef]:
    """Split a state (or tuple of states) into its arrays and a hashable TreeDef."""
    leaves: list[mx.array] = []
    treedef = _flatten(tree, leaves)
    return leaves, treedef


def count_leaves(treedef: TreeDef) -> int:
    """The number of arrays `treedef` describes; StateError if it is not a TreeDef."""
    if treedef == _LEAF:
        return 1
    if treedef is None:
        return 0
    sequence = isinstance(treedef, tuple) and len(treedef) == 2 and treedef[0] in ("t", "l")
    if sequence and isinstance(treedef[1], tuple):
        return sum(count_leaves(d) for d in treedef[1])
    if isinstance(treedef, tuple) and len(treedef) == 3:
        cls, static_values, child_defs = treedef
        if (
            isinstance(cls, type)
            and issubclass(cls, State)
            and isinstance(static_values, tuple)
            and len(static_values) == len(cls.__kvstate_statics__)
            and isinstance(child_defs, tuple)
            and len(child_defs) == len(cls.__kvstate_children__)
        ):
            return sum(count_leaves(d) for d in child_defs)
    raise StateError(
        f"not a kvstate TreeDef: {treedef!r:.200}; pass the TreeDef that kvstate.tree_flatten "
        "returned"
    )


def _unflatten(treedef: TreeDef, leaves: list[mx.array], at: list[int]) -> Any:
    if treedef == _LEAF:
        leaf = leaves[at[0]]
        at[0] += 1
        return leaf
    if treedef is None:
        return None
    if treedef[0] == "t":
        return tuple(_unflatten(d, leaves, at) for d in treedef[1])
    if treedef[0] == "l":
        return [_unflatten(d, leaves, at) for d in treedef[1]]
    cls, static_values, child_defs = treedef
    return rebuild(cls, tuple(_unflatten(d, leaves, at) for d in child_defs), static_values)


def unflatten_unchecked(treedef: TreeDef, leaves: list[mx.array]) -> Any:
    """`tree_unflatten` without any validation (for trees kvstate flattened itself)."""
    return _unflatten(treedef, leaves, [0])


def check_leaves(treedef: TreeDef, leaves: Any) -> list[mx.array]:
    """`leaves` as a list, after checking they are arrays and as many as `treedef` needs."""
    if not isinstance(leaves, (list, tuple)):
        raise StateError(
            f"tree_unflatten: leaves must be a list or tuple of mx.array; got a "
            f"{type(leaves).__name__}"
        )
    need = count_leaves(treedef)
    if len(leaves) != need:
        raise ShapeError(
            f"tree_unflatten: the TreeDef describes {need} arrays but {len(leaves)} were given; "
            "pass exactly the arrays tree_flatten returned (or as many, in the same order)"
        )
    bad = [i for i, a in enumerate(leaves) if not isinstance(a, mx.array)]
    if bad:
        raise ShapeError(
            f"tree_unflatten: leaves {bad[:8]} are not mx.array (got "
            f"{type(leaves[bad[0]]).__name__}); every leaf must be an mx.array"
        )
    return list(leaves)


def _collect(node: Any, leaves: list[mx.array]) -> None:
    if type(node) is mx.array:
        leaves.append(node)
    elif isinstance(node, (tuple, list)):
        for c in node:
            _collect(c, leaves)
    elif isinstance(node, State):
        for name in type(node).__kvstate_children__:
            _collect(getattr(node, name), leaves)
    elif node is not None:
        raise StateError(
            f"a {type(node).__name__} inside a state: children must be mx.array, None, tuples "
            "of those, or kvstate states (convert mlx-lm caches with "
            "kvstate.adapters.from_mlx_lm)"
        )


def tree_leaves(tree: Any) -> list[mx.array]:
    """The arrays of a state, in `tree_flatten` order (without building a TreeDef)."""
    leaves: list[mx.array] = []
    _collect(tree, leaves)
    return leaves


def tree_map(fn: Callable[..., mx.array], tree: Any, *rest: Any) -> Any:
    """Apply `fn` to every array of a state (or of a nested tuple of arrays, such as
    checkpoints), keeping the structure and the statics. With `rest`, trees of the same
    structure, `fn` gets their arrays side by side: `tree_map(lambda a, b:
    mx.concatenate([a, b]), x, y)` batches the checkpoints of two states. `fn` must keep each
    array's shape where the state depends on it; the result is not re-checked."""
    leaves, treedef = tree_flatten(tree)
    others = [tree_flatten(t) for t in rest]
    for i, (_, other) in enumerate(others):
        if other != treedef:
            raise StateError(
                f"tree_map: tree {i + 1} has another structure or other statics than tree 0; "
                "map over trees of the same kind and shape only"
            )
    columns = zip(leaves, *(o[0] for o in others), strict=True)
    return unflatten_unchecked(treedef, [fn(*arrays) for arrays in columns])


def eval(tree: Any) -> Any:
    """Evaluate every array of a state (plain `mx.eval` skips attrs objects). Returns `tree`."""
    mx.eval(tree_leaves(tree))
    return tree


def nbytes(tree: Any) -> int:
    """Bytes held by the arrays of a state (capacity included, not only the used part), or
    of a tuple of states / arrays (checkpoints). Anything else (None, a list of mlx-lm
    caches) is refused: a size of 0 for it would be silently wrong."""
    if not isinstance(tree, (State, mx.array, tuple)):
        raise StateError(
            f"nbytes: expected a kvstate state; got {'None' if tree is None else 'a ' + type(tree).__name__} "
            "(convert mlx-lm caches with kvstate.adapters.from_mlx_lm(caches))"
        )
    return sum(a.nbytes for a in tree_leaves(tree))
