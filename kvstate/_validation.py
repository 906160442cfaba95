"""Checking what enters kvstate: whole states (`check`), trees of arrays (`tree_unflatten`),
and the integers the transforms take. The per-kind checks are registered with
`kinds.problems`; the helpers here are what they are written with.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import mlx.core as mx

from ._errors import inconsistent
from ._ints import as_int, as_ints, is_int
from ._tree import (
    State,
    TreeDef,
    check_leaves,
    children,
    host_ints,
    tree_leaves,
    unflatten_unchecked,
)
from .kinds import batch_size_of, kind_named, problems

__all__ = ["as_int", "as_ints", "check", "is_int", "tree_unflatten"]

S = TypeVar("S")


# ---------------------------------------------------------------------------------------
# Whole states
# ---------------------------------------------------------------------------------------


def check(state: S, *, values: bool = True) -> S:
    """Raise `ShapeError` naming every inconsistency of `state` by its path, else return it.

    Checks that arrays agree in batch, heads and capacity, that lengths, counts and indices
    are integers within the buffers, that bookkeeping arrays are integer (B,) vectors, and
    (with `values`, one host sync of the small per-row arrays) that left padding and per-row
    positions lie within the buffers. `load`, `tree_unflatten` and
    `kvstate.adapters.from_mlx_lm` run it. A state's constructor runs the part without
    `values` (on its own level: a composite's parts were checked when they were made); call
    `check` on states you build by hand for the rest. The transforms do not (their outputs
    are consistent by construction, and they stay fast).
    """
    found = problems(state, values)
    if found:
        raise inconsistent(type(state).__name__, found)
    return state


def tree_unflatten(
    treedef: TreeDef, leaves: Sequence[mx.array], *, check_state: bool = True
) -> Any:
    """Inverse of `tree_flatten`. The result is checked like `check(values=False)` (shapes
    and statics, no host sync, so it works inside `mx.compile`); pass `check_state=False` to
    skip even that on a hot path whose arrays you know fit."""
    tree = unflatten_unchecked(treedef, check_leaves(treedef, leaves))
    if check_state:
        _check_tree(tree)
    return tree


def _check_tree(node: Any) -> None:
    if isinstance(node, (tuple, list)):
        for c in node:
            _check_tree(c)
    elif kind_named(type(node).__name__) is type(node):
        check(node, values=False)
    elif isinstance(node, State):  # not a kind (a checkpoint form): check what it holds
        for c in children(node):
            _check_tree(c)


# ---------------------------------------------------------------------------------------
# Helpers the kinds write their `problems` with. Each returns a list of messages.
# ---------------------------------------------------------------------------------------


# The helpers below run on every construction of a state from outside (an adapter's, on
# every forward, until it builds with `kinds.trusted`): each answers the usual case, nothing
# wrong, before it looks for what is.


def static_int(name: str, value: Any, low: int = 0, high: int | None = None) -> list[str]:
    if type(value) is int and low <= value and (high is None or value <= high):
        return []
    if not isinstance(value, int) or isinstance(value, bool):
        return [f"{name}: must be an int; got {value!r} ({type(value).__name__})"]
    if value < low or (high is not None and value > high):
        upper = "" if high is None else f", <= {high}"
        return [f"{name}: {value} is out of range (must be >= {low}{upper})"]
    return []


def static_bool(name: str, value: Any) -> list[str]:
    return [] if isinstance(value, bool) else [f"{name}: must be a bool; got {value!r}"]


def typed_statics(state: Any, *, bools: tuple[str, ...] = (), **lowest: int) -> list[str]:
    """Each static named in `lowest` is an int >= its value there; each in `bools` a bool."""
    found: list[str] = []
    for name, low in lowest.items():
        value = getattr(state, name)
        if type(value) is not int or value < low:
            found += static_int(name, value, low)
    for name in bools:
        if type(getattr(state, name)) is not bool:
            found += static_bool(name, getattr(state, name))
    return found


def array_problems(name: str, a: Any, ndim: int | None = None, floating: bool = False) -> list[str]:
    if not isinstance(a, mx.array):
        return [f"{name}: must be an mx.array or None; got a {type(a).__name__}"]
    if ndim is not None and a.ndim != ndim:
        return [f"{name}: must have {ndim} dims; got shape {tuple(a.shape)}"]
    if floating and not mx.issubdtype(a.dtype, mx.floating):
        return [f"{name}: must be floating point; got {a.dtype}"]
    return []


def kv_pair_problems(keys: Any, values: Any) -> list[str]:
    """Keys and values: both None, or (B, H, T, D) floating arrays agreeing in B, H and T.
    Bool pairs pass too: mlx-vlm's glm5_next keeps each key's validity in a KVCache."""
    if type(keys) is mx.array and type(values) is mx.array:
        k, v = keys.shape, values.shape
        floating = mx.issubdtype(keys.dtype, mx.floating) and mx.issubdtype(
            values.dtype, mx.floating
        )
        if floating and len(k) == 4 and len(v) == 4 and k[:3] == v[:3]:
            return []
    if keys is None and values is None:
        return []
    if keys is None or values is None:
        return [
            f"keys and values must both be arrays or both None; keys is {_kind(keys)}, values is {_kind(values)}"
        ]
    masks = all(isinstance(a, mx.array) and a.dtype == mx.bool_ for a in (keys, values))
    found = array_problems("keys", keys, 4, not masks)
    found += array_problems("values", values, 4, not masks)
    if not found and tuple(keys.shape[:3]) != tuple(values.shape[:3]):
        found.append(
            f"keys {tuple(keys.shape)} and values {tuple(values.shape)} disagree in batch, "
            "heads or capacity (axes 0-2)"
        )
    return found


def rows_problems(name: str, a: Any, batch: int, of: str = "the state") -> list[str]:
    """A per-row bookkeeping array: None, or (batch,) of an integer dtype; `of` names what
    gave the state its `batch` rows (the field whose leading axis it is)."""
    if a is None:
        return []
    if not isinstance(a, mx.array):
        return [f"{name}: must be an mx.array or None; got a {type(a).__name__}"]
    if a.ndim != 1 or not mx.issubdtype(a.dtype, mx.integer):
        return [f"{name}: must be a 1-d integer array; got shape {tuple(a.shape)} {a.dtype}"]
    if a.shape[0] != batch:
        return [f"{name}: has {a.shape[0]} rows, but {of} has {batch}"]
    return []


def previous_rows_problems(state: Any, previous: Any) -> list[str]:
    """A `previous` (the state before the last forward, kept for its rollback) that holds
    arrays has the state's rows (an empty one has no batch axis yet and fits any)."""
    if not tree_leaves(previous):
        return []
    rows, batch = batch_size_of(previous), batch_size_of(state)
    return [] if rows == batch else [f"previous: batch {rows}, but the state has {batch}"]


def ints_within(name: str, a: mx.array | None, low: int, high: int) -> list[str]:
    """Every entry of a (checked) per-row array in [low, high] (reads it: a host sync)."""
    if a is None:
        return []
    bad = [v for v in host_ints(a) if not low <= v <= high]
    return [f"{name}: entries {bad[:8]} are outside [{low}, {high}]"] if bad else []


def _kind(x: Any) -> str:
    return "None" if x is None else f"a {type(x).__name__}"
