"""TurboQuantKV: mlx-vlm's TurboQuant-MSE key/value caches as a state.

mlx-vlm's `TurboQuantKVCache` / `BatchTurboQuantKVCache` (integer bits) hold each side as a
`TurboQuantMSEState(norms, indices)`: float16 row norms (B, H, T) and the codebook indices of
the unit row after a seeded rotation, packed `ceil(dim * bits / 32)` uint32 words per row
(B, H, T, W). Its codec is rebuilt from (dim, bits, seed): mlx-vlm seeds keys with `seed` and
values with `seed + 1`. So the state keeps only the arrays and the statics (`key_dim`,
`key_bits`, `value_dim`, `value_bits`, `seed`, `codec`): a rotation matrix or codebook is
never stored, and a loaded state decodes with the codecs its statics rebuild.

Norms are stored with a trailing axis of 1, (B, H, T, 1), so every array has its positions on
axis 2 and a channel axis last, like DenseKV's: commit / merge / filter share DenseKV's code.
Row b holds its tokens at [left_padding[b], length) (None: [0, length)), as
BatchTurboQuantKVCache does (`_idx` == length, `offset` == length - left_padding).

Only codec "mse" exists today. mlx-vlm's fractional bits (a `_SplitCodec` with data-chosen
channel indices) and its Prod / Polar / PolarProd codecs (which its KV caches never build)
are refused by the adapters with a StateError naming the class.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from ._dense import commit_ragged
from ._padded_rows import Layout
from ._padded_rows import register as register_padded_rows
from ._shared import kv_config
from ._tree import State, replace
from ._validation import array_problems, ints_within, rows_problems, static_int, typed_statics
from .kinds import (
    Capabilities,
    batch_size_of,
    commit_rows,
    config_of,
    problems,
    state_class,
    static_field,
    take_rows,
)

TURBOQUANT_BITS = (1, 2, 3, 4, 5, 6, 7, 8)
"""The integer bit widths of a TurboQuant-MSE codebook (mlx-vlm builds 2**bits centroids)."""

TURBOQUANT_CODECS = ("mse",)

_FIELDS = ("key_norms", "key_indices", "value_norms", "value_indices")


def index_width(dim: int, bits: int) -> int:
    """uint32 words per row of `dim` indices of `bits` bits (mlx-vlm's `_packed_width`)."""
    return (dim * bits + 31) // 32


@state_class(Capabilities(trimmable=True, ragged_commit=True, batchable=True))
class TurboQuantKV(State):
    """TurboQuant-MSE keys and values in a capacity buffer; positions [0, length) in use,
    row b from left_padding[b] on (None: from 0).

    key_norms / value_norms: (B, H, capacity, 1) float16; key_indices / value_indices:
    (B, H, capacity, index_width(dim, bits)) uint32. Statics: key_dim / value_dim (head
    dims; 0 while empty), key_bits / value_bits, seed (keys' codec; values' is seed + 1),
    codec ("mse").
    """

    key_norms: mx.array | None = None
    key_indices: mx.array | None = None
    value_norms: mx.array | None = None
    value_indices: mx.array | None = None
    left_padding: mx.array | None = None
    length: int = static_field(default=0)
    appended: int = static_field(default=0)
    key_dim: int = static_field(default=0)
    value_dim: int = static_field(default=0)
    key_bits: int = static_field(default=4)
    value_bits: int = static_field(default=4)
    seed: int = static_field(default=0)
    codec: str = static_field(default="mse")


def arrays_of(state: TurboQuantKV) -> list[mx.array]:
    """The four arrays (key norms, key indices, value norms, value indices) of a filled state."""
    found = [getattr(state, f) for f in _FIELDS]
    assert all(a is not None for a in found)
    return found


def _with_arrays(state: TurboQuantKV, arrays: Sequence[mx.array], **changes: Any) -> Any:
    return replace(state, **dict(zip(_FIELDS, arrays, strict=True)), **changes)


def _is_empty(state: TurboQuantKV) -> bool:
    return state.key_norms is None


_LAYOUT = Layout(arrays_of, _is_empty, _with_arrays)

# ---------------------------------------------------------------------------- checks


@problems.register
def _(state: TurboQuantKV, values: bool) -> list[str]:
    found = typed_statics(
        state, length=0, appended=0, key_dim=0, value_dim=0, key_bits=1, value_bits=1, seed=0
    )
    if found:
        return found
    for side in ("key", "value"):
        if getattr(state, f"{side}_bits") not in TURBOQUANT_BITS:
            found.append(
                f"{side}_bits: {getattr(state, f'{side}_bits')} is not one of "
                f"{list(TURBOQUANT_BITS)}"
            )
    if state.codec not in TURBOQUANT_CODECS:
        found.append(f"codec: {state.codec!r} is not one of {list(TURBOQUANT_CODECS)}")
    present = [getattr(state, f) is not None for f in _FIELDS]
    if any(present) and not all(present):
        return [*found, f"{', '.join(_FIELDS)} must all be arrays or all be None"]
    if found:
        return found
    capacity = 0
    if all(present):
        found += _side_problems(state, "key") + _side_problems(state, "value")
        if found:
            return found
        shapes = {tuple(a.shape[:3]) for a in arrays_of(state)}
        if len(shapes) > 1:
            return [f"the four arrays disagree in batch, heads or capacity: {sorted(shapes)}"]
        capacity = int(arrays_of(state)[0].shape[2])
    found += rows_problems("left_padding", state.left_padding, batch_size_of(state))
    found += static_int("length", state.length, 0, capacity)
    found += static_int("appended", state.appended, 0, state.length)
    if values and not found:
        top = state.length if all(present) else 2**31 - 1
        found += ints_within("left_padding", state.left_padding, 0, top)
    return found


def _side_problems(state: TurboQuantKV, side: str) -> list[str]:
    norms, indices = getattr(state, f"{side}_norms"), getattr(state, f"{side}_indices")
    dim, bits = getattr(state, f"{side}_dim"), getattr(state, f"{side}_bits")
    found = array_problems(f"{side}_norms", norms, 4, floating=True)
    found += array_problems(f"{side}_indices", indices, 4)
    if found:
        return found
    if norms.shape[3] != 1:
        found.append(f"{side}_norms: last axis must be 1 (one norm per row); got {norms.shape}")
    if indices.dtype != mx.uint32:
        found.append(f"{side}_indices: packed indices must be uint32; got {indices.dtype}")
    if dim < 1:
        found.append(f"{side}_dim: a filled state needs its head dim; got {dim}")
    elif indices.shape[3] != index_width(dim, bits):
        found.append(
            f"{side}_indices: {indices.shape[3]} words per row, but {dim} indices of {bits} "
            f"bits pack into {index_width(dim, bits)}"
        )
    return found


# ---------------------------------------------------------------------------- configs


@config_of.register
def _(state: TurboQuantKV) -> dict[str, Any]:
    statics: dict[str, Any] = {
        "codec": state.codec,
        "key_bits": state.key_bits,
        "value_bits": state.value_bits,
        "seed": state.seed,
    }
    if _is_empty(state):
        return kv_config("TurboQuantKV", **statics)
    assert state.key_norms is not None
    heads = int(state.key_norms.shape[1])
    return kv_config(
        "TurboQuantKV", state.key_norms.dtype, heads, state.key_dim, state.value_dim, **statics
    )


# ---------------------------------------------------------------------------- commit


@commit_rows.register
def _(state: TurboQuantKV, counts: tuple[int, ...], checkpoints: Any) -> TurboQuantKV:
    if len(set(counts)) == 1 or _is_empty(state):
        # Like TurboQuantKVCache.trim: rejected positions stay in the buffer, past `length`.
        return replace(state, length=state.length - (state.appended - counts[0]), appended=0)
    arrays, left_padding, length = commit_ragged(
        arrays_of(state), state.left_padding, state.length, state.appended, counts
    )
    return _with_arrays(state, arrays, left_padding=left_padding, length=length, appended=0)


# ---------------------------------------------------------------------------- rows


@take_rows.register
def _(state: TurboQuantKV, rows: tuple[int, ...]) -> TurboQuantKV:
    index = mx.array(rows, mx.int32)
    if _is_empty(state):
        if state.left_padding is not None:
            return replace(state, left_padding=state.left_padding[index])
        if rows == (0,):
            return state
        return replace(state, left_padding=mx.zeros((len(rows),), mx.int32))
    left_padding = state.left_padding[index] if state.left_padding is not None else None
    return _with_arrays(state, [a[index] for a in arrays_of(state)], left_padding=left_padding)


# filter, merge, extract: kvstate._padded_rows (merge pads on the left with zeros, as
# BatchTurboQuantKVCache.extend does; kvstate.merge has already refused mixed configs).
register_padded_rows(TurboQuantKV, _LAYOUT)


__all__ = ["TURBOQUANT_BITS", "TURBOQUANT_CODECS", "TurboQuantKV", "index_width"]
