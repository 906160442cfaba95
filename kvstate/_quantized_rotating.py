"""QuantizedRotatingKV: a sliding window (RotatingKV) whose keys and values are quantized the
way a QuantizedKV's are (each side its own bits, group size and zero-channel pad, an optional
seeded rotation), for the layers mlx-lm cannot quantize (`RotatingKVCache.to_quantized`
raises).

Quantization is per position: one buffer slot (B, H, slot, :) becomes one row of each
`mx.quantize` array (packed, scales, biases). Every ring operation of RotatingKV (write a
slot, unroll, trim, left-pad, gather rows, the exact rollback from `previous`) moves whole
slots along axis 2 and never reads their contents, so it commutes with quantizing them: a
QuantizedRotatingKV is three RotatingKV "lanes" that share one window's bookkeeping (left
padding, per-row offsets, offset / index / rotated / appended) and hold the packed words,
the scales and the biases of keys and values. Every transform runs RotatingKV's own code
on the three lanes and joins the results, so the window keeps RotatingKV's semantics, mlx-lm's
layouts and its exact rollback across a wrap, and `dequantized(T(q)) == T(dequantized(q))`
for every transform T (the property tests check it).

Attention reads the packed window through kvstate's `quantized_attention` (the adapters'
`QuantizedRotatingCache`): no dequantized copy of the window is made.

With `exact_latest` R > 0 (QuantizedKV's exact tail, for windows) the state also holds
`exact`: a dense RotatingKV of max_size R, the raw keys and values of the latest R tokens. A
query reads those from it and the rest of its window quantized (the rule of QuantizedKV's
tail: key t raw iff t > t_q - R). RotatingKV's own code keeps that ring (multi-token
forwards, the exact rollback, rows), so every transform runs on it beside the three lanes.

Like QuantizedKV it keeps no tree path (no `keep_path`: tree forwards refuse quantized caches); verify linearly
or as a batch of paths.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import mlx.core as mx

from ._errors import CommitError, ConfigMismatchError, NotSupportedError, require
from ._quant_codec import Quantized, channel_pad
from ._quantized import (
    CODEC_FIELDS,
    CODEC_LOWEST,
    _triple_problems,
    codec_of,
    codec_problems,
    key_codec,
    value_codec,
)
from ._rotating import RotatingKV, _can_roll_back
from ._shared import kv_config
from ._tree import State, replace, trusted
from ._validation import typed_statics
from .kinds import (
    Capabilities,
    batch_size_of,
    capabilities_of,
    commit_rows,
    config_of,
    extend_states,
    extract_row,
    fit_config_of,
    merge_states,
    problems,
    record_forward,
    state_class,
    static_field,
    take_rows,
)


@state_class(Capabilities(trimmable=True, ragged_commit=True, batchable=True))
class QuantizedRotatingKV(State):
    """A sliding window of quantized keys and values: RotatingKV's fields, with keys / values
    `mx.quantize` triples (packed uint32 (B, H, L, (D+pad)*bits//32), scales and biases
    (B, H, L, (D+pad)//group_size)) in the window's slots, and QuantizedKV's codec statics.

    Window fields (left_padding, offsets, previous, max_size, keep, offset, index, rotated,
    appended) mean what they mean for RotatingKV; codec fields (key_bits, value_bits,
    key_group_size, value_group_size, key_pad, value_pad, rotation, seed) what they mean for
    QuantizedKV. `previous` (the window before the last multi-token forward) shares the
    state's codec.
    """

    keys: Quantized | None = None
    values: Quantized | None = None
    left_padding: mx.array | None = None
    offsets: mx.array | None = None
    previous: QuantizedRotatingKV | None = None
    exact: RotatingKV | None = None
    max_size: int = static_field(default=1)
    keep: int = static_field(default=0)
    offset: int = static_field(default=0)
    index: int = static_field(default=0)
    rotated: bool = static_field(default=False)
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
        """A file written before the exact ring (no exact_latest, exact) -> today's fields."""
        if "exact_latest" in statics or "exact" in children:
            return None
        return {**statics, "exact_latest": 0}, {**children, "exact": None}


W = TypeVar("W", RotatingKV, QuantizedRotatingKV)

# ---------------------------------------------------------------------------- lanes


def _window(cls: type[W], w: Any, keys: Any, values: Any, previous: Any, **codec: Any) -> W:
    """A `cls` (RotatingKV or QuantizedRotatingKV) of `keys`, `values`, `previous` and the
    window bookkeeping of `w` (either kind; arrays shared, not copied), with `codec`'s
    statics: the one place the two kinds' shared fields are copied across."""
    return trusted(cls)(
        keys,
        values,
        w.left_padding,
        w.offsets,
        previous,
        max_size=w.max_size,
        keep=w.keep,
        offset=w.offset,
        index=w.index,
        rotated=w.rotated,
        appended=w.appended,
        **codec,
    )


def lane(state: QuantizedRotatingKV, i: int) -> RotatingKV:
    """Lane i (0 packed words, 1 scales, 2 biases) as a RotatingKV: keys[i], values[i] and
    the window's bookkeeping (arrays shared, not copied)."""
    prev = state.previous
    return _window(
        RotatingKV,
        state,
        None if state.keys is None else state.keys[i],
        None if state.values is None else state.values[i],
        None if prev is None else lane(prev, i),
    )


def lanes(state: QuantizedRotatingKV) -> tuple[RotatingKV, RotatingKV, RotatingKV]:
    return lane(state, 0), lane(state, 1), lane(state, 2)


def joined(codec: dict[str, Any], windows: Sequence[RotatingKV]) -> QuantizedRotatingKV:
    """Three lanes (one RotatingKV result per lane, of one bookkeeping) as one state."""
    w = windows[0]
    keys: Quantized | None = None
    values: Quantized | None = None
    if w.keys is not None:
        keys = (windows[0].keys, windows[1].keys, windows[2].keys)  # type: ignore[assignment]
        values = (windows[0].values, windows[1].values, windows[2].values)  # type: ignore[assignment]
    previous = None
    if w.previous is not None:
        previous = joined(codec, [x.previous for x in windows])  # type: ignore[misc]
    return _window(QuantizedRotatingKV, w, keys, values, previous, **codec)


def _per_lane(
    codec: dict[str, Any], states: Sequence[QuantizedRotatingKV], fn: Callable[..., RotatingKV]
) -> QuantizedRotatingKV:
    """`fn(lane_i of each state)` for the three lanes, joined, and `fn` of the states' exact
    rings beside them."""
    out = joined(codec, [fn(*(lane(s, i) for s in states)) for i in range(3)])
    return with_exact(out, states[0].exact_latest, [s.exact for s in states], fn)


def with_exact(
    state: QuantizedRotatingKV,
    exact_latest: int,
    rings: Sequence[RotatingKV | None],
    fn: Callable[..., RotatingKV],
) -> QuantizedRotatingKV:
    """`state` with `exact_latest` and the exact ring `fn(*rings)` (None without one)."""
    if not exact_latest:
        return state
    assert all(r is not None for r in rings)
    return replace(state, exact=fn(*rings), exact_latest=exact_latest)


def _filled_codec(states: Sequence[QuantizedRotatingKV]) -> dict[str, Any]:
    """The codec of the first state that holds arrays (an empty one has no pads yet)."""
    filled = next((s for s in states if s.keys is not None), states[0])
    return codec_of(filled)


# ---------------------------------------------------------------------------- checks


@problems.register
def _(state: QuantizedRotatingKV, values: bool) -> list[str]:
    found = typed_statics(
        state, max_size=1, keep=0, offset=0, index=0, appended=0, exact_latest=0,
        bools=("rotated",), **CODEC_LOWEST,
    )  # fmt: skip
    if found:
        return found
    found += codec_problems(state)
    if (state.keys is None) != (state.values is None):
        return [*found, "keys and values must both be triples or both None"]
    if found:
        return found
    if state.keys is not None and state.values is not None:
        found += _triple_problems("keys", state.keys, key_codec(state))
        found += _triple_problems("values", state.values, value_codec(state))
        if found:
            return found
        shapes = {tuple(a.shape[:3]) for q in (state.keys, state.values) for a in q}
        if len(shapes) > 1:
            return [f"keys and values disagree in batch, heads or window slots: {sorted(shapes)}"]
    prev = state.previous
    if prev is not None:
        if not isinstance(prev, QuantizedRotatingKV):
            return [f"previous: must be a QuantizedRotatingKV or None; got {type(prev).__name__}"]
        if codec_of(prev) != codec_of(state):
            found.append("previous: its codec statics (bits, group sizes, pads, rotation, seed) "
                         "must be the state's own")  # fmt: skip
        elif prev.keys is not None and prev.values is not None:
            found += _triple_problems("previous.keys", prev.keys, key_codec(state))
            found += _triple_problems("previous.values", prev.values, value_codec(state))
            shapes = {tuple(a.shape[:3]) for q in (prev.keys, prev.values) for a in q}
            if not found and len(shapes) > 1:
                found.append(f"previous: keys and values disagree in batch, heads or window "
                             f"slots: {sorted(shapes)}")  # fmt: skip
        elif (prev.keys is None) != (prev.values is None):
            found.append("previous: keys and values must both be triples or both None")
        if found:
            return found
    # The window's own bookkeeping, checked on the scales lane (floating, like RotatingKV's).
    found += problems(lane(state, 1), values)
    return found or _exact_problems(state, values)


def _exact_problems(state: QuantizedRotatingKV, values: bool) -> list[str]:
    """The exact ring: present iff exact_latest > 0, a RotatingKV of max_size exact_latest
    (keep 0) of the window's rows, heads and head dims (its offsets are its own: a merged or
    ragged ring of R slots keeps other bookkeeping than a window of max_size)."""
    ring, r = state.exact, state.exact_latest
    if not r:
        return [] if ring is None else ["exact: only a state with exact_latest > 0 keeps one"]
    if not isinstance(ring, RotatingKV):
        return [f"exact: exact_latest={r} needs a RotatingKV; got {type(ring).__name__}"]
    found = [f"exact.{m}" for m in problems(ring, values)]
    if found:
        return found
    if (ring.max_size, ring.keep) != (r, 0):
        found.append(
            f"exact: max_size {ring.max_size}, keep {ring.keep}; the ring of the latest {r} "
            f"tokens needs {r}, 0"
        )
    if batch_size_of(ring) != batch_size_of(state):
        found.append(f"exact: {batch_size_of(ring)} rows, the window {batch_size_of(state)}")
    if state.keys is not None and ring.keys is not None and ring.values is not None:
        want = (int(state.keys[0].shape[1]), *_dims(state))
        got = (int(ring.keys.shape[1]), int(ring.keys.shape[3]), int(ring.values.shape[3]))
        if got != want:
            found.append(f"exact: heads and head dims {got}; the window's are {want}")
    return found


def _dims(state: QuantizedRotatingKV) -> tuple[int, int]:
    """The key and value head dims the codecs decode to."""
    assert state.keys is not None and state.values is not None
    return key_codec(state).dim(state.keys), value_codec(state).dim(state.values)


@capabilities_of.register
def _(state: QuantizedRotatingKV) -> Capabilities:
    return Capabilities(
        trimmable=True,
        ragged_commit=not state.keep,
        batchable=not state.keep,
        can_roll_back=_can_roll_back(lane(state, 0))
        and (state.exact is None or _can_roll_back(state.exact)),
    )


@batch_size_of.register
def _(state: QuantizedRotatingKV) -> int:
    if state.left_padding is not None:
        return int(state.left_padding.shape[0])
    return int(state.keys[0].shape[0]) if state.keys is not None else 1


@config_of.register
def _(state: QuantizedRotatingKV) -> dict[str, Any]:
    statics = {f: getattr(state, f) for f in CODEC_FIELDS if not f.endswith("_pad")}
    statics["exact_latest"] = state.exact_latest
    k, v = state.keys, state.values
    if k is None or v is None:
        return kv_config("QuantizedRotatingKV", max_size=state.max_size, keep=state.keep, **statics)
    dims = _dims(state)
    return kv_config(
        "QuantizedRotatingKV",
        k[1].dtype,
        int(k[0].shape[1]),
        *dims,
        max_size=state.max_size,
        keep=state.keep,
        **statics,
    )


@fit_config_of.register
def _(state: QuantizedRotatingKV) -> dict[str, Any]:
    # A quantized window stands in for the RotatingKV a model's cache factory makes.
    mine = config_of(state)
    return kv_config(
        "RotatingKV",
        None,
        mine["kv_heads"],
        mine["key_dim"],
        mine["value_dim"],
        max_size=state.max_size,
        keep=state.keep,
    )


# ---------------------------------------------------------------------------- transforms


@record_forward.register
def _(state: QuantizedRotatingKV, before: QuantizedRotatingKV, n: int) -> QuantizedRotatingKV:
    # As RotatingKV: a multi-token forward may push entries out, so keep the window before it.
    previous = None
    if n > 1:
        previous = replace(
            before, previous=None, exact=None, exact_latest=0, appended=0, **codec_of(state)
        )
    out = replace(state, previous=previous, appended=n)
    if state.exact is None or before.exact is None:
        return out
    return replace(out, exact=record_forward(state.exact, before.exact, n))


@commit_rows.register
def _(state: QuantizedRotatingKV, counts: tuple[int, ...], checkpoints: Any) -> Any:
    if all(c == state.appended for c in counts):  # every decode step: no lanes needed
        ring = None if state.exact is None else commit_rows(state.exact, counts, None)
        return replace(state, previous=None, appended=0, exact=ring)
    try:
        return _per_lane(codec_of(state), [state], lambda w: commit_rows(w, counts, None))
    except CommitError as e:  # the lanes' RotatingKV errors, named for this kind
        raise CommitError(str(e).replace("RotatingKV", "QuantizedRotatingKV")) from None


@take_rows.register
def _(state: QuantizedRotatingKV, rows: tuple[int, ...]) -> QuantizedRotatingKV:
    return _per_lane(codec_of(state), [state], lambda w: take_rows(w, rows))


@merge_states.register
def _(first: QuantizedRotatingKV, rest: Sequence[QuantizedRotatingKV]) -> QuantizedRotatingKV:
    states = [first, *rest]
    return _per_lane(_filled_codec(states), states, lambda *ws: merge_states(ws[0], ws[1:]))


@extend_states.register
def _(a: QuantizedRotatingKV, b: QuantizedRotatingKV) -> QuantizedRotatingKV:
    return _per_lane(_filled_codec([a, b]), [a, b], extend_states)


@extract_row.register
def _(state: QuantizedRotatingKV, row: int) -> QuantizedRotatingKV:
    return _per_lane(codec_of(state), [state], lambda w: extract_row(w, row))


# ---------------------------------------------------------------------------- quantize


def quantize_window(state: RotatingKV, spec: Any) -> QuantizedRotatingKV:
    """A RotatingKV as a QuantizedRotatingKV with the codec statics of `spec` (a QuantizedKV
    or QuantizedRotatingKV; its pads are recomputed for the window's head dims). Every slot
    of the buffer is quantized (used or not: the ring's layout is kept as it is), and
    `previous` with the same codec."""
    codec = codec_of(spec)
    exact_latest = getattr(spec, "exact_latest", 0)
    require(
        not exact_latest or (state.keys is None and state.previous is None),
        NotSupportedError,
        f"quantize: exact_latest={exact_latest} on a sliding window that already holds tokens; "
        "quantize it before its first forward (an empty state, as the engine's kv_bits does), "
        "or with exact_latest=0",
    )
    if state.keys is not None and state.values is not None:
        codec["key_pad"] = channel_pad(int(state.keys.shape[-1]), codec["key_group_size"])
        codec["value_pad"] = channel_pad(int(state.values.shape[-1]), codec["value_group_size"])
    else:
        prev = state.previous
        if prev is not None and prev.keys is not None and prev.values is not None:
            codec["key_pad"] = channel_pad(int(prev.keys.shape[-1]), codec["key_group_size"])
            codec["value_pad"] = channel_pad(int(prev.values.shape[-1]), codec["value_group_size"])
        else:
            codec["key_pad"] = codec["value_pad"] = 0
    encoded = _encoded(state, codec)
    if not exact_latest:
        return encoded
    ring = _window(RotatingKV, state, None, None, None)
    ring = replace(ring, max_size=exact_latest, keep=0, index=0, rotated=False)
    return replace(encoded, exact=ring, exact_latest=exact_latest)


def _encoded(state: RotatingKV, codec: dict[str, Any]) -> QuantizedRotatingKV:
    previous = None if state.previous is None else _encoded(state.previous, codec)
    empty = _window(QuantizedRotatingKV, state, None, None, previous, **codec)
    keys = None if state.keys is None else key_codec(empty).encode(state.keys)
    values = None if state.values is None else value_codec(empty).encode(state.values)
    return replace(empty, keys=keys, values=values)


def dequantized(state: QuantizedRotatingKV) -> RotatingKV:
    """The RotatingKV holding the state's dequantized keys and values, slot for slot (the
    window's bookkeeping and `previous` kept): the reference a quantized window's attention
    is checked against. Arrays are in the scales' dtype."""
    keys = None if state.keys is None else key_codec(state).decode(state.keys)
    values = None if state.values is None else value_codec(state).decode(state.values)
    require(
        (keys is None) == (values is None),
        ConfigMismatchError,
        "dequantized: keys and values must both be triples or both None",
    )
    previous = None
    if state.previous is not None:
        previous = dequantized(replace(state.previous, **codec_of(state)))
    return _window(RotatingKV, state, keys, values, previous)


__all__ = ["QuantizedRotatingKV", "dequantized", "quantize_window"]
