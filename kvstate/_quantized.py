"""QuantizedKV: mlx-lm's QuantizedKVCache, and `quantize` (a DenseKV -> a QuantizedKV).

Like mlx-lm's QuantizedKVCache this kind is unpadded: every row holds `length` tokens at
buffer positions [0, length). So a commit keeps one count for all rows, and a merge batches
states of one length only (mlx-lm has no batched quantized cache to mirror, and a left
padding here would need a masked quantized attention no mlx-lm model computes).

Each of keys / values is an `mx.quantize` triple: packed uint32 (B, H, T, D * bits // 32),
scales and biases (B, H, T, D // group_size).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from ._dense import DenseKV, used
from ._errors import ConfigMismatchError, ShapeError, StateError, require
from ._rotating import RotatingKV
from ._shared import kv_config, shared_appended, uniform_count
from ._tree import State, replace
from ._validation import array_problems, is_int, static_int, typed_statics
from .kinds import (
    Capabilities,
    Composite,
    batch_size_of,
    commit_rows,
    config_of,
    extract_row,
    fit_config_of,
    merge_states,
    problems,
    state_class,
    static_field,
    take_rows,
    with_parts,
)

Quantized = tuple[mx.array, mx.array, mx.array]
"""(packed uint32 (B, H, T, D*bits//32), scales (B, H, T, D//group), biases (same))."""


@state_class(Capabilities(trimmable=True, ragged_commit=False, batchable=False))
class QuantizedKV(State):
    """Quantized keys and values (`mx.quantize` triples) in a capacity buffer; positions
    [0, length) are in use, by every row (no left padding)."""

    keys: Quantized | None = None
    values: Quantized | None = None
    length: int = static_field(default=0)
    group_size: int = static_field(default=64)
    bits: int = static_field(default=8)
    appended: int = static_field(default=0)


BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)


def packed_width(dim: int, bits: int) -> int:
    """uint32 words per row of `dim` values at `bits` bits: what `mx.quantize` emits."""
    return dim * bits // 32


def head_dim(q: Quantized, bits: int) -> int:
    """The unquantized last dimension of a triple."""
    return int(q[0].shape[-1]) * 32 // bits


def used_q(q: Quantized, length: int) -> Quantized:
    """The first `length` positions of every array of a triple."""
    return (used(q[0], length), used(q[1], length), used(q[2], length))


def _map_q(fn: Any, q: Quantized) -> Quantized:
    return (fn(q[0]), fn(q[1]), fn(q[2]))


@problems.register
def _(state: QuantizedKV, values: bool) -> list[str]:
    found = typed_statics(state, length=0, appended=0, bits=0, group_size=1)
    if found:
        return found
    if state.bits not in BITS:
        found.append(f"bits: {state.bits} is not one of {list(BITS)}")
    if (state.keys is None) != (state.values is None):
        return [*found, "keys and values must both be triples or both None"]
    capacity = 0
    if state.keys is not None and state.values is not None:
        triples = {"keys": state.keys, "values": state.values}
        for name, q in triples.items():
            found += _triple_problems(name, q, state)
        if found:
            return found
        shapes = {tuple(a.shape[:3]) for q in triples.values() for a in q}
        if len(shapes) > 1:
            return [f"keys and values disagree in batch, heads or capacity: {sorted(shapes)}"]
        capacity = int(state.keys[0].shape[2])
    found += static_int("length", state.length, 0, capacity)
    found += static_int("appended", state.appended, 0, state.length)
    return found


def _triple_problems(name: str, q: Any, state: QuantizedKV) -> list[str]:
    if not (isinstance(q, tuple) and len(q) == 3):
        return [f"{name}: must be a (packed, scales, biases) tuple; got {type(q).__name__}"]
    found = [m for i, a in enumerate(q) for m in array_problems(f"{name}[{i}]", a, 4)]
    if found:
        return found
    packed, scales, biases = q
    if packed.dtype != mx.uint32:
        found.append(f"{name}[0]: packed data must be uint32; got {packed.dtype}")
    if scales.shape != biases.shape or not mx.issubdtype(scales.dtype, mx.floating):
        found.append(
            f"{name}: scales {scales.shape} and biases {biases.shape} must be float, one shape"
        )
    dim = int(scales.shape[3]) * state.group_size
    if not found and packed.shape[3] != packed_width(dim, state.bits):
        found.append(
            f"{name}[0]: {packed.shape[3]} words per row, but {scales.shape[3]} groups of "
            f"{state.group_size} at {state.bits} bits pack into {packed_width(dim, state.bits)}"
        )
    return found


@fit_config_of.register
def _(state: QuantizedKV) -> dict[str, Any]:
    # A quantized layer stands in for the dense one a model's cache factory makes.
    dense = config_of(state)
    return kv_config("DenseKV", None, dense["kv_heads"], dense["key_dim"], dense["value_dim"])


@batch_size_of.register
def _(state: QuantizedKV) -> int:
    return int(state.keys[0].shape[0]) if state.keys is not None else 1


@config_of.register
def _(state: QuantizedKV) -> dict[str, Any]:
    statics = {"bits": state.bits, "group_size": state.group_size}
    k, v = state.keys, state.values
    if k is None or v is None:
        return kv_config("QuantizedKV", **statics)
    dims = (head_dim(k, state.bits), head_dim(v, state.bits))
    return kv_config("QuantizedKV", k[1].dtype, int(k[0].shape[1]), *dims, **statics)


@commit_rows.register
def _(state: QuantizedKV, counts: tuple[int, ...], checkpoints: Any) -> QuantizedKV:
    accepted = uniform_count(state, counts)
    # Like QuantizedKVCache.trim: the rejected positions stay in the buffer, past `length`.
    return replace(state, length=state.length - (state.appended - accepted), appended=0)


def _no_batch_axis(state: QuantizedKV | Any, what: str) -> StateError:
    return StateError(
        f"{what}: an empty {type(state).__name__} has no arrays, so no batch axis to gather "
        "rows along; run the first forward (prefill) before tiling or selecting rows "
        "(an empty state takes the batch size of its first forward)"
    )


@take_rows.register
def _(state: QuantizedKV, rows: tuple[int, ...]) -> QuantizedKV:
    if state.keys is None or state.values is None:
        if rows == (0,):
            return state
        raise _no_batch_axis(state, "row_select / tile")
    index = mx.array(rows, mx.int32)
    return replace(
        state,
        keys=_map_q(lambda a: a[index], state.keys),
        values=_map_q(lambda a: a[index], state.values),
    )


@merge_states.register
def _(first: QuantizedKV, rest: Sequence[QuantizedKV]) -> QuantizedKV:
    states = [first, *rest]
    lengths = [s.length for s in states]
    require(
        len(set(lengths)) == 1,
        ConfigMismatchError,
        f"merge: QuantizedKV states of lengths {lengths} cannot be batched: a QuantizedKV has "
        "no left padding (mlx-lm's QuantizedKVCache is unpadded), so every row must hold the "
        "same number of tokens; merge quantized states of equal length, or batch the "
        "unquantized DenseKV states (kvstate.merge) and keep the batch unquantized",
    )
    filled = [s for s in states if s.keys is not None and s.values is not None]
    if not filled:
        raise _no_batch_axis(first, "merge")
    like_k, like_v = filled[0].keys, filled[0].values
    assert like_k is not None and like_v is not None
    length = lengths[0]

    def part(s: QuantizedKV, q: Quantized | None, like: Quantized, i: int) -> mx.array:
        if q is None:  # an empty state at length 0: one row of nothing, shaped like the rest
            return mx.zeros((1, like[i].shape[1], 0, like[i].shape[3]), like[i].dtype)
        return used(q[i], length)

    def stacked(which: str, like: Quantized) -> Quantized:
        parts = [
            mx.concatenate([part(s, getattr(s, which), like, i) for s in states]) for i in range(3)
        ]
        return (parts[0], parts[1], parts[2])

    return QuantizedKV(
        stacked("keys", like_k),
        stacked("values", like_v),
        length=length,
        group_size=first.group_size,
        bits=first.bits,
        appended=shared_appended(states),
    )


@extract_row.register
def _(state: QuantizedKV, row: int) -> QuantizedKV:
    if state.keys is None or state.values is None:
        return QuantizedKV(group_size=state.group_size, bits=state.bits)
    length = state.length

    def one(a: mx.array) -> mx.array:
        return mx.contiguous(a[row : row + 1, :, :length])

    return QuantizedKV(
        _map_q(one, state.keys),
        _map_q(one, state.values),
        length=length,
        group_size=state.group_size,
        bits=state.bits,
        appended=state.appended,
    )


def quantize(state: Any, bits: int = 8, group_size: int = 64) -> Any:
    """An unpadded DenseKV as a QuantizedKV, like mlx-lm's `KVCache.to_quantized`.

    keys (B, H, T, D) become (packed (B, H, length, D*bits//32), scales, biases
    (B, H, length, D//group_size)); only the `length` used positions are quantized (the
    capacity past them is not data). `appended` carries over, so a commit still works.

    A ModelState or ListState is mapped over: its DenseKV layers are quantized and every
    other kind is left as it is, like mlx-lm's `maybe_quantize_kv_cache` (which converts
    only the caches that have `to_quantized`), except sliding windows, which mlx-lm cannot
    quantize either and which raise here.
    """
    require(
        is_int(bits) and bits in BITS,
        ConfigMismatchError,
        f"quantize: bits={bits!r} is not supported; use an int in {list(BITS)}",
    )
    require(
        is_int(group_size) and group_size in GROUP_SIZES,
        ConfigMismatchError,
        f"quantize: group_size={group_size!r} is not supported; use an int in {list(GROUP_SIZES)}",
    )
    bits, group_size = int(bits), int(group_size)
    if isinstance(state, DenseKV):
        return _quantize_dense(state, bits, group_size)
    require(
        isinstance(state, Composite),
        StateError,
        f"quantize: expected a DenseKV (or a ModelState / ListState holding some); got a "
        f"{type(state).__name__}",
    )
    return _quantize_layers(state, bits, group_size)


def _quantize_layers(state: Any, bits: int, group_size: int) -> Any:
    if isinstance(state, Composite):
        return with_parts(state, tuple(_quantize_layers(s, bits, group_size) for s in state.parts))
    if isinstance(state, DenseKV):
        return _quantize_dense(state, bits, group_size)
    require(
        not isinstance(state, RotatingKV),
        ConfigMismatchError,
        "quantize: a RotatingKV (sliding window) cannot be quantized (mlx-lm has no "
        "quantized rotating cache either); quantize only the DenseKV layers",
    )
    return state


def _quantize_dense(state: DenseKV, bits: int, group_size: int) -> QuantizedKV:
    require(
        state.left_padding is None,
        ConfigMismatchError,
        "quantize: this DenseKV is a left-padded batch, but a QuantizedKV has no left padding "
        "(like mlx-lm's QuantizedKVCache); extract each row (kvstate.extract) and quantize "
        "rows separately, or quantize single-sequence states before batching equal lengths",
    )
    if state.keys is None or state.values is None:
        return QuantizedKV(
            length=state.length, group_size=group_size, bits=bits, appended=state.appended
        )
    dims = {"keys": int(state.keys.shape[-1]), "values": int(state.values.shape[-1])}
    bad = {name: d for name, d in dims.items() if d % group_size}
    require(
        not bad,
        ShapeError,
        f"quantize: head dims {bad} are not multiples of group_size={group_size}; "
        f"pick a group size in {list(GROUP_SIZES)} that divides every head dim",
    )

    def q(a: mx.array) -> Quantized:
        packed, scales, biases = mx.quantize(
            used(a, state.length), group_size=group_size, bits=bits
        )
        return (packed, scales, biases)

    return QuantizedKV(
        q(state.keys),
        q(state.values),
        length=state.length,
        group_size=group_size,
        bits=bits,
        appended=state.appended,
    )
