"""The public transforms. Each validates its input once, here, then dispatches on the state's
kind to the implementation registered by that kind's module (`_dense`, `_rotating`,
`_recurrent`). Composite states (`ListState`, `ModelState`) map over their children here.

Every function is pure: it returns a new state and never changes its inputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import singledispatch
from typing import Any, TypeVar

import mlx.core as mx
import numpy as np

from ._errors import CommitError, ConfigMismatchError, RowError, StateError, check
from ._states import ListState, ModelState
from ._tree import is_state, replace

S = TypeVar("S")

# ---------------------------------------------------------------------------------------
# Per-kind implementations (registered by the kind modules). Inputs are already validated.
# ---------------------------------------------------------------------------------------


@singledispatch
def batch_size_of(state: Any) -> int:
    """Rows of a state (1 for an empty single-sequence state)."""
    raise _unknown(state)


@singledispatch
def appended_of(state: Any) -> int:
    """Tokens the last forward appended (every layer state has an `appended` field)."""
    if not is_state(state):
        raise _unknown(state)
    return int(state.appended)


@singledispatch
def commit_rows(state: Any, counts: tuple[int, ...], checkpoints: Any) -> Any:
    """Keep the first counts[b] tokens of the last forward in row b (0 <= counts[b] <= appended)."""
    raise _unknown(state)


@singledispatch
def take_rows(state: Any, rows: tuple[int, ...]) -> Any:
    """Gather rows (indices already checked), keeping the layout (padding) as it is."""
    raise _unknown(state)


@singledispatch
def filter_rows(state: Any, rows: tuple[int, ...]) -> Any:
    """Gather rows, then drop the left padding every kept row shares (mlx-lm's `filter`)."""
    return take_rows(state, rows)


@singledispatch
def merge_states(states: Any, rest: Sequence[Any]) -> Any:
    """Batch `[states, *rest]` (all of one kind and config, already checked) with left padding."""
    raise _unknown(states)


@singledispatch
def extend_states(a: Any, b: Any) -> Any:
    """Rows of `a` then rows of `b`, re-aligned."""
    return merge_states(a, [b])


@singledispatch
def extract_row(state: Any, row: int) -> Any:
    """Row `row` as an unpadded single-sequence state."""
    raise _unknown(state)


@singledispatch
def config_of(state: Any) -> dict[str, Any]:
    """What must agree for states to be merged, by name: kind, statics, dtypes, head shapes.
    None (an empty state's unknown dtype or head dims) matches anything."""
    raise _unknown(state)


def kv_config(
    kind: str,
    dtype: Any = None,
    kv_heads: int | None = None,
    key_dim: int | None = None,
    value_dim: int | None = None,
    **statics: Any,
) -> dict[str, Any]:
    """The `config_of` of a KV kind."""
    return {
        "kind": kind,
        **statics,
        "dtype": dtype and str(dtype),
        "kv_heads": kv_heads,
        "key_dim": key_dim,
        "value_dim": value_dim,
    }


def array_kv_config(kind: str, keys: Any, values: Any, **statics: Any) -> dict[str, Any]:
    """`kv_config` read off (B, H, T, D) key and value buffers (None while empty)."""
    if keys is None or values is None:
        return kv_config(kind, **statics)
    return kv_config(
        kind, keys.dtype, int(keys.shape[1]), int(keys.shape[3]), int(values.shape[3]), **statics
    )


def _unknown(state: Any) -> StateError:
    return StateError(
        f"{type(state).__name__} is not a kvstate state; expected one of DenseKV, QuantizedKV, "
        "RotatingKV, ChunkedKV, RecurrentState, ListState, ModelState "
        "(convert mlx-lm caches with kvstate.adapters.from_mlx_lm)"
    )


# Composite states map over their children.
Composite = ListState | ModelState


def _parts(state: Composite) -> tuple[Any, ...]:
    return state.states if isinstance(state, ListState) else state.layers


def _with_parts(state: Composite, parts: tuple[Any, ...]) -> Any:
    return ListState(parts) if isinstance(state, ListState) else ModelState(parts)


@batch_size_of.register(ListState)
@batch_size_of.register(ModelState)
def _(state: Composite) -> int:
    sizes = {batch_size_of(p) for p in _parts(state)}
    return max(sizes) if sizes else 1


@appended_of.register(ListState)
@appended_of.register(ModelState)
def _(state: Composite) -> int:
    counts = [appended_of(p) for p in _parts(state)]
    return max(counts) if counts else 0


@commit_rows.register(ListState)
@commit_rows.register(ModelState)
def _(state: Composite, counts: tuple[int, ...], checkpoints: Any) -> Any:
    parts = _parts(state)
    per_part = checkpoints if checkpoints is not None else (None,) * len(parts)
    check(
        len(per_part) == len(parts),
        CommitError,
        f"checkpoints have {len(per_part)} entries for a state of {len(parts)} parts; "
        "pass the checkpoints the capturing forward of this same state returned",
    )
    return _with_parts(
        state, tuple(commit_rows(p, counts, c) for p, c in zip(parts, per_part, strict=True))
    )


@take_rows.register(ListState)
@take_rows.register(ModelState)
def _(state: Composite, rows: tuple[int, ...]) -> Any:
    return _with_parts(state, tuple(take_rows(p, rows) for p in _parts(state)))


@filter_rows.register(ListState)
@filter_rows.register(ModelState)
def _(state: Composite, rows: tuple[int, ...]) -> Any:
    return _with_parts(state, tuple(filter_rows(p, rows) for p in _parts(state)))


@merge_states.register(ListState)
@merge_states.register(ModelState)
def _(state: Composite, rest: Sequence[Any]) -> Any:
    columns = zip(_parts(state), *(_parts(r) for r in rest), strict=True)
    return _with_parts(state, tuple(merge_states(c[0], c[1:]) for c in columns))


@extend_states.register(ListState)
@extend_states.register(ModelState)
def _(a: Composite, b: Any) -> Any:
    return _with_parts(
        a, tuple(extend_states(x, y) for x, y in zip(_parts(a), _parts(b), strict=True))
    )


@extract_row.register(ListState)
@extract_row.register(ModelState)
def _(state: Composite, row: int) -> Any:
    return _with_parts(state, tuple(extract_row(p, row) for p in _parts(state)))


@config_of.register(ListState)
@config_of.register(ModelState)
def _(state: Composite) -> dict[str, Any]:
    return {"kind": type(state).__name__, "parts": tuple(config_of(p) for p in _parts(state))}


def uniform_count(state: Any, counts: tuple[int, ...]) -> int:
    """The single count of a kind with one length for all rows (no left padding)."""
    check(
        len(set(counts)) == 1,
        CommitError,
        f"{type(state).__name__} holds one length for all rows (like its mlx-lm cache, it has "
        f"no left padding), so it cannot keep ragged counts {list(counts)}; commit one count "
        f"for every row (e.g. {min(counts)}, then re-feed the rows' extra accepted tokens), "
        "or extract the rows (kvstate.extract) and commit each on its own",
    )
    return counts[0]


# ---------------------------------------------------------------------------------------
# Validation shared by the public functions.
# ---------------------------------------------------------------------------------------


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _as_ints(value: Any, what: str) -> list[Any]:
    if isinstance(value, (mx.array, np.ndarray)):
        value = value.tolist()
    return [value] if _is_int(value) or not isinstance(value, (list, tuple)) else list(value)


def _counts(state: Any, accepted: Any) -> tuple[int, ...]:
    """`accepted` (an int, or one count per row) as one checked count per row."""
    batch = batch_size_of(state)
    appended = appended_of(state)
    scalar = _is_int(accepted) or (isinstance(accepted, mx.array) and accepted.ndim == 0)
    values = _as_ints(accepted, "accepted")
    if scalar:
        values = values * batch
    bad = [v for v in values if not _is_int(v)]
    check(
        not bad,
        CommitError,
        f"accepted must be an int or one int per row; got {accepted!r} "
        f"(non-integers: {bad!r}); pass e.g. commit_prefix(state, 3) or [3, 1, 0]",
    )
    check(
        len(values) == batch,
        CommitError,
        f"accepted has {len(values)} counts for a state of {batch} rows; "
        "pass one count per row or a single int",
    )
    negative = [v for v in values if v < 0]
    check(not negative, CommitError, f"accepted counts must be >= 0; got {values}")
    too_many = [v for v in values if v > appended]
    check(
        not too_many,
        CommitError,
        f"accepted {values} exceeds the {appended} tokens the last forward appended; "
        f"each count must be in [0, {appended}]",
    )
    return tuple(int(v) for v in values)


def _rows(state: Any, rows: Any, what: str) -> tuple[int, ...]:
    batch = batch_size_of(state)
    values = _as_ints(rows, what)
    bad = [v for v in values if not _is_int(v)]
    check(not bad, RowError, f"{what}: rows must be ints; got {rows!r}")
    check(len(values) > 0, RowError, f"{what}: no rows given; pass at least one row index")
    out = [v for v in values if not -batch <= v < batch]
    check(
        not out,
        RowError,
        f"{what}: rows {out} out of range for a state of {batch} rows "
        f"(valid: 0..{batch - 1} or negative from the end)",
    )
    return tuple(int(v) % batch for v in values)


def _compatible(a: Any, b: Any) -> bool:
    """Configs agree; None (an empty state's unknown dtype or head dims) matches anything."""
    return not _mismatches(a, b)


def _mismatches(a: Any, b: Any, path: str = "") -> list[str]:
    """Every disagreement between two configs, named by its path (e.g. `parts[3].key_dim`)."""
    if a is None or b is None:
        return []
    if isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys():
        return [m for k in a for m in _mismatches(a[k], b[k], f"{path}.{k}" if path else k)]
    if isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b):
        pairs = enumerate(zip(a, b, strict=True))
        return [m for i, (x, y) in pairs for m in _mismatches(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path or 'config'}: {_short(a)} != {_short(b)}"]


def _short(config: Any) -> str:
    return f"{len(config)} parts" if isinstance(config, tuple) else repr(config)


def _same_config(states: Sequence[Any], what: str) -> None:
    first = config_of(states[0])
    for i, s in enumerate(states[1:], start=1):
        other = config_of(s)
        if other != first and not _compatible(first, other):  # `!=` first: the common case
            raise ConfigMismatchError(
                f"{what}: state {i} does not match state 0: "
                f"{'; '.join(_mismatches(first, other))}; "
                "only states of the same kind and configuration (bits, group size, window, "
                "dtype, head dims) can be batched together"
            )


# ---------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------


def snapshot(state: S) -> S:
    """A value that later calls can never change.

    States are immutable and adapters never hand their arrays to a model, so the state
    itself is already that value: O(1) time, zero bytes. Use it to say what you mean.
    """
    return state


def batch_size(state: Any) -> int:
    """Number of rows (the leading axis of every array)."""
    return batch_size_of(state)


def commit_prefix(state: S, accepted: Any, checkpoints: Any = None) -> S:
    """After a forward of K tokens, keep only the first `accepted` of them.

    `accepted`: an int, or one count per row (ragged). KV kinds trim; sliding windows
    restore what the forward overwrote; recurrent kinds need `checkpoints`, the value a
    capturing forward (`wrapped(tokens, state, capture=True)`) returned.
    """
    return commit_rows(state, _counts(state, accepted), checkpoints)


def tile(state: S, n: int) -> S:
    """Repeat every row `n` times along the batch axis: row b becomes rows b*n .. b*n+n-1."""
    check(_is_int(n) and n >= 1, RowError, f"tile: n must be an int >= 1; got {n!r}")
    rows = tuple(b for b in range(batch_size_of(state)) for _ in range(int(n)))
    return take_rows(state, rows)


def row_select(state: S, rows: Any) -> S:
    """Keep the given rows, in the given order (an int keeps batch 1). Padding is kept."""
    return take_rows(state, _rows(state, rows, "row_select"))


def filter(state: S, rows: Any) -> S:
    """Keep the given rows of a batched state and drop the left padding they all share."""
    return filter_rows(state, _rows(state, rows, "filter"))


def merge(states: Sequence[S]) -> S:
    """Batch several states (of one kind and config), aligning them with left padding."""
    states = list(states)
    check(len(states) > 0, StateError, "merge: got no states; pass a non-empty list")
    _same_config(states, "merge")
    return merge_states(states[0], states[1:])


def extend(a: S, b: S) -> S:
    """The rows of `a` followed by the rows of `b`, re-aligned to one left padding."""
    _same_config([a, b], "extend")
    return extend_states(a, b)


def extract(state: S, row: int) -> S:
    """Row `row` as an unpadded single-sequence state (batch 1)."""
    check(_is_int(row), RowError, f"extract: row must be an int; got {row!r}")
    (checked,) = _rows(state, row, "extract")
    mx.eval(_left_paddings(state))  # one host sync for every layer's padding, not one each
    return extract_row(state, checked)


def _left_paddings(state: Any) -> list[mx.array]:
    if isinstance(state, (ListState, ModelState)):
        return [lp for part in _parts(state) for lp in _left_paddings(part)]
    padding = getattr(state, "left_padding", None)
    return [] if padding is None else [padding]


@singledispatch
def record_forward(state: Any, before: Any, n: int) -> Any:
    """The state a forward of `n` tokens produced from `before`, stamped with `appended=n`.

    Kinds that can lose entries during a multi-token forward (windows) keep `before`.
    """
    return replace(state, appended=n)


@record_forward.register(ListState)
@record_forward.register(ModelState)
def _(state: Composite, before: Any, n: int) -> Any:
    return _with_parts(
        state,
        tuple(record_forward(s, b, n) for s, b in zip(_parts(state), _parts(before), strict=True)),
    )
