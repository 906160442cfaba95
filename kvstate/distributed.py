"""States of models split over processes with `mx.distributed` (launched by `mlx.launch`).

    import mlx.core as mx
    from kvstate import distributed
    from kvstate.adapters import wrap

    group = mx.distributed.init()
    model.shard(group)                  # tensor parallel (or model.model.pipeline(group))
    m = wrap(model)                     # states say which rank's heads / layers they hold
    logits, state = m(tokens, m.init_state())
    counts = distributed.agree(counts, group)   # raise instead of letting the ranks diverge

Each rank holds the state of its own heads (tensor parallel: every layer, its share of the
heads) or its own layers (pipeline parallel: whole heads, a run of layers), recorded in
`ModelState.placement`. Transforms stay local and pure: every rank applies the same transform
with the same arguments. `gather` joins the ranks' states into the single-process state (for
inspection and tests), `scatter` splits one back; `kvstate.save` records the placement and
`kvstate.load(path, group=group)` refuses another rank's file.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from ._composite import ListState, ModelState
from ._errors import DivergenceError, NotSupportedError, PlacementError, StateError
from ._ints import is_int
from ._placement import Placement, checked_group, placement_of
from ._recurrent import RecurrentState
from ._tree import State, rebuild, statics, trusted
from .kinds import Composite, batch_size_of, with_parts

__all__ = [
    "DivergenceError",
    "Placement",
    "PlacementError",
    "agree",
    "gather",
    "group_of",
    "placement_of",
    "scatter",
    "with_placement",
]

_INT32 = (-(2**31), 2**31 - 1)


# ---------------------------------------------------------------------------- agreement


def agree(values: Sequence[int], group: Any = None, *, what: str = "values") -> list[int]:
    """`values` (ints) as a list, after checking that every rank of `group` passed the same.

    Call it wherever ranks make a decision that must be identical (accepted counts, the rows
    kept, sampled tokens): one all_gather of a 3-int digest, then a host read. On a mismatch
    every rank raises `DivergenceError` naming every rank's values (a second all_gather, on
    the error path only). A group of one process (or `group=None` outside `mlx.launch`)
    costs nothing. Every rank must call it at the same point, like any collective.
    """
    ints = _checked_values(values, what)
    group = checked_group(group, "agree")
    group = group if group is not None else mx.distributed.init()
    size = group.size()
    if size == 1:
        return ints
    outside = [v for v in ints if not _INT32[0] <= v <= _INT32[1]]
    if outside:
        raise NotSupportedError(
            f"agree: values must fit in int32 (the group exchanges them as int32); got "
            f"{outside[:4]}"
        )
    digests = _all_gather_rows(_digest(ints), group)
    if all(d == digests[0] for d in digests):
        return ints
    # Every rank saw the same digests, so every rank takes this path: exchange the values.
    width = max(1, *(d[0] for d in digests))
    padded = _all_gather_rows(ints + [0] * (width - len(ints)), group)
    per_rank = [row[: d[0]] for row, d in zip(padded, digests, strict=True)]
    shown = "; ".join(f"rank {r}: {v}" for r, v in enumerate(per_rank))
    raise DivergenceError(
        f"{what} differ across the {size} ranks ({shown}; this is rank {group.rank()}). "
        "Every rank must make the same decision: give every rank the same prompts, drafter, "
        "sampler and seed. kvstate stops here instead of letting the ranks' states diverge"
    )


def _checked_values(values: Any, what: str) -> list[int]:
    """`agree`'s values: a list, tuple or 1-d integer array of ints (never bools or floats)."""
    if isinstance(values, (mx.array, np.ndarray)) and values.ndim == 1:
        values = values.tolist()
    if isinstance(values, list) and all(type(v) is int for v in values):
        return list(values)  # the decoders' case, without is_int's ~2 us a value
    if not isinstance(values, (list, tuple)):
        raise StateError(f"agree: values ({what}) must be a list of ints; got {values!r:.60}")
    bad = [v for v in values if not is_int(v)]
    if bad:
        raise StateError(f"agree: values ({what}) must be ints; got {bad[:4]!r} in {values!r:.60}")
    return [int(v) for v in values]


def group_of(target: object) -> Any:
    """The distributed group of a wrapped model or any `kvstate.speculative.Target` (its
    optional `group`), or None when it runs in one process: decoders check agreement only
    when this is not None. The one place that probes a target for its group."""
    group = getattr(target, "group", None)
    return group if group is not None and group.size() > 1 else None


def _digest(ints: list[int]) -> list[int]:
    """[count, two int32 words of a hash]: a fixed-size summary every rank can gather."""
    hashed = hashlib.blake2b(np.asarray(ints, np.int64).tobytes(), digest_size=8).digest()
    return [len(ints), *np.frombuffer(hashed, np.int32).tolist()]


def _all_gather_rows(row: list[int], group: Any) -> list[list[int]]:
    gathered = mx.distributed.all_gather(mx.array([row], mx.int32), group=group)
    rows: list[list[int]] = gathered.tolist()  # type: ignore[assignment]
    return rows


# ---------------------------------------------------------------------------- placement


def with_placement(state: ModelState, placement: Placement | None) -> ModelState:
    """`state` recorded as holding `placement`'s part of a model (None: a single process)."""
    if not isinstance(state, ModelState):
        raise PlacementError(
            f"with_placement: state must be a ModelState; got {type(state).__name__}"
        )
    if placement is not None and not isinstance(placement, Placement):
        raise PlacementError(
            f"with_placement: placement must be a Placement or None; got {placement!r:.60} "
            "(Placement.parse(text) reads one from its text)"
        )
    text = "" if placement is None else str(placement)
    if placement is not None and placement.layers is not None:
        start, stop = placement.layers
        if stop - start != len(state.layers):
            raise PlacementError(
                f"with_placement: {text} holds {stop - start} layers; the state has "
                f"{len(state.layers)}"
            )
    return state if state.placement == text else trusted(ModelState)(state.layers, text)


# ---------------------------------------------------------------------------- gather


def gather(states: Sequence[ModelState]) -> ModelState:
    """The single-process state of a model whose ranks hold `states` (one per rank, any
    order; from `kvstate.load` of each rank's file, for instance).

    Tensor parallel: each layer's heads joined along the head axis in rank order (mlx-lm's
    `shard` gives rank r the r-th block of heads; a gated-delta conv window joins per q/k/v
    segment). Pipeline: the ranks' layers in layer order. Raises `PlacementError` for states
    of different shardings, world sizes or batches, or a rank missing or given twice.
    """
    ordered, placed = _by_rank(states)
    if placed[0].scheme == "pipeline":
        runs = sorted(zip(placed, ordered, strict=True), key=lambda p: p[0].layers or (0, 0))
        _check_pipeline_cover([p for p, _ in runs])
        return trusted(ModelState)(tuple(layer for _, s in runs for layer in s.layers))
    counts = {len(s.layers) for s in ordered}
    if len(counts) != 1:
        raise PlacementError(f"gather: the ranks' states have {sorted(counts)} layers; one count")
    return trusted(ModelState)(
        tuple(
            _join([s.layers[i] for s in ordered], f"layers[{i}]")
            for i in range(len(ordered[0].layers))
        )
    )


def scatter(state: ModelState, placements: Sequence[Placement]) -> list[ModelState]:
    """`state` (a single process's) split into one state per placement, the inverse of
    `gather`: `scatter(gather(states), [placement_of(s) for s in states])` gives `states` back.
    """
    if not isinstance(state, ModelState) or state.placement:
        raise PlacementError(
            "scatter: expected a single-process ModelState (placement ''); got "
            f"{getattr(state, 'placement', type(state).__name__)!r}"
        )
    placed = _checked_placements(placements)
    _check_group([(p, None) for p in placed])
    out: list[ModelState] = []
    for p in placed:
        if p.scheme == "pipeline":
            assert p.layers is not None
            if p.total_layers not in (None, len(state.layers)):
                raise PlacementError(
                    f"scatter: {p} is for a model of {p.total_layers} layers; the state has "
                    f"{len(state.layers)}"
                )
            layers = state.layers[p.layers[0] : p.layers[1]]
        else:
            layers = tuple(
                _split(layer, p.rank, p.size, f"layers[{i}]")
                for i, layer in enumerate(state.layers)
            )
        out.append(trusted(ModelState)(layers, str(p)))
    if placed and placed[0].scheme == "pipeline":
        _check_pipeline_cover(placed, len(state.layers))
    return out


def _checked_placements(placements: Any) -> list[Placement]:
    """`scatter`'s placements: a non-empty list of Placement, one per rank."""
    if not isinstance(placements, (list, tuple)) or not placements:
        raise PlacementError(
            f"scatter: placements must be a non-empty list of Placement, one per rank; got "
            f"{placements!r:.60}"
        )
    bad = [p for p in placements if not isinstance(p, Placement)]
    if bad:
        raise PlacementError(
            f"scatter: placements must be Placement objects; got {bad[0]!r:.60} (a "
            f"{type(bad[0]).__name__}): build them with Placement(scheme, rank, size) or "
            "Placement.parse(text)"
        )
    return list(placements)


def _by_rank(states: Sequence[ModelState]) -> tuple[list[ModelState], list[Placement]]:
    if not states:
        raise PlacementError("gather: give the state of every rank; got none")
    pairs = []
    for i, s in enumerate(states):
        if not isinstance(s, ModelState):
            raise PlacementError(f"gather: states[{i}] is a {type(s).__name__}, not a ModelState")
        p = placement_of(s)
        if p is None:
            raise PlacementError(
                f"gather: states[{i}] is a single-process state (no placement); gather joins "
                "the states of the ranks of one distributed model"
            )
        pairs.append((p, s))
    _check_group(pairs)
    batches = {batch_size_of(s) for s in states}
    if len(batches) != 1:
        raise PlacementError(f"gather: the ranks' states have batches {sorted(batches)}")
    pairs.sort(key=lambda p: p[0].rank)
    return [s for _, s in pairs], [p for p, _ in pairs]


def _check_group(pairs: list[tuple[Placement, Any]]) -> None:
    """One sharding, one world size, every rank exactly once."""
    shardings = sorted({(p.scheme, p.size, p.total_layers or 0) for p, _ in pairs})
    if len(shardings) > 1:
        shown = ", ".join(str(p) for p, _ in pairs)
        raise PlacementError(
            f"states of different shardings or world sizes cannot be combined: {shown}. Use "
            "the states of one run, one per rank"
        )
    ranks = sorted(p.rank for p, _ in pairs)
    size = pairs[0][0].size if pairs else 0
    if ranks != list(range(size)):
        raise PlacementError(
            f"expected one state per rank 0..{size - 1} of the {size}-process run; got ranks "
            f"{ranks}"
        )


def _check_pipeline_cover(placed: list[Placement], total: int | None = None) -> None:
    """The ranks' layer runs follow each other from layer 0 with no gap or overlap."""
    runs = sorted(p.layers for p in placed if p.layers is not None)
    at = 0
    for start, stop in runs:
        if start != at:
            raise PlacementError(
                f"the pipeline ranks' layers {runs} leave a gap or overlap at layer {at}"
            )
        at = stop
    whole = total if total is not None else placed[0].total_layers
    if whole is not None and at != whole:
        raise PlacementError(f"the pipeline ranks' layers {runs} cover {at} of {whole} layers")


# ---------------------------------------------------------------------------- heads


def _join(parts: list[Any], where: str) -> Any:
    """One layer's rank states -> the layer's single-process state (heads joined)."""
    _check_alike(parts, where)
    first = parts[0]
    if first is None:
        return None
    if isinstance(first, Composite):
        cols = zip(*(p.parts for p in parts), strict=True)
        joined = tuple(_join(list(c), f"{where}.parts[{i}]") for i, c in enumerate(cols))
        return with_parts(first, joined)
    if isinstance(first, RecurrentState):
        arrays = _join_recurrent([p.arrays for p in parts], where)
        kids = [arrays if n == "arrays" else _same(parts, n, where) for n in _kids(first)]
        return rebuild(type(first), tuple(kids), statics(first))
    kids = []
    for name in _kids(first):
        values = [getattr(p, name) for p in parts]
        if name in ("keys", "values"):
            kids.append(_map_arrays(values, lambda xs: mx.concatenate(xs, axis=1)))
        elif isinstance(values[0], State):
            kids.append(_join(values, f"{where}.{name}"))
        else:
            kids.append(_same(parts, name, where))
    return rebuild(type(first), tuple(kids), statics(first))


def _split(layer: Any, rank: int, size: int, where: str) -> Any:
    """One layer's single-process state -> rank `rank`'s share of its heads."""
    if layer is None:
        return None
    if isinstance(layer, Composite):
        return with_parts(
            layer,
            tuple(_split(p, rank, size, f"{where}.parts[{i}]") for i, p in enumerate(layer.parts)),
        )
    if isinstance(layer, RecurrentState):
        arrays = _split_recurrent(layer.arrays, rank, size, where)
        kids = [arrays if n == "arrays" else getattr(layer, n) for n in _kids(layer)]
        return rebuild(type(layer), tuple(kids), statics(layer))
    kids = []
    for name in _kids(layer):
        value = getattr(layer, name)
        if name in ("keys", "values"):
            kids.append(_map_arrays([value], lambda xs: _share(xs[0], 1, rank, size, where)))
        elif isinstance(value, State):
            kids.append(_split(value, rank, size, f"{where}.{name}"))
        else:
            kids.append(value)
    return rebuild(type(layer), tuple(kids), statics(layer))


def _kids(state: Any) -> tuple[str, ...]:
    names: tuple[str, ...] = type(state).__kvstate_children__
    return names


def _map_arrays(values: list[Any], fn: Any) -> Any:
    """`fn` over the ranks' arrays of one child: an array, None, or a tuple of them
    (QuantizedKV's packed / scales / biases), all with heads on axis 1."""
    first = values[0]
    if first is None:
        return None
    if isinstance(first, tuple):
        joined = [_map_arrays([v[i] for v in values], fn) for i in range(len(first))]
        return type(first)(*joined) if hasattr(first, "_fields") else tuple(joined)
    return fn(values)


def _share(a: mx.array, axis: int, rank: int, size: int, where: str) -> mx.array:
    n = int(a.shape[axis])
    if n % size:
        raise PlacementError(
            f"scatter: {where} has {n} heads (axis {axis}), not divisible by {size} ranks"
        )
    step = n // size
    return mx.take(a, mx.arange(rank * step, (rank + 1) * step), axis=axis)


def _same(parts: list[Any], name: str, where: str) -> Any:
    """A child every rank must hold identically (padding, lengths): rank 0's, checked."""
    values = [getattr(p, name) for p in parts]
    first = values[0]
    for r, v in enumerate(values[1:], start=1):
        if (first is None) != (v is None) or (
            first is not None and not _equal(first, v)  # tuples of arrays too
        ):
            raise PlacementError(
                f"gather: {where}.{name} differs between rank 0 and rank {r}; the ranks of one "
                "model hold the same rows and lengths (were these states from one run?)"
            )
    return first


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, tuple):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(mx.array_equal(a, b))


def _check_alike(parts: list[Any], where: str) -> None:
    kinds = {type(p).__name__ for p in parts}
    if len(kinds) != 1:
        raise PlacementError(f"gather: {where} is of kinds {sorted(kinds)} on different ranks")
    if parts[0] is None or isinstance(parts[0], (ListState, ModelState)):
        return
    if len({statics(p) for p in parts}) != 1:
        shown = "; ".join(f"rank {r}: {statics(p)}" for r, p in enumerate(parts))
        raise PlacementError(f"gather: {where} has different settings on the ranks ({shown})")


# ---------------------------------------------------------------------------- recurrent heads
#
# mlx-lm shards a gated delta net (qwen3_5) by heads: its state (B, Hv, Dv, Dk) splits on
# axis 1, and its conv window (B, K-1, 2*key_dim + value_dim) holds q, k and v channels, each
# split into one block per rank (`shard_inplace(..., segments=[kd, 2 * kd])`).


def _join_recurrent(per_rank: list[tuple[Any, ...]], where: str) -> tuple[Any, ...]:
    out: list[mx.array | None] = []
    for arrays in zip(*per_rank, strict=True):
        if arrays[0] is None:
            out.append(None)
        elif arrays[0].ndim == 4:
            out.append(mx.concatenate(list(arrays), axis=1))
        else:
            pieces = [
                _conv_segments(a, rank_arrays, where)
                for a, rank_arrays in zip(arrays, per_rank, strict=True)
            ]
            out.append(mx.concatenate([p[s] for s in range(3) for p in pieces], axis=-1))
    return tuple(out)


def _split_recurrent(arrays: tuple[Any, ...], rank: int, size: int, where: str) -> tuple[Any, ...]:
    out: list[mx.array | None] = []
    for a in arrays:
        if a is None:
            out.append(None)
        elif a.ndim == 4:
            out.append(_share(a, 1, rank, size, where))
        else:
            segments = _conv_segments(a, arrays, where)
            out.append(mx.concatenate([_share(s, 2, rank, size, where) for s in segments], -1))
    return tuple(out)


def _conv_segments(conv: mx.array, arrays: tuple[Any, ...], where: str) -> list[mx.array]:
    """A gated delta net's conv window split into its q, k and v channels."""
    heads = [a for a in arrays if a is not None and a.ndim == 4]
    width = int(conv.shape[-1])
    value_dim = int(heads[0].shape[1] * heads[0].shape[2]) if len(heads) == 1 else -1
    key_dim = (width - value_dim) // 2
    if conv.ndim != 3 or value_dim < 0 or key_dim <= 0 or 2 * key_dim + value_dim != width:
        raise PlacementError(
            f"{where}: kvstate splits and joins the recurrent state of a gated delta net "
            "(a conv window of q, k, v channels and a (B, H, Dv, Dk) state) by heads; this "
            f"layer's arrays have shapes {[None if a is None else a.shape for a in arrays]}"
        )
    return [
        conv[..., :key_dim],
        conv[..., key_dim : 2 * key_dim],
        conv[..., 2 * key_dim :],
    ]
