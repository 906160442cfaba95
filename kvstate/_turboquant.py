"""TurboQuantKV: mlx-vlm's TurboQuant key/value caches as a state.

mlx-vlm's `TurboQuantKVCache` / `BatchTurboQuantKVCache` hold each side in one of two layouts:

- integer bits: a `TurboQuantMSEState(norms, indices)`: float16 row norms (B, H, T) and the
  codebook indices of the unit row after a seeded rotation, packed `ceil(dim * bits / 32)`
  uint32 words per row (B, H, T, W);
- fractional bits (x.5, mlx-vlm's "Split" layout, `_SplitCodec`): the head's channels are cut
  in two by the data: the `high` channels (the largest mean |x| of the first tensor the cache
  saw) are coded at ceil(bits) with a codec seeded `seed + 97`, the others (`low`) at
  floor(bits) with the side's seed; each part is an MSE state of its own channels.

Codecs are rebuilt from (dim, bits, seed) and, for a split side, its channel indices: mlx-vlm
seeds keys with `seed` and values with `seed + 1`. The state keeps the arrays, the statics
(`key_dim`, `key_bits`, `value_dim`, `value_bits`, `seed`, `codec`) and, for a split side,
the data-chosen high channels as an int32 array (`key_high_channels`, sorted; the low
channels are the rest, in order, as mlx-vlm chooses them), so a reloaded state decodes
identically. A rotation matrix or codebook is never stored.

Norms are stored with a trailing axis of 1, (B, H, T, 1), so every positional array has its
positions on axis 2 and a channel axis last, like DenseKV's: commit / merge / filter share
DenseKV's code. Row b holds its tokens at [left_padding[b], length) (None: [0, length)), as
BatchTurboQuantKVCache does (`_idx` == length, `offset` == length - left_padding).

mlx-vlm's `HybridQuantKVCache` (built by mlx-vlm's generate when a policy mixes schemes: one
side TurboQuant, the other uniform `mx.quantize`) is the same state with `form="hybrid"`: a
"turboquant" side as above, a "uniform" side holding mx.quantize's (packed `indices`,
`scales`, `biases`) at `group_size`; the policy's overall bits in `policy_bits`. Its rows
batch like any others here, but mlx-vlm's Hybrid cache has no left padding: the adapter
gives back rows of one length and refuses padded ones (extract them).

Only codec "mse" exists: mlx-vlm's KV caches build every codec with mode="mse"
(mlx_vlm/turboquant.py `_TurboQuantAttentionMixin._ensure_codecs`,
`TurboQuantKVCache._ensure_codecs`, `_TurboTensorQuantizer._ensure`); its Prod / Polar /
PolarProd codecs never reach a cache, and the adapters refuse them naming the class.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from ._dense import commit_ragged_in_order
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

TURBOQUANT_SPLIT_BITS = (1.5, 2.5, 3.5, 4.5, 5.5, 6.5, 7.5)
"""The fractional bit widths mlx-vlm codes with its Split layout (floor and ceil halves)."""

TURBOQUANT_CODECS = ("mse",)

SCHEMES = ("turboquant", "uniform")
"""A side's scheme: TurboQuant (MSE / Split), or mx.quantize's affine (HybridQuantKVCache)."""

FORMS = ("turboquant", "hybrid")
"""The mlx-vlm cache family a state stands for: (Batch)TurboQuantKVCache or HybridQuantKVCache."""

UNIFORM_BITS = (2, 3, 4, 5, 6, 8)
UNIFORM_GROUP_SIZES = (32, 64, 128)

SPLIT_SEED_OFFSET = 97
"""mlx-vlm seeds a split side's high-channel codec with the side's seed + 97."""

_SIDES = ("key", "value")
_PARTS = ("norms", "indices", "high_norms", "high_indices", "scales", "biases")
_POSITIONAL = tuple(f"{side}_{part}" for side in _SIDES for part in _PARTS)


def index_width(dim: int, bits: int) -> int:
    """uint32 words per row of `dim` indices of `bits` bits (mlx-vlm's `_packed_width`)."""
    return (dim * bits + 31) // 32


def is_split(bits: float) -> bool:
    """Whether `bits` is coded in mlx-vlm's Split layout (a fractional bit width)."""
    return bits != int(bits)


def split_sizes(dim: int, bits: float) -> tuple[int, int]:
    """(low, high) channel counts of a split side (mlx-vlm's `_select_outlier_indices`:
    Python's round, so half-way counts round to even)."""
    lower, upper = math.floor(bits), math.ceil(bits)
    high = round((bits - lower) * dim / (upper - lower))
    high = max(1, min(dim - 1, high))
    return dim - high, high


def low_channels(dim: int, high: Sequence[int]) -> list[int]:
    """The channels a split side codes at floor(bits): every channel not in `high`, in order."""
    chosen = set(high)
    return [c for c in range(dim) if c not in chosen]


@state_class(Capabilities(trimmable=True, ragged_commit=True, batchable=True))
class TurboQuantKV(State):
    """TurboQuant keys and values in a capacity buffer; positions [0, length) in use, row b
    from left_padding[b] on (None: from 0).

    Per side (`key`, `value`): `norms` (B, H, capacity, 1) float16 and `indices` (B, H,
    capacity, index_width(dim, bits)) uint32 for an integer-bit side; a split side (x.5 bits)
    holds its low channels there (floor(bits), width from the low count) and its high
    channels in `high_norms` / `high_indices` (ceil(bits)), with `high_channels` the sorted
    int32 channel numbers coded high. Statics: key_dim / value_dim (head dims; 0 while
    empty), key_bits / value_bits (an int, or x.5 for the Split layout), seed (keys' codec;
    values' is seed + 1; a split side's high codec is its seed + 97), codec ("mse").
    """

    key_norms: mx.array | None = None
    key_indices: mx.array | None = None
    key_high_norms: mx.array | None = None
    key_high_indices: mx.array | None = None
    value_norms: mx.array | None = None
    value_indices: mx.array | None = None
    value_high_norms: mx.array | None = None
    value_high_indices: mx.array | None = None
    key_scales: mx.array | None = None
    key_biases: mx.array | None = None
    value_scales: mx.array | None = None
    value_biases: mx.array | None = None
    key_high_channels: mx.array | None = None
    value_high_channels: mx.array | None = None
    left_padding: mx.array | None = None
    length: int = static_field(default=0)
    appended: int = static_field(default=0)
    key_dim: int = static_field(default=0)
    value_dim: int = static_field(default=0)
    key_bits: float = static_field(default=4.0)
    value_bits: float = static_field(default=4.0)
    seed: int = static_field(default=0)
    codec: str = static_field(default="mse")
    key_scheme: str = static_field(default="turboquant")
    value_scheme: str = static_field(default="turboquant")
    group_size: int = static_field(default=64)
    form: str = static_field(default="turboquant")
    policy_bits: float = static_field(default=0.0)

    @staticmethod
    def __kvstate_upgrade__(statics: dict[str, Any], children: dict[str, Any]) -> Any:
        """A file written before the Split layout and HybridQuantKVCache (children: the four
        MSE arrays and left_padding) -> today's fields (the new ones None / defaults)."""
        old = {"key_norms", "key_indices", "value_norms", "value_indices", "left_padding"}
        if set(children) != old:
            return None
        new = {f: None for f in TurboQuantKV.__kvstate_children__ if f not in children}
        defaults: dict[str, Any] = {"key_scheme": "turboquant", "value_scheme": "turboquant"}
        defaults |= {"group_size": 64, "form": "turboquant", "policy_bits": 0.0}
        return {**defaults, **statics}, {**children, **new}


def arrays_of(state: TurboQuantKV) -> list[mx.array]:
    """The positional arrays of a filled state (positions on axis 2), in a fixed order: per
    side norms, indices, then a split side's high norms and high indices."""
    return [a for a in (getattr(state, f) for f in _POSITIONAL) if a is not None]


def _with_arrays(state: TurboQuantKV, arrays: Sequence[mx.array], **changes: Any) -> Any:
    names = [f for f in _POSITIONAL if getattr(state, f) is not None]
    return replace(state, **dict(zip(names, arrays, strict=True)), **changes)


def _is_empty(state: TurboQuantKV) -> bool:
    return state.key_indices is None  # every scheme has indices


_LAYOUT = Layout(arrays_of, _is_empty, _with_arrays)


def high_channels(state: TurboQuantKV, side: str) -> tuple[int, ...] | None:
    """A filled split side's high channels as ints (None for an integer side or while empty)."""
    channels = getattr(state, f"{side}_high_channels")
    return None if channels is None else tuple(np.array(channels).tolist())


def scheme_of(state: TurboQuantKV, side: str) -> str:
    scheme: str = getattr(state, f"{side}_scheme")
    return scheme


# ---------------------------------------------------------------------------- checks


@problems.register
def _(state: TurboQuantKV, values: bool) -> list[str]:
    found = typed_statics(state, length=0, appended=0, key_dim=0, value_dim=0, seed=0)
    found += _form_problems(state)
    for side in _SIDES:
        found += _bits_problems(side, getattr(state, f"{side}_bits"), scheme_of(state, side))
    if found:
        return found
    if state.codec not in TURBOQUANT_CODECS:
        found.append(f"codec: {state.codec!r} is not one of {list(TURBOQUANT_CODECS)}")
    expected = {f: _expects(state, f) for f in (*_POSITIONAL, *_channel_fields())}
    present = {f: getattr(state, f) is not None for f in expected}
    filled = present["key_indices"]
    for f, wanted in expected.items():
        if filled and present[f] != wanted:
            found.append(f"{f}: must be {'an array' if wanted else 'None'} for {_why(state, f)}")
        elif not filled and present[f]:
            found.append(f"{f}: must be None while key_indices is None (an empty state)")
    if found:
        return found
    capacity = 0
    if filled:
        for side in _SIDES:
            found += _side_problems(state, side, values)
        if found:
            return found
        positional = {f: getattr(state, f) for f in _POSITIONAL if getattr(state, f) is not None}
        if len({tuple(a.shape[:3]) for a in positional.values()}) > 1:
            shapes = ", ".join(f"{f} {tuple(a.shape)}" for f, a in positional.items())
            return [f"the arrays disagree in batch, heads or capacity (axes 0-2): {shapes}"]
        indices = positional["key_indices"]  # every scheme has indices
        capacity = int(indices.shape[2])
        # The arrays' rows, not batch_size_of's (which reads left_padding first).
        found += rows_problems("left_padding", state.left_padding, indices.shape[0], "key_indices")
    else:
        found += rows_problems("left_padding", state.left_padding, batch_size_of(state))
    found += static_int("length", state.length, 0, capacity)
    found += static_int("appended", state.appended, 0, state.length)
    if values and not found:
        top = state.length if filled else 2**31 - 1
        found += ints_within("left_padding", state.left_padding, 0, top)
    return found


def _channel_fields() -> tuple[str, ...]:
    return tuple(f"{side}_high_channels" for side in _SIDES)


def _expects(state: TurboQuantKV, field: str) -> bool:
    """Whether a filled state holds `field`: a uniform side its indices, scales and biases; a
    TurboQuant side its norms and indices, and a split side its high parts and channels."""
    side, part = field.split("_", 1)
    if scheme_of(state, side) == "uniform":
        return part in ("indices", "scales", "biases")
    if part in ("scales", "biases"):
        return False
    return "high" not in part or is_split(getattr(state, f"{side}_bits"))


def _why(state: TurboQuantKV, field: str) -> str:
    side = field.split("_", 1)[0]
    return (
        f"a filled state with {side}_scheme={scheme_of(state, side)!r}, "
        f"{side}_bits={getattr(state, f'{side}_bits')}"
    )


def _form_problems(state: TurboQuantKV) -> list[str]:
    found = static_int("group_size", state.group_size, 1)
    if state.form not in FORMS:
        found.append(f"form: {state.form!r} is not one of {list(FORMS)}")
    for side in _SIDES:
        scheme = scheme_of(state, side)
        if scheme not in SCHEMES:
            found.append(f"{side}_scheme: {scheme!r} is not one of {list(SCHEMES)}")
        elif scheme == "uniform" and state.form != "hybrid":
            found.append(
                f"{side}_scheme: 'uniform' sides exist only in form 'hybrid' "
                "(HybridQuantKVCache); a TurboQuantKVCache codes both sides with TurboQuant"
            )
        elif scheme == "uniform" and state.group_size not in UNIFORM_GROUP_SIZES:
            found.append(
                f"group_size: {state.group_size} is not one of {list(UNIFORM_GROUP_SIZES)} "
                "(mx.quantize's groups)"
            )
    bits = state.policy_bits
    if isinstance(bits, bool) or not isinstance(bits, (int, float)) or bits < 0:
        found.append(f"policy_bits: must be a float >= 0; got {bits!r}")
    return found


def _bits_problems(side: str, bits: Any, scheme: str) -> list[str]:
    if isinstance(bits, bool) or not isinstance(bits, (int, float)):
        return [f"{side}_bits: must be an int or a float; got {bits!r} ({type(bits).__name__})"]
    if scheme == "uniform":
        if bits not in UNIFORM_BITS or is_split(bits):
            return [f"{side}_bits: {bits} is not one of {list(UNIFORM_BITS)} (mx.quantize)"]
        return []
    if bits not in TURBOQUANT_BITS and bits not in TURBOQUANT_SPLIT_BITS:
        return [
            f"{side}_bits: {bits} is not one of {list(TURBOQUANT_BITS)} (MSE) or "
            f"{list(TURBOQUANT_SPLIT_BITS)} (Split)"
        ]
    return []


def _side_problems(state: TurboQuantKV, side: str, values: bool) -> list[str]:
    dim, bits = getattr(state, f"{side}_dim"), getattr(state, f"{side}_bits")
    if dim < 1:
        return [f"{side}_dim: a filled state needs its head dim; got {dim}"]
    if scheme_of(state, side) == "uniform":
        return _uniform_problems(state, side, dim, int(bits))
    if not is_split(bits):
        return _part_problems(state, side, "", dim, int(bits))
    if dim < 2:
        return [f"{side}_dim: a split side ({bits} bits) needs at least 2 channels; got {dim}"]
    low, high = split_sizes(dim, bits)
    found = _part_problems(state, side, "", low, math.floor(bits))
    found += _part_problems(state, side, "high_", high, math.ceil(bits))
    name = f"{side}_high_channels"
    channels = getattr(state, name)
    found += array_problems(name, channels, 1)
    if found:
        return found
    if channels.dtype != mx.int32 or channels.shape[0] != high:
        found.append(
            f"{name}: a {dim}-channel side at {bits} bits codes {high} channels high (int32); "
            f"got shape {tuple(channels.shape)} {channels.dtype}"
        )
    elif values:
        chosen = np.array(channels).tolist()
        if chosen != sorted(set(chosen)) or not all(0 <= c < dim for c in chosen):
            found.append(f"{name}: must be distinct channels in [0, {dim}), sorted; got {chosen}")
    return found


def _uniform_problems(state: TurboQuantKV, side: str, dim: int, bits: int) -> list[str]:
    """mx.quantize's triple: packed (.., dim * bits / 32) uint32, scales and biases (..,
    dim / group_size) of one floating dtype."""
    group = state.group_size
    if dim % group or (dim * bits) % 32:
        return [f"{side}_dim: {dim} channels do not pack in groups of {group} at {bits} bits"]
    indices = getattr(state, f"{side}_indices")
    found = array_problems(f"{side}_indices", indices, 4)
    for part in ("scales", "biases"):
        found += array_problems(f"{side}_{part}", getattr(state, f"{side}_{part}"), 4, True)
    if found:
        return found
    scales, biases = getattr(state, f"{side}_scales"), getattr(state, f"{side}_biases")
    if indices.dtype != mx.uint32 or indices.shape[3] != dim * bits // 32:
        found.append(
            f"{side}_indices: {dim} channels at {bits} bits pack into {dim * bits // 32} "
            f"uint32 words; got {indices.shape[3]} {indices.dtype}"
        )
    for name, a in ((f"{side}_scales", scales), (f"{side}_biases", biases)):
        if a.shape[3] != dim // group or a.dtype != scales.dtype:
            found.append(
                f"{name}: one per group of {group} ({dim // group}) in the scales' dtype; "
                f"got {a.shape[3]} {a.dtype}"
            )
    return found


def _part_problems(state: TurboQuantKV, side: str, part: str, dim: int, bits: int) -> list[str]:
    norms = getattr(state, f"{side}_{part}norms")
    indices = getattr(state, f"{side}_{part}indices")
    found = array_problems(f"{side}_{part}norms", norms, 4, floating=True)
    found += array_problems(f"{side}_{part}indices", indices, 4)
    if found:
        return found
    if norms.shape[3] != 1:
        found.append(
            f"{side}_{part}norms: last axis must be 1 (one norm per row); got {norms.shape}"
        )
    if indices.dtype != mx.uint32:
        found.append(f"{side}_{part}indices: packed indices must be uint32; got {indices.dtype}")
    elif indices.shape[3] != index_width(dim, bits):
        found.append(
            f"{side}_{part}indices: {indices.shape[3]} words per row, but {dim} indices of "
            f"{bits} bits pack into {index_width(dim, bits)}"
        )
    return found


# ---------------------------------------------------------------------------- configs


@config_of.register
def _(state: TurboQuantKV) -> dict[str, Any]:
    # The high channels are part of the codec: rows coded with other channels (another
    # cache's first tensor) cannot share a batch. None while empty (matches anything).
    statics: dict[str, Any] = {
        "codec": state.codec,
        "key_bits": state.key_bits,
        "value_bits": state.value_bits,
        "seed": state.seed,
        "key_high_channels": high_channels(state, "key"),
        "value_high_channels": high_channels(state, "value"),
        "form": state.form,
        "key_scheme": state.key_scheme,
        "value_scheme": state.value_scheme,
        # mx.quantize's groups matter only to a uniform side (None: matches anything)
        "group_size": state.group_size
        if "uniform" in (state.key_scheme, state.value_scheme)
        else None,
        "policy_bits": state.policy_bits,
    }
    if _is_empty(state):
        return kv_config("TurboQuantKV", **statics)
    first = arrays_of(state)[0]
    dtype = next(a.dtype for a in arrays_of(state) if mx.issubdtype(a.dtype, mx.floating))
    return kv_config(
        "TurboQuantKV", dtype, int(first.shape[1]), state.key_dim, state.value_dim, **statics
    )


# ---------------------------------------------------------------------------- commit


@commit_rows.register
def _(state: TurboQuantKV, counts: tuple[int, ...], checkpoints: Any) -> TurboQuantKV:
    if len(set(counts)) == 1 or _is_empty(state):
        # Like TurboQuantKVCache.trim: rejected positions stay in the buffer, past `length`.
        return replace(state, length=state.length - (state.appended - counts[0]), appended=0)
    arrays, left_padding, length = commit_ragged_in_order(
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
# BatchTurboQuantKVCache.extend does; kvstate.merge has already refused mixed configs, the
# high channels included, so the channels of the first filled state are every row's).
register_padded_rows(TurboQuantKV, _LAYOUT)


__all__ = [
    "FORMS",
    "SCHEMES",
    "SPLIT_SEED_OFFSET",
    "TURBOQUANT_BITS",
    "TURBOQUANT_CODECS",
    "TURBOQUANT_SPLIT_BITS",
    "UNIFORM_BITS",
    "UNIFORM_GROUP_SIZES",
    "TurboQuantKV",
    "high_channels",
    "index_width",
    "is_split",
    "low_channels",
    "scheme_of",
    "split_sizes",
]
