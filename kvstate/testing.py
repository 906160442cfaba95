"""Hypothesis strategies for every kvstate state, so you can property-test your own decoders.

    from hypothesis import given
    from kvstate.testing import dense_kv_states, accepted_counts

    @given(st.data())
    def test_my_decoder(data):
        state = data.draw(dense_kv_states(batch=2, padded=True))
        accepted = data.draw(accepted_counts(state))
        ...

Every strategy draws *small* shapes (batch <= 3, heads <= 2, head dims <= 8 or one
quantization group, a few dozen positions) so that hundreds of examples run in seconds.
Array contents are random normal numbers from a drawn seed (hypothesis does not shrink
them; it shrinks the shapes, lengths, paddings and counts). Buffer positions that no row
uses (capacity past the length, left padding) hold garbage on purpose: code that reads
them is wrong, and garbage makes that visible.

Each strategy accepts a fixed value or a strategy for each of its knobs; `None` means
"draw it". Fix the knobs that must agree when you combine states (`merge`, `extend`):
kind, dtype, heads, head dims, bits, group size, window.

This module needs hypothesis (the `test` extra); `import kvstate` never imports it.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
from hypothesis import strategies as st

from ._states import (
    ChunkedKV,
    DenseKV,
    ListState,
    ModelState,
    QuantizedKV,
    RecurrentState,
    RotatingKV,
)
from ._transforms import appended_of, batch_size_of

__all__ = [
    "DTYPES",
    "accepted_counts",
    "chunked_kv_states",
    "dense_kv_states",
    "list_states",
    "model_states",
    "quantized_kv_states",
    "recurrent_states",
    "rotating_kv_states",
]

DTYPES = (mx.float32, mx.float16, mx.bfloat16)
"""Floating dtypes the strategies draw from."""

Knob = Any  # a fixed value, a strategy for it, or None (draw from the default range)


def _knob(draw: Any, value: Knob, default: st.SearchStrategy[Any]) -> Any:
    if value is None:
        return draw(default)
    if isinstance(value, st.SearchStrategy):
        return draw(value)
    return value


def _noise(seed: int, shape: tuple[int, ...], dtype: mx.Dtype) -> mx.array:
    rng = np.random.default_rng(seed)
    return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)


_SEEDS = st.integers(0, 2**32 - 1)


# ---------------------------------------------------------------------------------------
# Dense KV (KVCache, BatchKVCache, ConcatenateKVCache)
# ---------------------------------------------------------------------------------------


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
    appended: Knob = None,
) -> DenseKV:
    """A `DenseKV`.

    Draws: batch in 1..3; padded (batched form with `left_padding` (B,), as BatchKVCache) or
    not (KVCache, or ConcatenateKVCache when `concatenate`); heads in 1..2; key and value
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
    empty = False if appended else _knob(draw, empty, st.sampled_from([False, False, True]))
    concatenate = False if padded else _knob(draw, concatenate, st.booleans())
    if empty:
        if padded:
            return DenseKV(left_padding=mx.zeros((batch,), mx.int32))
        if batch != 1:  # an empty unpadded state has no batch axis: it is batch 1
            return DenseKV(left_padding=mx.zeros((batch,), mx.int32))
        return DenseKV(concatenate=concatenate)
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
    keys = _noise(seed, (batch, heads, capacity, k_dim), dtype)
    values = _noise(seed + 1, (batch, heads, capacity, v_dim), dtype)
    left_padding = mx.array(paddings, mx.int32) if padded else None
    return DenseKV(
        keys, values, left_padding, length=length, appended=appended, concatenate=concatenate
    )


# ---------------------------------------------------------------------------------------
# Counts for commit_prefix
# ---------------------------------------------------------------------------------------


@st.composite
def accepted_counts(draw: Any, state: Any, *, ragged: Knob = None) -> int | list[int]:
    """A valid `accepted` for `commit_prefix(state, accepted)`: an int in 0..appended, or
    (when `ragged`, drawn if None) a list with one count in 0..appended per row."""
    appended = appended_of(state)
    ragged = _knob(draw, ragged, st.booleans())
    if not ragged:
        return int(draw(st.integers(0, appended)))
    batch = batch_size_of(state)
    return draw(st.lists(st.integers(0, appended), min_size=batch, max_size=batch))


# ---------------------------------------------------------------------------------------
# Kinds being written (filled in as their modules land)
# ---------------------------------------------------------------------------------------


def rotating_kv_states(**kwargs: Any) -> st.SearchStrategy[RotatingKV]:
    raise NotImplementedError


def quantized_kv_states(**kwargs: Any) -> st.SearchStrategy[QuantizedKV]:
    raise NotImplementedError


def chunked_kv_states(**kwargs: Any) -> st.SearchStrategy[ChunkedKV]:
    raise NotImplementedError


def recurrent_states(**kwargs: Any) -> st.SearchStrategy[RecurrentState]:
    raise NotImplementedError


# ---------------------------------------------------------------------------------------
# Composites
# ---------------------------------------------------------------------------------------


LayerStrategy = Any
"""A function `(batch=..., appended=...) -> strategy` for one layer state."""


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
    (default: `dense_kv_states`); see `mixed_layers` for every kind."""
    batch = _knob(draw, batch, st.integers(1, 3))
    appended = _knob(draw, appended, st.integers(0, 3))
    num_layers = _knob(draw, num_layers, st.integers(1, 4))
    make = layers if layers is not None else _default_layer
    return ModelState(tuple(draw(make(batch=batch, appended=appended)) for _ in range(num_layers)))
