"""The hypothesis strategy of `TurboQuantKV` (mlx-vlm's TurboQuant-MSE caches)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
from hypothesis import strategies as st

from .._tree import replace
from .._turboquant import TurboQuantKV, index_width
from ._strategies import _SEEDS, Knob, _knob, _padded_rows, strategy_for


@strategy_for(TurboQuantKV)
@st.composite
def turboquant_kv_states(
    draw: Any,
    *,
    batch: Knob = None,
    heads: Knob = None,
    key_dim: Knob = None,
    value_dim: Knob = None,
    key_bits: Knob = None,
    value_bits: Knob = None,
    seed: Knob = None,
    padded: Knob = None,
    max_length: int = 10,
    length: Knob = None,
    empty: Knob = None,
    appended: Knob = None,
) -> TurboQuantKV:
    """A `TurboQuantKV`.

    Draws: batch in 1..3; heads in 1..2; key / value head dims in {8, 12, 16} (powers of two
    take mlx-vlm's Hadamard path, others its dense rotation); key / value bits in 2..4; seed
    in 0..3; `padded`: per-row left padding; length in 1..max_length (or empty with
    `empty=True`); spare capacity past the length (garbage); `appended` in 0..min(row
    lengths). Norms are random positive float16 and indices random uint32 words: every
    word is a valid packing (each field is < 2**bits), so mlx-vlm's codec decodes any draw.
    """
    batch = _knob(draw, batch, st.integers(1, 3))
    heads = _knob(draw, heads, st.integers(1, 2))
    key_dim = _knob(draw, key_dim, st.sampled_from([8, 12, 16]))
    value_dim = _knob(draw, value_dim, st.sampled_from([8, 12, 16]))
    key_bits = _knob(draw, key_bits, st.integers(2, 4))
    value_bits = _knob(draw, value_bits, st.integers(2, 4))
    seed = _knob(draw, seed, st.integers(0, 3))
    padded = _knob(draw, padded, st.booleans())
    appended = _knob(draw, appended, st.none())
    spec = TurboQuantKV(key_bits=key_bits, value_bits=value_bits, seed=seed)
    rows = _padded_rows(draw, batch, padded, length, empty, appended, max_length)
    if rows is None:  # an empty state: its batch (if not 1) lives in its left padding
        return (
            replace(spec, left_padding=mx.zeros((batch,), mx.int32))
            if padded or batch != 1
            else spec
        )
    length, paddings, appended = rows
    rng = np.random.default_rng(draw(_SEEDS))
    shape = (batch, heads, length + draw(st.integers(0, 3)))

    def norms() -> mx.array:
        return mx.array(rng.uniform(0.5, 4.0, (*shape, 1)).astype(np.float16))

    def words(dim: int, bits: int) -> mx.array:
        width = index_width(dim, bits)
        return mx.array(rng.integers(0, 2**32, (*shape, width), dtype=np.uint32))

    return replace(
        spec,
        key_norms=norms(),
        key_indices=words(key_dim, key_bits),
        value_norms=norms(),
        value_indices=words(value_dim, value_bits),
        left_padding=mx.array(paddings, mx.int32) if padded else None,
        length=length,
        appended=appended,
        key_dim=key_dim,
        value_dim=value_dim,
    )
