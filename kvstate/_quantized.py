"""QuantizedKV: quantized keys and values, each side with its own bits, group size and
zero-channel pad, an optional seeded rotation, and left padding (`kvstate.quantize` makes
one of a DenseKV: `_quantize`).

Each of keys / values is an `mx.quantize` triple of the side's rotated, padded rows (see
`_quant_codec.Codec`): packed uint32 (B, H, T, (D+pad)*bits//32), scales and biases
(B, H, T, (D+pad)//group_size). Like DenseKV, row b holds its tokens at buffer positions
[left_padding[b], length) (left_padding None: every row at [0, length)), so merge / extend
take states of different lengths and commit_prefix takes ragged counts.

With `exact_latest` R > 0 the state also keeps its latest tokens unquantized, in `tail_keys`
/ `tail_values` (B, H, W, D) in the model's dtype: the keys and values of buffer positions
[length - W, length), W <= length, beside their quantized copies. A query at position t reads
key t_k from the tail when t_k > t - R (and the tail holds it), from the quantized buffer
otherwise. The rule depends on positions only, so a prompt prefilled in chunks, a verify
forward and one-by-one decoding read the same values; at R = 32 it takes SmolLM2's K4/V3
Hadamard perplexity from +7.4% over the unquantized cache to +0.24% (BENCHMARKS.md). Forwards
and transforms keep W = min(length, R + appended), so a commit can keep any count (a
right-padded prompt batch may leave fewer: `QuantizedStateCache.finalize`).

The unpadded, unrotated, equal-bits form with no left padding and no tail is exactly mlx-lm's
QuantizedKVCache; every other form runs through kvstate's quantized attention
(`kvstate.quantized_attention`), which the adapters route a model's attention to.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from ._dense import commit_ragged_in_order, used
from ._padded_rows import Layout
from ._padded_rows import register as register_padded_rows
from ._quant_codec import Codec, Quantized, channel_pad, packed_width
from ._rotations import ROTATIONS, rotation_problems
from ._shared import kv_config
from ._tree import State, replace
from ._validation import (
    array_problems,
    ints_within,
    rows_problems,
    static_int,
    typed_statics,
)
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

BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)


@state_class(Capabilities(trimmable=True, ragged_commit=True, batchable=True))
class QuantizedKV(State):
    """Quantized keys and values in a capacity buffer; positions [0, length) are in use, row b
    from left_padding[b] on (None: from 0).

    keys / values: `mx.quantize` triples (B, H, capacity, ...), see the module docstring.
    key_bits / value_bits in (2, 3, 4, 5, 6, 8); key_group_size / value_group_size in
    (32, 64, 128); key_pad / value_pad: zero channels appended to each row to make the head
    dim a whole number of groups (0 while empty: the first forward sets them); rotation in
    ("none", "so4", "hadamard") with `seed`, rebuilt from these statics, applied to the keys
    (and the queries) and the values (and inversely to the attention output).
    exact_latest: how many latest tokens each query reads unquantized, from tail_keys /
    tail_values (None when 0 or empty; see the module docstring).
    """

    keys: Quantized | None = None
    values: Quantized | None = None
    left_padding: mx.array | None = None
    tail_keys: mx.array | None = None
    tail_values: mx.array | None = None
    length: int = static_field(default=0)
    appended: int = static_field(default=0)
    key_bits: int = static_field(default=8)
    value_bits: int = static_field(default=8)
    key_group_size: int = static_field(default=64)
    value_group_size: int = static_field(default=64)
    key_pad: int = static_field(default=0)
    value_pad: int = static_field(default=0)
    rotation: str = static_field(default="none")
    seed: int = static_field(default=0)
    exact_latest: int = static_field(default=0)

    @staticmethod
    def __kvstate_upgrade__(statics: dict[str, Any], children: dict[str, Any]) -> Any:
        """Fields of a file written before keys and values had their own bits (statics
        length, group_size, bits, appended; children keys, values), or before the exact tail
        (no exact_latest, tail_keys, tail_values) -> today's fields."""
        if "exact_latest" in statics or {"tail_keys", "tail_values"} & set(children):
            return None
        statics, children = _before_own_bits(statics, children) or (statics, children)
        return (
            {**statics, "exact_latest": 0},
            {**children, "tail_keys": None, "tail_values": None},
        )


def _before_own_bits(statics: dict[str, Any], children: dict[str, Any]) -> Any:
    if set(statics) != {"length", "group_size", "bits", "appended"}:
        return None
    if set(children) != {"keys", "values"}:
        return None
    bits, group = statics["bits"], statics["group_size"]
    upgraded = {
        **{k: v for k, v in statics.items() if k not in ("bits", "group_size")},
        "key_bits": bits,
        "value_bits": bits,
        "key_group_size": group,
        "value_group_size": group,
        "key_pad": 0,
        "value_pad": 0,
        "rotation": "none",
        "seed": 0,
    }
    return upgraded, {**children, "left_padding": None}


CODEC_FIELDS = (
    "key_bits",
    "value_bits",
    "key_group_size",
    "value_group_size",
    "key_pad",
    "value_pad",
    "rotation",
    "seed",
)

# The least value `typed_statics` lets each integer codec static have (the rest: codec_problems).
CODEC_LOWEST = {
    "key_bits": 0,
    "value_bits": 0,
    "key_group_size": 1,
    "value_group_size": 1,
    "key_pad": 0,
    "value_pad": 0,
    "seed": 0,
}


def codec_of(state: Any) -> dict[str, Any]:
    """The codec statics (CODEC_FIELDS) of a QuantizedKV or QuantizedRotatingKV, by name."""
    return {f: getattr(state, f) for f in CODEC_FIELDS}


def key_codec(state: Any) -> Codec:
    """The key side's codec of a QuantizedKV (or QuantizedRotatingKV)."""
    return Codec(state.key_bits, state.key_group_size, state.key_pad, state.rotation, state.seed)


def value_codec(state: Any) -> Codec:
    """The value side's codec of a QuantizedKV (or QuantizedRotatingKV)."""
    return Codec(
        state.value_bits, state.value_group_size, state.value_pad, state.rotation, state.seed
    )


def is_mlx_lm_form(state: QuantizedKV) -> bool:
    """Whether mlx-lm's QuantizedKVCache (and its attention) can hold this state exactly."""
    return (
        state.left_padding is None
        and state.key_bits == state.value_bits
        and state.key_group_size == state.value_group_size
        and state.key_pad == state.value_pad == 0
        and state.rotation == "none"
        and state.seed == 0
        and state.exact_latest == 0
    )


def used_q(q: Quantized, length: int) -> Quantized:
    """The first `length` positions of every array of a triple."""
    return (used(q[0], length), used(q[1], length), used(q[2], length))


def _map_q(fn: Any, q: Quantized) -> Quantized:
    return (fn(q[0]), fn(q[1]), fn(q[2]))


def _arrays(state: QuantizedKV) -> list[mx.array]:
    assert state.keys is not None and state.values is not None
    return [*state.keys, *state.values]


def _tails(state: QuantizedKV) -> list[mx.array]:
    if state.tail_keys is None or state.tail_values is None:
        return []
    return [state.tail_keys, state.tail_values]


def latest(a: mx.array, n: int) -> mx.array:
    """The last `n` positions (axis 2) of `a`, or all of them when it holds fewer."""
    return a if a.shape[2] <= n else a[..., a.shape[2] - n :, :]


def _with_arrays(state: QuantizedKV, arrays: Sequence[mx.array], **changes: Any) -> QuantizedKV:
    """`state` with the six quantized arrays (keys' triple, values' triple), then the two
    tails where it keeps them, replaced by `arrays` in that order; the tails cut to the
    latest min(length, exact_latest + appended) positions, all that a commit can need."""
    a = list(arrays)
    tails: tuple[Any, Any] = (None, None)
    if len(a) == 8:
        length = changes.get("length", state.length)
        keep = min(length, state.exact_latest + changes.get("appended", state.appended))
        tails = (latest(a[6], keep), latest(a[7], keep))
    return replace(
        state,
        keys=(a[0], a[1], a[2]),
        values=(a[3], a[4], a[5]),
        tail_keys=tails[0],
        tail_values=tails[1],
        **changes,
    )


_LAYOUT = Layout(_arrays, lambda s: s.keys is None or s.values is None, _with_arrays, _tails)

# ---------------------------------------------------------------------------- checks


@problems.register
def _(state: QuantizedKV, values: bool) -> list[str]:
    found = typed_statics(state, bools=(), length=0, appended=0, exact_latest=0, **CODEC_LOWEST)
    if found:
        return found
    found += codec_problems(state)
    if (state.keys is None) != (state.values is None):
        return [*found, "keys and values must both be triples or both None"]
    if found:
        return found
    capacity = 0
    if state.keys is not None and state.values is not None:
        triples = {
            "keys": (state.keys, key_codec(state)),
            "values": (state.values, value_codec(state)),
        }
        for name, (q, codec) in triples.items():
            found += _triple_problems(name, q, codec)
        if found:
            return found
        shapes = {tuple(a.shape[:3]) for q, _ in triples.values() for a in q}
        if len(shapes) > 1:
            return [f"keys and values disagree in batch, heads or capacity: {sorted(shapes)}"]
        capacity = int(state.keys[0].shape[2])
        # The arrays' rows, not batch_size_of's (which reads left_padding first).
        found += rows_problems(
            "left_padding", state.left_padding, int(state.keys[0].shape[0]), "keys"
        )
        found += _tail_problems(state)
    else:
        found += rows_problems("left_padding", state.left_padding, batch_size_of(state))
        if state.tail_keys is not None or state.tail_values is not None:
            found.append("tail_keys / tail_values: an empty state (keys None) has no tail")
    found += static_int("length", state.length, 0, capacity)
    found += static_int("appended", state.appended, 0, state.length)
    if values and not found:
        top = state.length if state.keys is not None else 2**31 - 1
        found += ints_within("left_padding", state.left_padding, 0, top)
    return found


def _tail_problems(state: QuantizedKV) -> list[str]:
    """The exact tail of a filled state: present iff exact_latest > 0, (B, H) as the keys',
    one width W <= length for keys and values, the head dims the codecs decode to."""
    assert state.keys is not None and state.values is not None
    tails = {"tail_keys": state.tail_keys, "tail_values": state.tail_values}
    if state.exact_latest == 0:
        held = [name for name, t in tails.items() if t is not None]
        return (
            [f"{', '.join(held)}: only a state with exact_latest > 0 keeps a tail"] if held else []
        )
    found = [
        m
        for name, t in tails.items()
        for m in (
            [f"{name}: exact_latest={state.exact_latest} needs a tail; got None"]
            if t is None
            else array_problems(name, t, 4, floating=True)
        )
    ]
    if found:
        return found
    assert state.tail_keys is not None and state.tail_values is not None
    dims = (key_codec(state).dim(state.keys), value_codec(state).dim(state.values))
    rows_heads = tuple(state.keys[0].shape[:2])
    for (name, t), dim in zip(
        (("tail_keys", state.tail_keys), ("tail_values", state.tail_values)), dims, strict=True
    ):
        if tuple(t.shape[:2]) != rows_heads or t.shape[3] != dim:
            found.append(
                f"{name}: shape {tuple(t.shape)}; the keys need (batch, heads) {rows_heads} "
                f"and a head dim of {dim}"
            )
    width, other = int(state.tail_keys.shape[2]), int(state.tail_values.shape[2])
    if width != other:
        found.append(f"tail_keys hold {width} positions, tail_values {other}; one width")
    elif width > state.length:
        found.append(f"tail_keys: {width} positions, more than the length {state.length}")
    return found


def codec_problems(state: Any) -> list[str]:
    """The codec statics of a QuantizedKV (or QuantizedRotatingKV), once `typed_statics`
    passed them with CODEC_LOWEST: known bits, group sizes and rotation, pads under a group."""
    found = []
    for side in ("key", "value"):
        bits, group = getattr(state, f"{side}_bits"), getattr(state, f"{side}_group_size")
        if bits not in BITS:
            found.append(f"{side}_bits: {bits} is not one of {list(BITS)}")
        if group not in GROUP_SIZES:
            found.append(f"{side}_group_size: {group} is not one of {list(GROUP_SIZES)}")
        pad = getattr(state, f"{side}_pad")
        if not 0 <= pad < group:
            found.append(f"{side}_pad: {pad} zero channels; a pad is in 0..group_size-1")
    if state.rotation not in ROTATIONS:
        found.append(f"rotation: {state.rotation!r} is not one of {list(ROTATIONS)}")
    return found


def _triple_problems(name: str, q: Any, codec: Codec) -> list[str]:
    if not (isinstance(q, tuple) and len(q) == 3):
        return [f"{name}: must be a (packed, scales, biases) tuple; got {type(q).__name__}"]
    found = [m for i, a in enumerate(q) for m in array_problems(f"{name}[{i}]", a, 4)]
    if found:
        return found
    packed, scales, biases = q
    if packed.dtype != mx.uint32:
        found.append(f"{name}[0]: packed data must be uint32; got {packed.dtype}")
    same = scales.shape == biases.shape and scales.dtype == biases.dtype
    if not same or not mx.issubdtype(scales.dtype, mx.floating):
        found.append(
            f"{name}: scales {scales.shape} {scales.dtype} and biases {biases.shape} "
            f"{biases.dtype} must be float, of one shape and dtype"
        )
    stored = codec.stored_dim(q)
    if not found and packed.shape[3] != packed_width(stored, codec.bits):
        found.append(
            f"{name}[0]: {packed.shape[3]} words per row, but {scales.shape[3]} groups of "
            f"{codec.group_size} at {codec.bits} bits pack into {packed_width(stored, codec.bits)}"
        )
    if not found and codec.pad >= stored:
        found.append(f"{name}: a pad of {codec.pad} channels leaves no head dim of {stored}")
    found += [f"{name}: {m}" for m in rotation_problems(codec.rotation, stored)]
    return found


# ---------------------------------------------------------------------------- configs


@config_of.register
def _(state: QuantizedKV) -> dict[str, Any]:
    statics: dict[str, Any] = {
        "key_bits": state.key_bits,
        "value_bits": state.value_bits,
        "key_group_size": state.key_group_size,
        "value_group_size": state.value_group_size,
        "rotation": state.rotation,
        "seed": state.seed,
        "exact_latest": state.exact_latest,
    }
    k, v = state.keys, state.values
    if k is None or v is None:
        return kv_config("QuantizedKV", **statics)
    dims = (key_codec(state).dim(k), value_codec(state).dim(v))
    return kv_config("QuantizedKV", k[1].dtype, int(k[0].shape[1]), *dims, **statics)


# ---------------------------------------------------------------------------- commit


@commit_rows.register
def _(state: QuantizedKV, counts: tuple[int, ...], checkpoints: Any) -> QuantizedKV:
    tails = _committed_tails(state, counts)
    if len(set(counts)) == 1 or state.keys is None:
        # Like QuantizedKVCache.trim: the rejected positions stay in the buffer, past `length`.
        length = state.length - (state.appended - counts[0])
        if not tails:
            return replace(state, length=length, appended=0)
        return _with_arrays(state, [*_arrays(state), *tails], length=length, appended=0)
    arrays, left_padding, length = commit_ragged_in_order(
        _arrays(state), state.left_padding, state.length, state.appended, counts
    )
    return _with_arrays(
        state, [*arrays, *tails], left_padding=left_padding, length=length, appended=0
    )


def _committed_tails(state: QuantizedKV, counts: tuple[int, ...]) -> list[mx.array]:
    """The tails after keeping `counts` of the appended tokens (`_with_arrays` then cuts them
    to exact_latest).

    A ragged commit shifts each row right by its hole, as the buffers shift. A tail holding
    the whole length loses nothing (a slot whose source lies before the tail is under the
    row's new padding); a shorter one drops the slots some row filled from outside it
    (W >= exact_latest + appended keeps exact_latest after that)."""
    tails = _tails(state)
    if not tails:
        return []
    width = int(tails[0].shape[2])
    kept = max(0, width - state.appended + min(counts))
    if len(set(counts)) == 1:
        return [t[..., :kept, :] for t in tails]
    shifted, _, reach = commit_ragged_in_order(tails, None, width, state.appended, counts)
    start = 0 if width == state.length else max(0, reach - kept)
    return [t[..., start : max(start, reach), :] for t in shifted]


# ---------------------------------------------------------------------------- rows


@take_rows.register
def _(state: QuantizedKV, rows: tuple[int, ...]) -> QuantizedKV:
    index = mx.array(rows, mx.int32)
    if state.keys is None or state.values is None:
        if state.left_padding is not None:
            return replace(state, left_padding=state.left_padding[index])
        if rows == (0,):
            return state
        return replace(state, left_padding=mx.zeros((len(rows),), mx.int32))
    left_padding = state.left_padding[index] if state.left_padding is not None else None
    tails = [t[index] for t in _tails(state)]
    return replace(
        state,
        keys=_map_q(lambda a: a[index], state.keys),
        values=_map_q(lambda a: a[index], state.values),
        left_padding=left_padding,
        tail_keys=tails[0] if tails else None,
        tail_values=tails[1] if tails else None,
    )


# filter, merge, extract: kvstate._padded_rows.
register_padded_rows(QuantizedKV, _LAYOUT)


# ---------------------------------------------------------------------------- pads


def with_pads(state: QuantizedKV, key_dim: int, value_dim: int) -> QuantizedKV:
    """`state` with the zero-channel pads that head dims `key_dim` / `value_dim` need."""
    return replace(
        state,
        key_pad=channel_pad(key_dim, state.key_group_size),
        value_pad=channel_pad(value_dim, state.value_group_size),
    )


__all__ = ["BITS", "GROUP_SIZES", "QuantizedKV", "packed_width"]
