"""QuantizedRotatingKV (quantized sliding windows) against its references.

- Transforms: every transform of a quantized window, dequantized, is the same transform of
  the dequantized window (a RotatingKV, itself checked against mlx-lm's window caches by
  test_rotating_machine): `dequantized(T(q)) == T(dequantized(q))`, bit for bit.
- Forwards: a forward into the quantized window's cache object (QuantizedRotatingCache) holds,
  dequantized, what mlx-lm's RotatingKVCache / BatchRotatingKVCache holds after the same
  forward of the dequantized window with quantized-and-dequantized new entries; and kvstate's
  quantized attention over it equals `mx.fast.scaled_dot_product_attention` over mlx-lm's
  window with mlx-lm's mask (rings that wrap, multi-token forwards past the window, left
  padding, keep prefixes, GQA).
- Files and caches: save/load and to_mlx_lm/from_mlx_lm give the state back bit for bit.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import mlx.core as mx
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

import kvstate as ks
from kvstate.adapters import from_mlx_lm, to_mlx_lm
from kvstate.kinds import replace
from kvstate.quantization import dequantized, key_codec, value_codec
from kvstate.testing import (
    QUANT_BITS,
    ROTATION_KINDS,
    accepted_counts,
    assert_states_equal,
    quantized_rotating_kv_states,
)


def _same(actual: Any, expected: Any) -> None:
    assert_states_equal(ks.eval(actual), ks.eval(expected))


@given(state=quantized_rotating_kv_states(), data=st.data())
def test_every_transform_commutes_with_dequantizing(state, data):
    ks.check(state)
    plain = dequantized(state)
    batch = ks.batch_size(state)
    pairs = [(ks.snapshot(state), ks.snapshot(plain))]
    if not (state.keep and state.keys is None):
        n = data.draw(st.integers(1, 3), label="tile")
        rows = data.draw(st.lists(st.integers(-batch, batch - 1), min_size=1, max_size=3))
        row = data.draw(st.integers(-batch, batch - 1), label="row")
        pairs += [
            (ks.tile(state, n), ks.tile(plain, n)),
            (ks.row_select(state, rows), ks.row_select(plain, rows)),
            (ks.filter(state, rows), ks.filter(plain, rows)),
            (ks.extract(state, row), ks.extract(plain, row)),
        ]
    if not state.keep:
        pairs += [
            (ks.merge([state, state]), ks.merge([plain, plain])),
            (ks.extend(state, state), ks.extend(plain, plain)),
        ]
    accepted = data.draw(accepted_counts(state), label="accepted")
    pairs.append((ks.commit_prefix(state, accepted), ks.commit_prefix(plain, accepted)))
    for quantized, reference in pairs:
        ks.check(quantized)
        _same(dequantized(quantized), reference)


@st.composite
def two_to_merge(draw: Any) -> tuple[Any, Any]:
    """Two single-row windows of one configuration (codec, window, head dims)."""
    knobs = {
        "batch": 1,
        "heads": 1,
        "k_dim": 8,
        "v_dim": 16,
        "dtype": mx.float32,
        "max_size": draw(st.integers(2, 6)),
        "keep": 0,
        "key_bits": draw(st.sampled_from(QUANT_BITS)),
        "value_bits": draw(st.sampled_from(QUANT_BITS)),
        "group_size": 32,
        "rotation": draw(st.sampled_from(ROTATION_KINDS)),
        "seed": draw(st.integers(0, 3)),
    }
    appended = draw(st.integers(0, 2))
    a = draw(quantized_rotating_kv_states(**knobs, appended=appended))
    b = draw(quantized_rotating_kv_states(**knobs, appended=draw(st.sampled_from([0, appended]))))
    return a, b


@given(pair=two_to_merge(), data=st.data())
def test_merge_extend_and_ragged_commit_of_different_windows(pair, data):
    a, b = pair
    da, db = dequantized(a), dequantized(b)
    merged, plain = ks.merge([a, b]), ks.merge([da, db])
    _same(dequantized(merged), plain)
    _same(dequantized(ks.extend(merged, a)), ks.extend(plain, da))
    accepted = data.draw(accepted_counts(merged), label="accepted")
    _same(dequantized(ks.commit_prefix(merged, accepted)), ks.commit_prefix(plain, accepted))


@given(state=quantized_rotating_kv_states())
def test_save_load_and_mlx_lm_round_trips(state):
    # A cache object holds no pending forward: from_mlx_lm gives the window without one.
    _same(from_mlx_lm(to_mlx_lm(state)), replace(state, previous=None, appended=0))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "w.safetensors")
        ks.save(path, state)
        _same(ks.load(path), state)


def _round_trip(codec: Any, x: mx.array) -> mx.array:
    return codec.decode(codec.encode(x))


@given(
    state=quantized_rotating_kv_states(dtype=mx.float32, empty=False, appended=0),
    n=st.integers(1, 4),
    repeats=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**31),
)
def test_a_forward_and_its_attention_match_mlx_lm_on_the_dequantized_window(
    state, n, repeats, seed
):
    """One forward of n tokens: the cache's window (dequantized) is mlx-lm's, and kvstate's
    quantized attention over it is mlx-lm's fp attention with mlx-lm's mask."""
    rng = np.random.default_rng(seed)
    assert state.keys is not None and state.values is not None
    batch, heads = int(state.keys[0].shape[0]), int(state.keys[0].shape[1])
    kc, vc = key_codec(state), value_codec(state)
    dk, dv = kc.dim(state.keys), vc.dim(state.values)

    def normal(*shape: int) -> mx.array:
        return mx.array(rng.standard_normal(shape).astype(np.float32))

    k, v, q = (
        normal(batch, heads, n, dk),
        normal(batch, heads, n, dv),
        normal(batch, heads * repeats, n, dk),
    )
    quantized_cache = to_mlx_lm(state)
    reference_cache = to_mlx_lm(dequantized(state))
    mask_q = quantized_cache.make_mask(n)
    mask_r = reference_cache.make_mask(n)
    qk, qv = quantized_cache.update_and_fetch(k, v)
    rk, rv = reference_cache.update_and_fetch(_round_trip(kc, k), _round_trip(vc, v))
    # The window: slot for slot mlx-lm's (quantizing a slot commutes with moving it).
    after = from_mlx_lm(quantized_cache)
    _same(dequantized(after), from_mlx_lm(reference_cache))
    # The attention: packed, through kvstate's quantized_attention, against mlx-lm's.
    scale = dk**-0.5
    out = quantized_cache.attend(q, qk, qv, scale, mask_q)
    expected = mx.fast.scaled_dot_product_attention(q, rk, rv, scale=scale, mask=mask_r)
    np.testing.assert_allclose(np.array(out), np.array(expected), rtol=2e-4, atol=2e-4)
