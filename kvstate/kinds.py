"""The kind contract: what a kind of state is and what it must provide.

A kind is one module that

1. declares its class with `@state_class(Capabilities(...))`: a subclass of `State` whose
   fields are array children (`mx.array`, None, tuples of those, or other states) or
   `static_field()`s (hashable Python scalars);
2. registers its implementation of every generic function below (`@take_rows.register`,
   ...; `REQUIRED` lists the ones without a default);
3. registers its consistency check (`@problems.register`), run wherever a state enters
   from outside: its shape-only part (`values=False`: shapes, dtypes, statics, no host
   sync) by the class's constructor, all of it by `kvstate.check`, `load`, `tree_unflatten`
   and `from_mlx_lm`;
4. refines `capabilities_of` if its capabilities depend on the instance.

Constructing a state (`DenseKV(keys, values, ...)`) checks it, like equinox's
`__check_init__`: fields that disagree raise `kvstate.ShapeError` naming them. The kind's own
transforms build their results with `trusted(cls)(...)` or `replace`, which skip the check
(their fields agree by construction), so the hot paths pay nothing for it.

Registration is the only list of kinds: save/load, the hypothesis strategies, error messages
and the composite walk all derive theirs from `kinds()`. A composite state (a layer that is
several caches, a whole model) subclasses `Composite`: one tuple field of parts, reached
everywhere through `.parts` and `with_parts`; the transforms map over its parts once, here.

Generic functions get inputs the public transforms already validated (counts in range,
rows in range, configurations that agree). Helpers for writing a kind are exported too:
`replace` (a copy with fields changed, fast, unchecked), `trusted` (a kind's constructor
without the check), `kv_config` / `array_kv_config` (the config of
a KV kind), `config_mismatches`, `shared_appended` (the pending forward a merge keeps),
`uniform_count` (the one count of a kind without left padding), `host_ints`, `as_int`,
`as_ints`, `inherit` (a state made from others carries the consumers' trust they share) and
`checkpoint_problem` (why a recurrent checkpoint does not fit an array).

Kinds that keep one path of a tree forward (tree verification, `kvstate.speculative`)
register `keep_path`, and `gather_path` when the path's entries move inside a buffer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar, TypeVar, dataclass_transform

import attrs

from ._checkpoints import problem as checkpoint_problem
from ._dispatch import generic
from ._errors import CommitError, NotSupportedError, ShapeError, StateError, inconsistent, require
from ._ints import as_int, as_ints
from ._one_sync import one_sync
from ._repr import summary
from ._shared import (
    array_kv_config,
    config_mismatches,
    kv_config,
    shared_appended,
    uniform_count,
)
from ._tree import (
    State,
    frozen_state,
    host_ints,
    replace,
    static_field,
    tree_leaves,
    trusted,
)
from ._trust import inherit, vouch, vouched

__all__ = [
    "Capabilities",
    "Composite",
    "REQUIRED",
    "State",
    "appended_of",
    "array_kv_config",
    "as_int",
    "as_ints",
    "batch_size_of",
    "capabilities_of",
    "checkpoint_problem",
    "commit_rows",
    "config_mismatches",
    "config_of",
    "construction_problems",
    "extend_states",
    "extract_row",
    "filter_rows",
    "fit_config_of",
    "gather_path",
    "host_ints",
    "implements",
    "inherit",
    "keep_path",
    "kind_named",
    "kinds",
    "kv_config",
    "layer_kinds",
    "merge_states",
    "problems",
    "record_forward",
    "replace",
    "shared_appended",
    "state_class",
    "static_field",
    "take_rows",
    "trusted",
    "uniform_count",
    "vouch",
    "vouched",
    "with_parts",
]

T = TypeVar("T")


@attrs.frozen
class Capabilities:
    """What a state can do. Query them with `kvstate.capabilities(state)`.

    trimmable: `commit_prefix` keeps fewer than the appended tokens without checkpoints.
    ragged_commit: `commit_prefix` takes one count per row.
    batchable: `merge` / `extend` take states of different lengths (left padding).
    needs_checkpoints: rolling back needs the checkpoints of a capturing forward.
    can_roll_back: the last forward can be rolled back at all (False for a sliding window
        whose one-token forward overwrote a slot: the state passed to it is the rollback).
    joinable_forwards: k one-token forwards commit as one. Stamped as one forward of their
        k tokens (`appended=k`: the kind records a forward by its `appended` static alone,
        as the default `record_forward` does), they roll back with one `commit_prefix`,
        because each wrote its entries exactly where one k-token forward writes them (a
        dense KV buffer; not a window, whose one-token forwards overwrite ring slots, nor a
        recurrent kind). A draft model's rollback uses it (`ModelDrafter`).
    """

    trimmable: bool = True
    ragged_commit: bool = True
    batchable: bool = True
    needs_checkpoints: bool = False
    can_roll_back: bool = True
    joinable_forwards: bool = False

    def __and__(self, other: Capabilities) -> Capabilities:
        """What a state made of both parts can do."""
        return Capabilities(
            self.trimmable and other.trimmable,
            self.ragged_commit and other.ragged_commit,
            self.batchable and other.batchable,
            self.needs_checkpoints or other.needs_checkpoints,
            self.can_roll_back and other.can_roll_back,
            self.joinable_forwards and other.joinable_forwards,
        )


# The identity of `&`: a composite's capabilities start here and each part narrows them (a
# composite of no parts can do everything, as `all([])` is true).
_EVERYTHING = Capabilities(joinable_forwards=True)


_KINDS: dict[str, type] = {}


@dataclass_transform(frozen_default=True, field_specifiers=(attrs.field, static_field))
def state_class(capabilities: Capabilities = Capabilities()) -> Callable[[type[T]], type[T]]:
    """Declare a kind: a frozen state class with `capabilities`, registered under its name.

    The class must subclass `State` (or `Composite`); names are unique, since files record
    them. The class gets a summary `repr` (kind, batch, shapes, bytes; never the values),
    and its constructor checks what it built (`construction_problems`; `trusted(cls)` is
    the constructor without the check).
    """

    def decorate(cls: type[T]) -> type[T]:
        if not issubclass(cls, State):
            raise TypeError(f"state_class: {cls.__name__} must subclass kvstate.kinds.State")
        if cls.__name__ in _KINDS:
            raise TypeError(f"state_class: a kind named {cls.__name__} is already registered")
        made = frozen_state(cls, check=_check_construction)
        if issubclass(made, Composite):
            fields = made.__kvstate_children__
            if len(fields) != 1:
                raise TypeError(f"a Composite has one child field (its parts); got {fields}")
            made._parts_field = fields[0]
        made.__kvstate_capabilities__ = capabilities  # type: ignore[attr-defined]
        made.__repr__ = _summary  # type: ignore[method-assign]
        _KINDS[made.__name__] = made
        return made

    return decorate


def kinds() -> tuple[type, ...]:
    """Every registered state class, composites included, in registration order."""
    return tuple(_KINDS.values())


def layer_kinds() -> tuple[type, ...]:
    """The registered kinds that are not composites."""
    return tuple(k for k in _KINDS.values() if not issubclass(k, Composite))


def kind_named(name: str) -> type | None:
    return _KINDS.get(name)


def _check_construction(state: Any) -> None:
    """Every constructor's last step: raise `ShapeError` if the fields disagree."""
    found = construction_problems.dispatch(state.__class__)(state)
    if found:
        raise inconsistent(type(state).__name__, found)


def _summary(state: Any) -> str:
    # The repr is handed what it needs of the kind contract: it imports nothing from here.
    return summary(state, batch_size_of, _parts_of)


def _parts_of(state: Any) -> tuple[str, tuple[Any, ...]] | None:
    """(field, parts) of a composite; None for a layer kind."""
    return (state._parts_field, state.parts) if isinstance(state, Composite) else None


class Composite(State):
    """A state made of parts (`ListState`: one layer of several caches; `ModelState`: a
    whole model). Subclasses declare one tuple field; `.parts` reads it under one name."""

    __slots__ = ()
    _parts_field: ClassVar[str]

    @property
    def parts(self) -> tuple[Any, ...]:
        parts: tuple[Any, ...] = getattr(self, self._parts_field)
        return parts


def with_parts(state: Any, parts: tuple[Any, ...]) -> Any:
    """`state` with its parts replaced (statics kept)."""
    return replace(state, **{type(state)._parts_field: parts})


# ---------------------------------------------------------------------------------------
# The generic functions a kind implements.
# ---------------------------------------------------------------------------------------


def _unknown(state: Any) -> StateError:
    names = ", ".join(_KINDS)
    return StateError(
        f"{type(state).__name__} is not a kvstate state; expected one of {names} "
        "(convert mlx-lm caches with kvstate.adapters.from_mlx_lm)"
    )


@generic
def batch_size_of(state: Any) -> int:
    """Rows of a state (1 for an empty single-sequence state)."""
    raise _unknown(state)


@generic
def appended_of(state: Any) -> int:
    """Tokens the last forward appended (default: the state's `appended` static)."""
    if not isinstance(state, State):
        raise _unknown(state)
    return int(state.appended)  # type: ignore[attr-defined]


@generic
def commit_rows(state: Any, counts: tuple[int, ...], checkpoints: Any) -> Any:
    """Keep the first counts[b] tokens of the last forward in row b (0 <= counts[b] <= appended)."""
    raise _unknown(state)


@generic
def take_rows(state: Any, rows: tuple[int, ...]) -> Any:
    """Gather rows (indices already checked), keeping the layout (padding) and any pending
    forward (`appended` and its rollback record)."""
    raise _unknown(state)


@generic
def filter_rows(state: Any, rows: tuple[int, ...]) -> Any:
    """Gather rows, then drop the left padding every kept row shares (mlx-lm's `filter`)."""
    return take_rows(state, rows)


@generic
def merge_states(first: Any, rest: Sequence[Any]) -> Any:
    """Batch `[first, *rest]` (one kind and config, already checked) with left padding. The
    pending forward is kept when every input has the same `appended`, else dropped."""
    raise _unknown(first)


@generic
def extend_states(a: Any, b: Any) -> Any:
    """Rows of `a` then rows of `b`, re-aligned (pending forward: as `merge_states`)."""
    return merge_states(a, [b])


@generic
def extract_row(state: Any, row: int) -> Any:
    """Row `row` as an unpadded single-sequence state, keeping any pending forward."""
    raise _unknown(state)


@generic
def config_of(state: Any) -> dict[str, Any]:
    """What must agree for states to be merged, by name: kind, statics, dtypes, head shapes.
    None (an empty state's unknown dtype or head dims) matches anything."""
    raise _unknown(state)


@generic
def fit_config_of(state: Any) -> dict[str, Any]:
    """What must agree for a state to fit a model's layer (default: `config_of`). A kind
    that can stand in for another (QuantizedKV for DenseKV) answers with that kind's."""
    return config_of(state)


@generic
def problems(state: Any, values: bool) -> list[str]:
    """Every inconsistency of one state, as messages naming its fields (shapes disagree,
    a length past the capacity, a count out of range, a float where ints belong...).
    `values=True` also reads the small per-row bookkeeping arrays (one host sync)."""
    raise _unknown(state)


@generic
def construction_problems(state: Any) -> list[str]:
    """What a constructor of `state`'s class refuses: `problems(state, values=False)` (shapes,
    dtypes and statics; never a host sync). A composite checks only its own level (its parts
    are states, and agree), since each part was checked when it was made. A kind that has
    not registered `problems` (yet) is not checked."""
    impl = problems.dispatch(state.__class__)
    if impl is _no_problems_registered:
        return []
    found: list[str] = impl(state, False)
    return found


@generic
def record_forward(state: Any, before: Any, n: int) -> Any:
    """The state a forward of `n` tokens produced from `before`, stamped with `appended=n`.

    Call it when you run a model on cache objects yourself (`wrap` does it for you); kinds
    that can lose entries during a multi-token forward (windows) keep `before`.
    """
    return state if state.appended == n else replace(state, appended=n)


@generic
def capabilities_of(state: Any) -> Capabilities:
    """What this state can do (default: what its kind declared)."""
    if not isinstance(state, State):
        raise _unknown(state)
    caps: Capabilities = type(state).__kvstate_capabilities__  # type: ignore[attr-defined]
    return caps


@generic
def gather_path(state: Any, positions: tuple[int, ...]) -> Any:
    """Step 1 of keeping one path of a tree forward (see `keep_path`): the entries the last
    forward (a tree forward, batch 1) wrote at input `positions` that must move into place,
    gathered but not evaluated (any pytree of arrays), or None when the kind moves nothing
    (default). The caller evaluates every part's entries in one sync before `keep_path`: a
    gather still pending would make the write into the buffer copy it instead."""
    return None


@generic
def keep_path(state: Any, positions: tuple[int, ...], checkpoints: Any, gathered: Any) -> Any:
    """After a tree forward of T tokens (batch 1) that appended all T (token q attending to
    its ancestors only), keep only the tokens at input `positions`: a root-to-node path, 0
    first, increasing, each < T. The result is the state a linear forward of that path
    gives, with nothing pending. `checkpoints`: the tree forward's, by input position
    (entry t = after position t - 1); `gathered`: what `gather_path` returned, evaluated,
    or None when the path is already in place (`positions` is 0 .. n - 1).

    A kind that does not register it cannot keep a tree path (`NotSupportedError`)."""
    raise NotSupportedError(
        f"tree commit: a {type(state).__name__} layer cannot keep a tree path (kinds that "
        f"can: {', '.join(k.__name__ for k in layer_kinds() if implements(k, keep_path))})"
    )


_no_problems_registered = problems.dispatch(object)

REQUIRED = (
    batch_size_of,
    commit_rows,
    take_rows,
    merge_states,
    extract_row,
    config_of,
    problems,
)
"""The generic functions every kind must register (the others have defaults)."""


def implements(cls: type, fn: Any) -> bool:
    """Whether `cls` has its own (or an inherited non-default) implementation of `fn`."""
    return fn.dispatch(cls) is not fn.dispatch(object)


# ---------------------------------------------------------------------------------------
# Composites map over their parts: once, here, for every Composite subclass.
# ---------------------------------------------------------------------------------------


def _map(state: Composite, fn: Callable[[Any], Any]) -> Any:
    return _agreeing(with_parts(state, tuple(fn(p) for p in state.parts)))


def _agreeing(state: Composite) -> Any:
    """Parts decide one by one whether a row transform kept their pending forward (a window
    may not); if they now disagree, the whole state settles it (commits all of it), since a
    commit must apply one count to every part."""
    counts = {appended_of(p) for p in state.parts}
    if len(counts) <= 1:
        return state
    return with_parts(state, tuple(_settled(p) for p in state.parts))


def _settled(state: Any) -> Any:
    """`state` with its pending forward accepted in full (no checkpoints are needed)."""
    n = appended_of(state)
    return commit_rows(state, (n,) * batch_size_of(state), None) if n else state


# The walks below that run on every commit of a whole model call `fn.dispatch(cls)(part)`
# rather than `fn(part)`: a generic function forwards `*args, **kwargs`, which costs more
# than its lookup (~0.2 us a part).


@batch_size_of.register
def _(state: Composite) -> int:
    impl = batch_size_of.dispatch
    sizes = [impl(p.__class__)(p) for p in state.parts]
    return max(sizes) if sizes else 1


@appended_of.register
def _(state: Composite) -> int:
    impl = appended_of.dispatch
    counts = [impl(p.__class__)(p) for p in state.parts]
    return max(counts) if counts else 0


@commit_rows.register
def _(state: Composite, counts: tuple[int, ...], checkpoints: Any) -> Any:
    parts = state.parts
    per_part = checkpoints if checkpoints is not None else (None,) * len(parts)
    if not isinstance(per_part, (tuple, list)) or len(per_part) != len(parts):
        raise _checkpoints_mismatch(state, per_part)
    for p, c in zip(parts, per_part, strict=True):
        if c is not None:  # the common case (a KV part) skips the call
            refuse_unneeded_checkpoints(p, c)
    impl = commit_rows.dispatch
    pairs = zip(parts, per_part, strict=True)
    with one_sync(parts):  # every layer's moved blocks in one host sync
        return with_parts(state, tuple(impl(p.__class__)(p, counts, c) for p, c in pairs))


def _checkpoints_mismatch(state: Composite, per_part: Any) -> CommitError:
    n = len(state.parts)
    return CommitError(
        f"checkpoints for a {type(state).__name__} of {n} parts must be a tuple of "
        f"{n} entries; got "
        f"{f'{len(per_part)} entries' if isinstance(per_part, (tuple, list)) else repr(per_part)}"
        ". Pass the checkpoints the capturing forward of this same state returned"
    )


def refuse_unneeded_checkpoints(state: Any, checkpoints: Any) -> None:
    """A part that rolls back without checkpoints gets None (what a capturing forward gives)."""
    if checkpoints is None or isinstance(state, Composite):
        return
    require(
        capabilities_of(state).needs_checkpoints,
        CommitError,
        f"checkpoints for a {type(state).__name__} must be None (it rolls back without them); "
        f"got {type(checkpoints).__name__}. Pass the checkpoints a capturing forward returned "
        "for this state, or none",
    )


@take_rows.register
def _(state: Composite, rows: tuple[int, ...]) -> Any:
    return _map(state, lambda p: take_rows(p, rows))


@filter_rows.register
def _(state: Composite, rows: tuple[int, ...]) -> Any:
    return _map(state, lambda p: filter_rows(p, rows))


@merge_states.register
def _(first: Composite, rest: Sequence[Any]) -> Any:
    columns = zip(first.parts, *(r.parts for r in rest), strict=True)
    return _agreeing(with_parts(first, tuple(merge_states(c[0], c[1:]) for c in columns)))


@extend_states.register
def _(a: Composite, b: Any) -> Any:
    pairs = zip(a.parts, b.parts, strict=True)
    return _agreeing(with_parts(a, tuple(extend_states(x, y) for x, y in pairs)))


@extract_row.register
def _(state: Composite, row: int) -> Any:
    return _map(state, lambda p: extract_row(p, row))


@config_of.register
def _(state: Composite) -> dict[str, Any]:
    return {"kind": type(state).__name__, "parts": tuple(config_of(p) for p in state.parts)}


@fit_config_of.register
def _(state: Composite) -> dict[str, Any]:
    return {"kind": type(state).__name__, "parts": tuple(fit_config_of(p) for p in state.parts)}


@record_forward.register
def _(state: Composite, before: Any, n: int) -> Any:
    pairs = zip(state.parts, before.parts, strict=True)
    return with_parts(state, tuple(record_forward(s, b, n) for s, b in pairs))


@capabilities_of.register
def _(state: Composite) -> Capabilities:
    caps = _EVERYTHING
    for p in state.parts:
        caps = caps & capabilities_of(p)
    return caps


@problems.register
def _(state: Composite, values: bool) -> list[str]:
    found = _parts_problems(state)
    if not isinstance(state.parts, tuple):
        return found
    field = type(state)._parts_field
    for i, p in enumerate(state.parts):
        if _is_part(state, p):
            found += [f"{field}[{i}].{m}" for m in problems(p, values)]
    return found or _parts_agree(state)


@construction_problems.register
def _(state: Composite) -> list[str]:
    # Every forward of a wrapped model builds one: the usual case (parts of one batch and
    # one pending forward) is answered in one pass; anything else gets the messages.
    parts, cls = state.parts, state.__class__
    if type(parts) is tuple:
        batch_of, appended_by = batch_size_of.dispatch, appended_of.dispatch
        batches, appended = set(), set()
        for p in parts:
            kind = p.__class__
            if not isinstance(p, State) or isinstance(p, cls):
                break
            batches.add(batch_of(kind)(p))
            appended.add(appended_by(kind)(p))
        else:
            if len(batches) <= 1 and len(appended) <= 1:
                return []
    return _parts_problems(state) or _parts_agree(state)


def _parts_problems(state: Composite) -> list[str]:
    """The parts are a tuple of states, none of the composite's own class."""
    field = type(state)._parts_field
    parts = state.parts
    if not isinstance(parts, tuple):
        return [f"{field}: must be a tuple of states; got a {type(parts).__name__}"]
    return [
        f"{field}[{i}]: a {type(p).__name__} cannot be a part here"
        for i, p in enumerate(parts)
        if not _is_part(state, p)
    ]


def _is_part(state: Composite, part: Any) -> bool:
    return isinstance(part, State) and not isinstance(part, type(state))


def _parts_agree(state: Composite) -> list[str]:
    """Every part has the composite's batch (a part that holds no arrays yet has none) and
    the same pending forward (commit_prefix keeps counts of it in every part)."""
    field = type(state)._parts_field
    batch_of, appended_by = batch_size_of.dispatch, appended_of.dispatch
    batches = [batch_of(p.__class__)(p) for p in state.parts]
    appended = {appended_by(p.__class__)(p) for p in state.parts}
    batch = max(batches, default=1)
    found = [
        f"{field}[{i}]: batch {b}, but other parts have {batch}"
        for i, (p, b) in enumerate(zip(state.parts, batches, strict=True))
        if b != batch and tree_leaves(p)
    ]
    if len(appended) > 1:
        found.append(
            f"{field}: the parts' last forward appended {sorted(appended)} tokens; every part "
            "of one state saw the same forward, so they must agree"
        )
    return found


@gather_path.register
def _(state: Composite, positions: tuple[int, ...]) -> Any:
    return tuple(gather_path(p, positions) for p in state.parts)


@keep_path.register
def _(state: Composite, positions: tuple[int, ...], checkpoints: Any, gathered: Any) -> Any:
    parts = state.parts
    per_part = checkpoints if checkpoints is not None else (None,) * len(parts)
    if not isinstance(per_part, (tuple, list)) or len(per_part) != len(parts):
        raise ShapeError(
            f"tree commit: checkpoints for a {type(state).__name__} of {len(parts)} parts "
            "must be a tuple of as many entries; pass what the tree forward returned"
        )
    moved = gathered if gathered is not None else (None,) * len(parts)
    triples = zip(parts, per_part, moved, strict=True)
    return with_parts(state, tuple(keep_path(p, positions, c, g) for p, c, g in triples))
