"""The hypothesis strategy of `QuantizedRotatingKV` (quantized sliding windows)."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from .._quantized import QuantizedKV
from .._quantized_rotating import QuantizedRotatingKV, quantize_window
from ._strategies import (
    DTYPES,
    QUANT_BITS,
    ROTATION_KINDS,
    Knob,
    _knob,
    rotating_kv_states,
    strategy_for,
)


@strategy_for(QuantizedRotatingKV)
@st.composite
def quantized_rotating_kv_states(
    draw: Any,
    *,
    k_dim: Knob = None,
    v_dim: Knob = None,
    dtype: Knob = None,
    key_bits: Knob = None,
    value_bits: Knob = None,
    group_size: Knob = None,
    rotation: Knob = None,
    seed: Knob = None,
    **window_knobs: Knob,
) -> QuantizedRotatingKV:
    """A `QuantizedRotatingKV`: a window drawn by `rotating_kv_states` (forward by forward,
    as mlx-lm's window caches make one; the same knobs: batch, padded, heads, max_size,
    keep, empty, appended pass through), every slot of it and of its `previous` quantized
    by the drawn codec.

    Draws: head dims in {8, 16, 32} (zero-channel pads up to the group size), key and value
    bits in `QUANT_BITS` (independently), group size in {32, 64} for both sides, rotation in
    `ROTATION_KINDS` with a seed in 0..3, dtype in `DTYPES` (the scales' dtype).
    """
    dims = st.sampled_from([8, 16, 32])
    k_dim = _knob(draw, k_dim, dims)
    v_dim = _knob(draw, v_dim, dims)
    dtype = _knob(draw, dtype, st.sampled_from(DTYPES))
    window = draw(rotating_kv_states(k_dim=k_dim, v_dim=v_dim, dtype=dtype, **window_knobs))
    group = _knob(draw, group_size, st.sampled_from([32, 64]))
    spec = QuantizedKV(
        key_bits=_knob(draw, key_bits, st.sampled_from(QUANT_BITS)),
        value_bits=_knob(draw, value_bits, st.sampled_from(QUANT_BITS)),
        key_group_size=group,
        value_group_size=group,
        rotation=_knob(draw, rotation, st.sampled_from(ROTATION_KINDS)),
        seed=_knob(draw, seed, st.integers(0, 3)),
    )
    return quantize_window(window, spec)
