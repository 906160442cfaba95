"""The hypothesis strategy of `TurboQuantKV` (mlx-vlm's TurboQuant caches, MSE and Split)."""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
import numpy as np
from hypothesis import strategies as st

from .._tree import replace
from .._turboquant import TurboQuantKV, index_width, is_split, split_sizes
from ._strategies import _SEEDS, Knob, _empty_padded, _knob, _padded_rows, strategy_for

TURBOQUANT_DRAWN_BITS = (2, 3, 4, 2.5, 3.5)
"""The bit widths `turboquant_kv_states` draws: integer (MSE) and x.5 (Split)."""


def high_channels_for(draw: Any, dim: int, bits: float) -> tuple[int, ...] | None:
    """A split side's high channels as mlx-vlm could choose them (a sorted subset of the
    right size); None for an integer side."""
    if not is_split(bits):
        return None
    _, high = split_sizes(dim, bits)
    chosen = draw(st.permutations(range(dim)))[:high]
    return tuple(sorted(chosen))


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
    key_channels: Knob = None,
    value_channels: Knob = None,
    form: Knob = None,
    key_scheme: Knob = None,
    value_scheme: Knob = None,
    group_size: Knob = None,
    seed: Knob = None,
    padded: Knob = None,
    max_length: int = 10,
    length: Knob = None,
    empty: Knob = None,
    appended: Knob = None,
) -> TurboQuantKV:
    """A `TurboQuantKV`.

    Draws: batch in 1..3; heads in 1..2; key / value head dims in {8, 12, 16} (powers of two
    take mlx-vlm's Hadamard path, others its dense rotation); key / value bits in
    `TURBOQUANT_DRAWN_BITS` (x.5: the Split layout, with high channels drawn unless
    `key_channels` / `value_channels` fix them: states to be merged must share them); seed in
    0..3; `form` "turboquant" unless given: with `form="hybrid"` (HybridQuantKVCache) each
    side's scheme is drawn ("turboquant" or "uniform": mx.quantize's packed words, float16
    scales and biases at `group_size` (default 32; 64, mlx-vlm's default, for other forms),
    bits in 2, 3, 4, 8; pass head dims that the group size divides), and `policy_bits` is
    4.0; `padded`: per-row left padding; length in 1..max_length (or empty with
    `empty=True`); spare capacity past the length (garbage); `appended` in 0..min(row
    lengths). Norms are random positive float16 and indices random uint32 words: every
    word is a valid packing (each field is < 2**bits), so mlx-vlm's codec decodes any draw.
    """
    batch = _knob(draw, batch, st.integers(1, 3))
    heads = _knob(draw, heads, st.integers(1, 2))
    key_dim = _knob(draw, key_dim, st.sampled_from([8, 12, 16]))
    value_dim = _knob(draw, value_dim, st.sampled_from([8, 12, 16]))
    key_bits = _knob(draw, key_bits, st.sampled_from(TURBOQUANT_DRAWN_BITS))
    value_bits = _knob(draw, value_bits, st.sampled_from(TURBOQUANT_DRAWN_BITS))
    seed = _knob(draw, seed, st.integers(0, 3))
    padded = _knob(draw, padded, st.booleans())
    appended = _knob(draw, appended, st.none())
    form = _knob(draw, form, st.just("turboquant"))
    schemes = st.sampled_from(["turboquant", "uniform"] if form == "hybrid" else ["turboquant"])
    key_scheme = _knob(draw, key_scheme, schemes)
    value_scheme = _knob(draw, value_scheme, schemes)
    group_size = _knob(draw, group_size, st.just(32 if form == "hybrid" else 64))
    uniform_bits = st.sampled_from([2, 3, 4, 8])
    if key_scheme == "uniform" and (is_split(key_bits) or key_bits not in (2, 3, 4, 8)):
        key_bits = draw(uniform_bits)
    if value_scheme == "uniform" and (is_split(value_bits) or value_bits not in (2, 3, 4, 8)):
        value_bits = draw(uniform_bits)
    spec = TurboQuantKV(
        key_bits=key_bits,
        value_bits=value_bits,
        seed=seed,
        form=form,
        key_scheme=key_scheme,
        value_scheme=value_scheme,
        group_size=group_size,
        policy_bits=4.0 if form == "hybrid" else 0.0,
    )
    rows = _padded_rows(draw, batch, padded, length, empty, appended, max_length)
    if rows is None:
        return _empty_padded(spec, batch, padded)
    length, paddings, appended = rows
    rng = np.random.default_rng(draw(_SEEDS))
    shape = (batch, heads, length + draw(st.integers(0, 3)))

    def norms() -> mx.array:
        return mx.array(rng.uniform(0.5, 4.0, (*shape, 1)).astype(np.float16))

    def words(dim: int, bits: int) -> mx.array:
        width = index_width(dim, bits)
        return mx.array(rng.integers(0, 2**32, (*shape, width), dtype=np.uint32))

    def scales(dim: int) -> mx.array:
        return mx.array(rng.standard_normal((*shape, dim // group_size)).astype(np.float16))

    fields: dict[str, Any] = {}
    for side, dim, bits, channels, scheme in (
        ("key", key_dim, key_bits, key_channels, key_scheme),
        ("value", value_dim, value_bits, value_channels, value_scheme),
    ):
        if scheme == "uniform":  # mx.quantize's triple: any words unpack to valid levels
            packed = rng.integers(0, 2**32, (*shape, dim * int(bits) // 32), dtype=np.uint32)
            fields |= {f"{side}_indices": mx.array(packed)}
            fields |= {f"{side}_scales": scales(dim), f"{side}_biases": scales(dim)}
            continue
        if not is_split(bits):
            fields |= {f"{side}_norms": norms(), f"{side}_indices": words(dim, int(bits))}
            continue
        low, high = split_sizes(dim, bits)
        chosen = channels if channels is not None else high_channels_for(draw, dim, bits)
        assert chosen is not None
        fields |= {
            f"{side}_norms": norms(),
            f"{side}_indices": words(low, math.floor(bits)),
            f"{side}_high_norms": norms(),
            f"{side}_high_indices": words(high, math.ceil(bits)),
            f"{side}_high_channels": mx.array(chosen, mx.int32),
        }
    return replace(
        spec,
        **fields,
        left_padding=mx.array(paddings, mx.int32) if padded else None,
        length=length,
        appended=appended,
        key_dim=key_dim,
        value_dim=value_dim,
    )
