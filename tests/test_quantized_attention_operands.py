"""The forms of the matrices `kvstate.quantized_attention` hands to `mx.quantized_matmul`.

MLX CUDA 0.32's quantized_matmul raises "No implementation for problem shape" for a matrix
that is not contiguous (a cache buffer cut at `length` < capacity) and, for a broadcast one
(GQA keys repeated by a stride-0 axis), reads batch 0 for every batch. The CPU accepts both,
so these tests check the forms themselves (strides through the buffer protocol) on the CPU,
and the results against the NumPy dequantize-then-attend oracle.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import kvstate as ks
from tests.test_quantized_options import f64, reference_attention


def _spy_on_quantized_matmul(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """Record (x shape, w shape, whether w / scales / biases are row-contiguous) per call."""
    calls: list[tuple] = []
    original = mx.quantized_matmul

    def spy(x, w, scales, biases, **kw):
        mx.eval(w, scales, biases)
        contiguous = tuple(memoryview(a).c_contiguous for a in (w, scales, biases))
        calls.append((tuple(x.shape), tuple(w.shape), contiguous))
        return original(x, w, scales, biases, **kw)

    monkeypatch.setattr(mx, "quantized_matmul", spy)
    return calls


def _state_with_room(repeats_rng: int, B: int, H: int, S: int, dim: int) -> ks.QuantizedKV:
    """A QuantizedKV whose buffers hold 7 positions past `length` (rejected draft rows, as a
    commit leaves them): the used part is a cut of the buffer."""
    rng = np.random.default_rng(repeats_rng)
    keys = mx.array(rng.standard_normal((B, H, S + 7, dim)).astype(np.float32))
    values = mx.array(rng.standard_normal((B, H, S + 7, dim)).astype(np.float32))
    full = ks.quantize(ks.DenseKV(keys, values, length=S + 7, appended=7), key_bits=5, value_bits=3)
    state = ks.commit_prefix(full, 0)
    assert state.length == S and state.keys[0].shape[2] == S + 7
    return state


@pytest.mark.parametrize("repeats", [1, 2, 4])
@pytest.mark.parametrize("L", [1, 5])
def test_operands_are_contiguous_and_never_broadcast(monkeypatch, repeats, L):
    B, H, S, dim = 2, 2, 11, 64
    state = _state_with_room(repeats * 10 + L, B, H, S, dim)
    rng = np.random.default_rng(L)
    queries = mx.array(rng.standard_normal((B, H * repeats, L, dim)).astype(np.float32))
    calls = _spy_on_quantized_matmul(monkeypatch)
    out = ks.quantized_attention(queries, state, scale=dim**-0.5, mask="causal")
    mx.eval(out)
    assert len(calls) == 2  # scores (keys) and output (values)
    for x_shape, w_shape, contiguous in calls:
        assert contiguous == (True, True, True)
        assert x_shape[:-2] == w_shape[:-2] == (B, H)  # batch dims equal: nothing broadcast
    np.testing.assert_allclose(
        f64(out), reference_attention(queries, state, dim**-0.5, "causal"), atol=2e-3
    )


@pytest.mark.parametrize("mask_shape", [(1, 1, 3, 11), (2, 8, 3, 11), (3, 11), (8, 3, 11)])
def test_gqa_masks_of_every_broadcastable_shape(mask_shape):
    """Masks broadcastable to (B, n_heads, L, S), 2-, 3- and 4-D, reach the right head rows
    (head h = kv * repeats + r) after the repeats are folded into the query rows."""
    B, H, S, dim, repeats, L = 2, 2, 11, 64, 4, 3
    state = _state_with_room(7, B, H, S, dim)
    rng = np.random.default_rng(3)
    queries = mx.array(rng.standard_normal((B, H * repeats, L, dim)).astype(np.float32))
    for mask in (
        mx.array(rng.random(mask_shape) > 0.4) | (mx.arange(S) == 0),
        mx.array(rng.standard_normal(mask_shape).astype(np.float32)),
    ):
        out = ks.quantized_attention(queries, state, scale=dim**-0.5, mask=mask)
        np.testing.assert_allclose(
            f64(out), reference_attention(queries, state, dim**-0.5, mask), atol=2e-3
        )


def test_queries_of_another_batch_size_are_refused():
    state = _state_with_room(1, 2, 2, 5, 64)
    with pytest.raises(ks.ShapeError, match="batch"):
        ks.quantized_attention(mx.zeros((1, 4, 1, 64)), state, scale=0.125)
