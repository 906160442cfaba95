"""Hypothesis strategies for every kvstate state, so you can property-test your own decoders.

    from hypothesis import given, strategies as st
    from kvstate.testing import accepted_counts, dense_kv_states

    @given(st.data())
    def test_my_decoder(data):
        state = data.draw(dense_kv_states(batch=2, padded=True))
        accepted = data.draw(accepted_counts(state))
        ...

Every strategy draws *small* shapes (batch <= 3, heads <= 2, head dims <= 8 or one or two
quantization groups, a dozen or so positions) so that hundreds of examples run in seconds.
States are what the matching mlx-lm cache could hold after real forwards (windows are
built forward by forward with mlx-lm's own update rule), with `appended` set as after the
last forward, so `commit_prefix` applies; `accepted_counts` draws counts it accepts.
Array contents are random normal numbers from a drawn seed (hypothesis does not shrink
them; it shrinks the shapes, lengths, paddings and counts). Buffer positions that no row
uses (capacity past the length, left padding) hold garbage on purpose: code that reads
them is wrong, and garbage makes that visible.

Each strategy accepts a fixed value or a strategy for each of its knobs; `None` means
"draw it". Fix the knobs that must agree when you combine states (`merge`, `extend`):
kind, dtype, heads, head dims, bits, group size, window.

This package needs hypothesis (the `test` extra); `import kvstate` never imports it.

Assertions for your own tests: `assert_states_equal(actual, expected)` (bit for bit) and
`assert_states_allclose(actual, expected, rtol=, atol=)` compare kind, structure, statics
and arrays, and report every mismatch by its path; `frozen_copy(state)` keeps an evaluated
copy to prove later that nothing changed a state in place.

A new kind registers its strategy with `strategy_for(Kind)`; `layer_states` then draws it.
"""

from ._assertions import assert_states_allclose, assert_states_equal, frozen_copy
from ._pooled_strategy import pooled_kv_states
from ._quantized_window_strategy import quantized_rotating_kv_states
from ._strategies import (
    DTYPES,
    QUANT_BITS,
    ROTATION_KINDS,
    STRATEGIES,
    LayerStrategy,
    accepted_counts,
    chunked_kv_states,
    dense_kv_states,
    layer_states,
    list_states,
    model_states,
    quantized_kv_states,
    recurrent_checkpoints,
    recurrent_states,
    rotating_kv_states,
    strategy_for,
)
from ._turboquant_strategy import turboquant_kv_states
from ._vlm_window_strategies import (
    buffered_update,
    buffered_window_kv_states,
    static_prefix_kv_states,
)

__all__ = [
    "DTYPES",
    "QUANT_BITS",
    "ROTATION_KINDS",
    "STRATEGIES",
    "LayerStrategy",
    "accepted_counts",
    "assert_states_allclose",
    "assert_states_equal",
    "buffered_update",
    "buffered_window_kv_states",
    "chunked_kv_states",
    "dense_kv_states",
    "frozen_copy",
    "layer_states",
    "list_states",
    "model_states",
    "pooled_kv_states",
    "quantized_kv_states",
    "quantized_rotating_kv_states",
    "recurrent_checkpoints",
    "recurrent_states",
    "rotating_kv_states",
    "static_prefix_kv_states",
    "strategy_for",
    "turboquant_kv_states",
]
