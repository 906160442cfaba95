"""The hypothesis strategies of `kvstate.testing` (see its docstring)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import mlx.core as mx
import numpy as np
from hypothesis import strategies as st

from .._chunked import ChunkedKV
from .._composite import ListState, ModelState
from .._dense import DenseKV
from .._quantized import BITS, QuantizedKV, key_codec, value_codec
from .._recurrent import RecurrentState
from .._rotating import RotatingKV
from .._rotations import ROTATIONS
from .._tree import replace
from ..kinds import appended_of, batch_size_of, capabilities_of, layer_kinds
from ._window import window_update

DTYPES = (mx.float32, mx.float16, mx.bfloat16)
"""Floating dtypes the strategies draw from."""

Knob = Any  # a fixed value, a strategy for it, or None (draw from the default range)

LayerStrategy = Callable[..., st.SearchStrategy[Any]]
"""A function `(batch=..., appended=...) -> strategy` for one layer state of some kind."""

STRATEGIES: dict[type, LayerStrategy] = {}
"""The strategy of every layer kind, registered with `strategy_for` (a test checks that every
kind registered with `kvstate.kinds` has one)."""


def strategy_for(cls: type) -> Callable[[LayerStrategy], LayerStrategy]:
    """Register `fn(batch=..., appended=..., **knobs)` as the strategy for states of `cls`."""

    def decorate(fn: LayerStrategy) -> LayerStrategy:
        STRATEGIES[cls] = fn
        return fn

    return decorate


def _knob(draw: Any, value: Knob, default: st.SearchStrategy[Any]) -> Any:
    if value is None:
        return draw(default)
    if isinstance(value, st.SearchStrategy):
        return draw(value)
    return value


def _noise(seed: int, shape: tuple[int, ...], dtype: mx.Dtype) -> mx.array:
    rng = np.random.default_rng(seed)
    return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)


def _kv_noise(
    seed: int, shape: tuple[int, int, int], k_dim: int, v_dim: int, dtype: mx.Dtype
) -> tuple[mx.array, mx.array]:
    """Random keys (*shape, k_dim) and values (*shape, v_dim) from seeds `seed`, `seed + 1`."""
    return _noise(seed, (*shape, k_dim), dtype), _noise(seed + 1, (*shape, v_dim), dtype)


def _kv_shape(
    draw: Any,
    batch: Knob,
    heads: Knob,
    k_dim: Knob,
    v_dim: Knob,
    dtype: Knob,
    dims: tuple[int, ...] = (2, 4, 8),
) -> tuple[int, int, int, int, mx.Dtype]:
    """(batch, heads, k_dim, v_dim, dtype) of a KV state, each knob drawn if not fixed: batch
    in 1..3, heads in 1..2, key and value head dims in `dims`, dtype in `DTYPES`."""
    return (
        _knob(draw, batch, st.integers(1, 3)),
        _knob(draw, heads, st.integers(1, 2)),
        _knob(draw, k_dim, st.sampled_from(dims)),
        _knob(draw, v_dim, st.sampled_from(dims)),
        _knob(draw, dtype, st.sampled_from(DTYPES)),
    )


_SEEDS = st.integers(0, 2**32 - 1)
_MAYBE_EMPTY = st.sampled_from([False, False, True])


def _padded_rows(
    draw: Any,
    batch: int,
    padded: bool,
    length: Knob,
    empty: Knob,
    appended: int | None,
    max_length: int,
) -> tuple[int, list[int], int] | None:
    """For the left-padded KV kinds: None (draw an empty state), or the length, each row's
    left padding and the tokens the last forward appended."""
    if length is None:
        is_empty = False if appended else _knob(draw, empty, _MAYBE_EMPTY)
    else:
        is_empty = length == 0
    if is_empty:
        return None
    length = _knob(draw, length, st.integers(max(1, appended or 0), max(max_length, appended or 0)))
    top = length - (appended or 1)  # every row holds its appended tokens (and >= 1 token)
    paddings = (
        draw(st.lists(st.integers(0, top), min_size=batch, max_size=batch))
        if padded
        else [0] * batch
    )
    if appended is None:
        appended = draw(st.integers(0, length - max(paddings)))
    return length, paddings, appended


def _empty_padded(spec: Any, batch: int, padded: bool) -> Any:
    """An empty state of a left-padded KV kind (`spec`: its statics): its batch, if not 1 or
    `padded`, lives in its (zero) left padding."""
    if padded or batch != 1:
        return replace(spec, left_padding=mx.zeros((batch,), mx.int32))
    return spec


# ---------------------------------------------------------------------------------------
# Dense KV (KVCache, BatchKVCache, ConcatenateKVCache)
# ---------------------------------------------------------------------------------------


@strategy_for(DenseKV)
@st.composite
def dense_kv_states(
    draw: Any,
    *,
    batch: Knob = None,
    padded: Knob = None,
    heads: Knob = None,
    k_dim: Knob = None,
    v_dim: Knob = None,
    dtype: Knob = None,
    max_length: int = 12,
    empty: Knob = None,
    concatenate: Knob = None,
    simple: Knob = None,
    appended: Knob = None,
) -> DenseKV:
    """A `DenseKV`.

    Draws: batch in 1..3; padded (batched form with `left_padding` (B,), as BatchKVCache) or
    not (KVCache, or ConcatenateKVCache when `concatenate`, or mlx-vlm's SimpleKVCache when
    also `simple`); heads in 1..2; key and value
    head dims in {2, 4, 8} (they may differ); dtype in `DTYPES`; length in 0..max_length
    (0 with `empty=True`, which gives `keys is None`); per-row left padding in
    0..length-appended; spare capacity past `length` (none for the concatenate form);
    `appended` (what the last forward added, for `commit_prefix`) in 0..min(row lengths)
    (fix it to give layers of one model the same value).
    keys (B, H, capacity, Dk), values (B, H, capacity, Dv).
    """
    batch = _knob(draw, batch, st.integers(1, 3))
    padded = _knob(draw, padded, st.booleans())
    heads = _knob(draw, heads, st.integers(1, 2))
    k_dim = _knob(draw, k_dim, st.sampled_from([2, 4, 8]))
    v_dim = _knob(draw, v_dim, st.sampled_from([2, 4, 8]))
    dtype = _knob(draw, dtype, st.sampled_from(DTYPES))
    appended = _knob(draw, appended, st.none())
    empty = False if appended else _knob(draw, empty, _MAYBE_EMPTY)
    concatenate = False if padded else _knob(draw, concatenate, st.booleans())
    simple = concatenate and _knob(draw, simple, st.booleans())
    if empty:
        if padded:
            return DenseKV(left_padding=mx.zeros((batch,), mx.int32))
        if batch != 1:  # an empty unpadded state has no batch axis: it is batch 1
            return DenseKV(left_padding=mx.zeros((batch,), mx.int32))
        return DenseKV(concatenate=concatenate, simple=simple)
    length = draw(st.integers(max(1, appended or 0), max(max_length, appended or 0)))
    top = length - (appended or 1)  # every row holds its appended tokens (and >= 1 token)
    if padded:
        paddings = draw(st.lists(st.integers(0, top), min_size=batch, max_size=batch))
    else:
        paddings = [0] * batch
    if appended is None:
        appended = draw(st.integers(0, length - max(paddings)))
    capacity = length if concatenate else length + draw(st.integers(0, 4))
    seed = draw(_SEEDS)
    keys, values = _kv_noise(seed, (batch, heads, capacity), k_dim, v_dim, dtype)
    left_padding = mx.array(paddings, mx.int32) if padded else None
    return DenseKV(
        keys,
        values,
        left_padding,
        length=length,
        appended=appended,
        concatenate=concatenate,
        simple=simple,
    )


# ---------------------------------------------------------------------------------------
# Counts for commit_prefix
# ---------------------------------------------------------------------------------------


@st.composite
def accepted_counts(draw: Any, state: Any, *, ragged: Knob = None) -> int | list[int]:
    """A valid `accepted` for `commit_prefix(state, accepted)`: an int in 0..appended, or
    (when `ragged`, drawn if None) a list with one count in 0..appended per row.

    Respects what each kind can honour: ragged lists only where every part takes them
    (not ChunkedKV, or a window with `keep`), and after a one-token forward
    that overwrote a window slot, only `appended` (the overwritten entry is gone: the
    state before that forward is the rollback). Recurrent parts need checkpoints for
    anything below `appended` (see `recurrent_checkpoints`)."""
    appended = appended_of(state)
    caps = capabilities_of(state)
    lowest = 0 if caps.can_roll_back else appended
    if not caps.ragged_commit or batch_size_of(state) == 1:
        ragged = False
    ragged = _knob(draw, ragged, st.booleans())
    if not ragged:
        return int(draw(st.integers(lowest, appended)))
    batch = batch_size_of(state)
    return draw(st.lists(st.integers(lowest, appended), min_size=batch, max_size=batch))


# ---------------------------------------------------------------------------------------
# Quantized KV (QuantizedKVCache)
# ---------------------------------------------------------------------------------------

QUANT_BITS = BITS
"""The bit widths kvstate supports (`kvstate.quantize`)."""

ROTATION_KINDS = ROTATIONS
"""The rotations a QuantizedKV can apply before quantizing ("none", "so4", "hadamard")."""


@strategy_for(QuantizedKV)
@st.composite
def quantized_kv_states(
    draw: Any,
    *,
    batch: Knob = None,
    heads: Knob = None,
    bits: Knob = None,
    group_size: Knob = None,
    key_bits: Knob = None,
    value_bits: Knob = None,
    key_group_size: Knob = None,
    value_group_size: Knob = None,
    k_groups: Knob = None,
    v_groups: Knob = None,
    pads: Knob = None,
    rotation: Knob = None,
    seed: Knob = None,
    padded: Knob = None,
    dtype: Knob = None,
    max_length: int = 10,
    length: Knob = None,
    empty: Knob = None,
    appended: Knob = None,
    exact_latest: Knob = None,
) -> QuantizedKV:
    """A `QuantizedKV`.

    Draws: batch in 1..3; heads in 1..2; key and value bits in `QUANT_BITS` (`bits` fixes
    both, `key_bits` / `value_bits` one side; drawn equal half of the time); group sizes in
    {32, 64} likewise (`group_size`, `key_group_size`, `value_group_size`); stored key / value
    rows of 1..2 groups; `pads`: zero channels on each side (head dims that are not whole
    groups), as (key_pad, value_pad), drawn as 0 or 8; rotation in `ROTATION_KINDS` with a
    seed; `padded`: per-row left padding (like a merged batch; drawn when not fixed);
    the scales' dtype in `DTYPES`; length in 1..max_length (or `keys is None`, length 0,
    with `empty=True`); spare capacity past the length (garbage); `appended` in
    0..min(row lengths); `exact_latest` in {0, 1, 3} (0 half of the time), its tail the
    latest min(length, exact_latest + appended) raw head vectors (what transforms keep). Keys
    and values are triples of random normal head vectors encoded by the state's own codec
    (padded, rotated, `mx.quantize`d).
    """
    batch = _knob(draw, batch, st.integers(1, 3))
    heads = _knob(draw, heads, st.integers(1, 2))
    both_bits = _knob(draw, bits, st.sampled_from(QUANT_BITS))
    asymmetric = bits is None and draw(st.booleans())
    key_bits = _knob(
        draw, key_bits, st.sampled_from(QUANT_BITS) if asymmetric else st.just(both_bits)
    )
    value_bits = _knob(
        draw, value_bits, st.sampled_from(QUANT_BITS) if asymmetric else st.just(both_bits)
    )
    both_group = _knob(draw, group_size, st.sampled_from([32, 64]))
    key_group_size = _knob(draw, key_group_size, st.just(both_group))
    value_group_size = _knob(draw, value_group_size, st.just(both_group))
    k_groups = _knob(draw, k_groups, st.integers(1, 2))
    v_groups = _knob(draw, v_groups, st.integers(1, 2))
    key_pad, value_pad = _knob(
        draw, pads, st.tuples(st.sampled_from([0, 8]), st.sampled_from([0, 8]))
    )
    rotation = _knob(draw, rotation, st.sampled_from(ROTATION_KINDS))
    seed = _knob(draw, seed, st.integers(0, 3))
    padded = _knob(draw, padded, st.booleans())
    dtype = _knob(draw, dtype, st.sampled_from(DTYPES))
    appended = _knob(draw, appended, st.none())
    exact_latest = _knob(draw, exact_latest, st.sampled_from([0, 0, 1, 3]))
    spec = QuantizedKV(
        exact_latest=exact_latest,
        key_bits=key_bits,
        value_bits=value_bits,
        key_group_size=key_group_size,
        value_group_size=value_group_size,
        rotation=rotation,
        seed=seed,
    )
    rows = _padded_rows(draw, batch, padded, length, empty, appended, max_length)
    if rows is None:
        return _empty_padded(spec, batch, padded)
    length, paddings, appended = rows
    capacity = length + draw(st.integers(0, 3))
    noise_seed = draw(_SEEDS)
    spec = replace(spec, key_pad=key_pad, value_pad=value_pad)
    shape = (batch, heads, capacity)
    keys = _noise(noise_seed, (*shape, k_groups * key_group_size - key_pad), dtype)
    values = _noise(noise_seed + 1, (*shape, v_groups * value_group_size - value_pad), dtype)
    width = min(length, exact_latest + appended)
    tails = [x[..., length - width : length, :] if exact_latest else None for x in (keys, values)]
    return replace(
        spec,
        keys=key_codec(spec).encode(keys),
        values=value_codec(spec).encode(values),
        left_padding=mx.array(paddings, mx.int32) if padded else None,
        tail_keys=tails[0],
        tail_values=tails[1],
        length=length,
        appended=appended,
    )


# ---------------------------------------------------------------------------------------
# Chunked KV (ChunkedKVCache)
# ---------------------------------------------------------------------------------------


@strategy_for(ChunkedKV)
@st.composite
def chunked_kv_states(
    draw: Any,
    *,
    batch: Knob = None,
    heads: Knob = None,
    k_dim: Knob = None,
    v_dim: Knob = None,
    dtype: Knob = None,
    chunk_size: Knob = None,
    empty: Knob = None,
    appended: Knob = None,
    start: Knob = None,
    held: Knob = None,
) -> ChunkedKV:
    """A `ChunkedKV` (unpadded, like mlx-lm's ChunkedKVCache), made the way a model makes
    one: an earlier state (drawn: start_position in 0..6, 1..chunk_size+2 valid entries,
    spare capacity; fix them with `start` and `held`) goes through one forward of `appended` (0..3) tokens, which first drops
    the front past `chunk_size` (mlx-lm's `maybe_trim_front`) and then appends. A forward of
    more than one token keeps the earlier state in `previous` (`commit_prefix` restores it).

    Draws: batch in 1..3, heads in 1..2, head dims in {2, 4, 8}, dtype in `DTYPES`,
    chunk_size in 2..6; `empty=True` gives `keys is None` (batch 1 only, like the quantized
    kind). keys (B, H, capacity, Dk).
    """
    batch, heads, k_dim, v_dim, dtype = _kv_shape(draw, batch, heads, k_dim, v_dim, dtype)
    chunk_size = _knob(draw, chunk_size, st.integers(2, 6))
    appended = _knob(draw, appended, st.none())
    empty = False if appended or batch != 1 else _knob(draw, empty, _MAYBE_EMPTY)
    if empty:
        return ChunkedKV(chunk_size=chunk_size)
    if appended is None:
        appended = draw(st.integers(0, 3))
    seed = draw(_SEEDS)
    start = _knob(draw, start, st.integers(0, 6))
    held = _knob(draw, held, st.integers(0 if appended else 1, chunk_size + 2))
    spare = draw(st.integers(0, 3))

    k, v = _kv_noise(seed, (batch, heads, held + spare), k_dim, v_dim, dtype)
    before = ChunkedKV(
        k if held else None,
        v if held else None,
        chunk_size=chunk_size,
        offset=start + held if held else 0,
        start_position=start if held else 0,
    )
    if appended == 0:
        return before
    # The forward: maybe_trim_front, then append `appended` tokens (a fresh buffer; the
    # capacity past the valid entries is irrelevant).
    keys, values, first = before.keys, before.values, before.start_position
    if keys is not None and values is not None and held > chunk_size:
        trim = held - chunk_size
        keys, values, first, held = (
            keys[..., trim:held, :],
            values[..., trim:held, :],
            first + trim,
            chunk_size,
        )
    new_k, new_v = _kv_noise(seed + 2, (batch, heads, appended), k_dim, v_dim, dtype)
    if keys is not None and values is not None:
        new_k = mx.concatenate([keys[..., :held, :], new_k], axis=2)
        new_v = mx.concatenate([values[..., :held, :], new_v], axis=2)
    return ChunkedKV(
        new_k,
        new_v,
        previous=before if appended > 1 else None,
        chunk_size=chunk_size,
        offset=before.offset + appended,
        start_position=first,
        appended=appended,
    )


# ---------------------------------------------------------------------------------------
# Recurrent state (ArraysCache)
# ---------------------------------------------------------------------------------------

_TRAILING = st.lists(st.integers(1, 4), min_size=1, max_size=3).map(tuple)


@strategy_for(RecurrentState)
@st.composite
def recurrent_states(
    draw: Any,
    *,
    batch: Knob = None,
    shapes: Knob = None,
    dtype: Knob = None,
    bookkeeping: Knob = None,
    empty: Knob = None,
    appended: Knob = None,
) -> RecurrentState:
    """A `RecurrentState` (mlx-lm's ArraysCache: conv windows, SSM states).

    Draws: batch in 1..3; `shapes`, the trailing shape of each of 1..3 arrays (each 1..3
    dims of 1..4; the arrays are (B, *shape)); dtype in `DTYPES`; with `bookkeeping`,
    per-row `left_padding` and `lengths` (B,) int32 as a batched prompt leaves them;
    `empty=True` gives every array None (no forward yet); `appended` in 0..3. Commit a
    drawn state with `recurrent_checkpoints(state)`.
    """
    batch = _knob(draw, batch, st.integers(1, 3))
    shapes = _knob(draw, shapes, st.lists(_TRAILING, min_size=1, max_size=3).map(tuple))
    dtype = _knob(draw, dtype, st.sampled_from(DTYPES))
    bookkeeping = _knob(draw, bookkeeping, st.booleans())
    appended = _knob(draw, appended, st.integers(0, 3))
    empty = _knob(draw, empty, st.sampled_from([False, False, True]))
    seed = draw(_SEEDS)
    left_padding = lengths = None
    if bookkeeping:
        ints = st.lists(st.integers(-4, 4), min_size=batch, max_size=batch)
        left_padding = mx.array(draw(ints), mx.int32)
        lengths = mx.array(draw(ints), mx.int32)
    elif empty and batch != 1:
        left_padding = mx.zeros((batch,), mx.int32)  # an empty state's batch axis
    arrays = tuple(
        None if empty else _noise(seed + i, (batch, *shape), dtype)
        for i, shape in enumerate(shapes)
    )
    return RecurrentState(arrays, left_padding, lengths, appended=appended)


@st.composite
def recurrent_checkpoints(draw: Any, state: RecurrentState) -> tuple[mx.array | None, ...]:
    """Checkpoints that fit `state` for `commit_prefix(state, accepted, checkpoints)`: per
    array, (B, appended+1, *shape) whose entry t is the array after t tokens of the last
    forward; entry `appended` is the state's own array (random before it). None for an
    array that is None."""
    seed = draw(_SEEDS)
    steps = appended_of(state)
    out: list[mx.array | None] = []
    for i, a in enumerate(state.arrays):
        if a is None:
            out.append(None)
            continue
        earlier = _noise(seed + i, (a.shape[0], steps, *a.shape[1:]), a.dtype)
        out.append(mx.concatenate([earlier, a[:, None]], axis=1))
    return tuple(out)


# ---------------------------------------------------------------------------------------
# Sliding windows (RotatingKVCache, BatchRotatingKVCache)
# ---------------------------------------------------------------------------------------


@strategy_for(RotatingKV)
@st.composite
def rotating_kv_states(
    draw: Any,
    *,
    batch: Knob = None,
    padded: Knob = None,
    heads: Knob = None,
    k_dim: Knob = None,
    v_dim: Knob = None,
    dtype: Knob = None,
    max_size: Knob = None,
    keep: Knob = None,
    empty: Knob = None,
    appended: Knob = None,
) -> RotatingKV:
    """A `RotatingKV` (sliding window), made the way a model makes one: from an empty
    window, 0..5 forwards of 1..4 random tokens each, applied exactly as mlx-lm's
    RotatingKVCache (unpadded) or BatchRotatingKVCache (`padded`: per-row left padding
    0..2 before the first forward, which is then longer than it) would. Rings wrap,
    multi-token forwards over-fill to max_size + S - 1 entries, single tokens overwrite.
    The last forward (of `appended` tokens, 0 = none recorded) keeps the state before it
    in `previous` when it had more than one token, as `kvstate.adapters.wrap` does.

    Draws: batch in 1..3, padded, heads in 1..2, head dims in {2, 4, 8}, dtype in
    `DTYPES`, max_size in 2..6, keep in 0..1 (0 when padded: mlx-lm's batched window has
    no keep prefix), `appended` in 0..3; `empty=True` gives a window with no entries (and,
    batched, zero left padding).
    """
    batch = _knob(draw, batch, st.integers(1, 3))
    padded = _knob(draw, padded, st.booleans())
    heads = _knob(draw, heads, st.integers(1, 2))
    k_dim = _knob(draw, k_dim, st.sampled_from([2, 4, 8]))
    v_dim = _knob(draw, v_dim, st.sampled_from([2, 4, 8]))
    dtype = _knob(draw, dtype, st.sampled_from(DTYPES))
    max_size = _knob(draw, max_size, st.integers(2, 6))
    keep = 0 if padded else _knob(draw, keep, st.sampled_from([0, 0, 1]))
    appended = _knob(draw, appended, st.integers(0, 3))
    empty = False if appended else _knob(draw, empty, _MAYBE_EMPTY)
    if empty and batch != 1:
        padded, keep = True, 0  # several empty rows need the batched form (no keep prefix)
    if padded:
        # An empty batched window gets zero padding (what merge / init_state give): padding
        # is only meaningful for the prompt forward that follows it here.
        paddings = [0] * batch
        if not empty:
            paddings = draw(st.lists(st.integers(0, 2), min_size=batch, max_size=batch))
        lp = mx.array(paddings, mx.int32)
        state = RotatingKV(left_padding=lp, offsets=-lp, max_size=max_size)
    else:
        paddings = [0]
        state = RotatingKV(max_size=max_size, keep=keep)
    if empty:
        return state
    chunks = draw(st.lists(st.integers(1, 4), min_size=0, max_size=5))
    chunks[:1] = [max(chunks[0], max(paddings) + 1)] if chunks else []  # the prompt
    if not chunks:
        chunks = [max(paddings) + 1]
    if appended:
        chunks.append(appended)
    rng = np.random.default_rng(draw(_SEEDS))
    before = state
    for n in chunks:
        before = state
        k = mx.array(rng.standard_normal((batch, heads, n, k_dim)).astype(np.float32))
        v = mx.array(rng.standard_normal((batch, heads, n, v_dim)).astype(np.float32))
        state = window_update(state, k.astype(dtype), v.astype(dtype))
    if not appended:
        return state
    previous = before if chunks[-1] > 1 else None
    # attrs.evolve builds through the class, so the state is checked (mypy does not see
    # state_class's classes as attrs classes).
    return attrs.evolve(state, previous=previous, appended=chunks[-1])  # type: ignore[misc]


# ---------------------------------------------------------------------------------------
# Composites
# ---------------------------------------------------------------------------------------


@st.composite
def layer_states(draw: Any, *, batch: Knob = None, appended: Knob = None) -> Any:
    """A layer state of any registered kind (`STRATEGIES`), with the given batch size and
    `appended` count (drawn if None)."""
    batch = _knob(draw, batch, st.integers(1, 3))
    appended = _knob(draw, appended, st.integers(0, 3))
    kinds = [
        STRATEGIES[k](batch=batch, appended=appended) for k in layer_kinds() if k in STRATEGIES
    ]
    return draw(st.one_of(kinds))


def _default_layer(*, batch: int, appended: int) -> st.SearchStrategy[Any]:
    return dense_kv_states(batch=batch, appended=appended)


@st.composite
def list_states(
    draw: Any,
    children: LayerStrategy | None = None,
    *,
    batch: Knob = None,
    appended: Knob = None,
    size: Knob = None,
) -> ListState:
    """A `ListState` (mlx-lm's CacheList) of `size` (1..3) child states of one batch size
    (1..3) and one `appended` count (0..3).

    `children`: a function `(batch=..., appended=...) -> strategy` for one child
    (default: `dense_kv_states`)."""
    batch = _knob(draw, batch, st.integers(1, 3))
    appended = _knob(draw, appended, st.integers(0, 3))
    size = _knob(draw, size, st.integers(1, 3))
    make = children if children is not None else _default_layer
    return ListState(tuple(draw(make(batch=batch, appended=appended)) for _ in range(size)))


@st.composite
def model_states(
    draw: Any,
    layers: LayerStrategy | None = None,
    *,
    batch: Knob = None,
    appended: Knob = None,
    num_layers: Knob = None,
) -> ModelState:
    """A `ModelState` of `num_layers` (1..4) layer states sharing one batch size (1..3) and
    one `appended` count (0..3), as after a forward of the whole model.

    `layers`: a function `(batch=..., appended=...) -> strategy` for one layer state
    (default: `dense_kv_states`); pass `layer_states` for layers of every kind."""
    batch = _knob(draw, batch, st.integers(1, 3))
    appended = _knob(draw, appended, st.integers(0, 3))
    num_layers = _knob(draw, num_layers, st.integers(1, 4))
    make = layers if layers is not None else _default_layer
    return ModelState(tuple(draw(make(batch=batch, appended=appended)) for _ in range(num_layers)))
