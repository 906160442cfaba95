"""A QuantizedKV in mlx-lm's form (a QuantizedKVCache at the model boundary) is read by
kvstate's quantized attention where mlx-lm's own reads it wrongly (MLX CUDA 0.32: keys
broadcast over the GQA repeats and buffers cut at the offset; BENCHMARKS.md, Findings 0).

This machine has no GPU, so the device check is forced: the forced route must give mlx-lm's
own attention's logits on the CPU (the oracle), and must really have been taken."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import kvstate as ks
from kvstate.adapters import wrap
from kvstate.adapters.instruments import routing
from kvstate.adapters.tiny_models import tiny_model

PROMPT = [3, 17, 42, 99, 7, 250, 31, 8, 1, 2, 3, 4, 9, 10, 11, 12]


def counting(owner, name: str, monkeypatch) -> list[int]:
    """Replace `owner.name` by a copy that records each call in the returned list."""
    calls: list[int] = []
    original = getattr(owner, name)

    def counted(*args, **kw):
        calls.append(kw.get("group_size", 0))
        return original(*args, **kw)

    monkeypatch.setattr(owner, name, counted)
    return calls


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", head_dim=64)  # 4 query heads on 2 KV heads: GQA


def teacher_forced_logits(model, bits: int, group_size: int) -> list[np.ndarray]:
    """Logits of a chunked read of PROMPT, then three one-token steps, on a quantized state."""
    m = wrap(model)
    state = ks.quantize(m.init_state(), bits=bits, group_size=group_size)
    out = []
    for piece in (PROMPT[:9], PROMPT[9:], [5], [6], [7]):
        logits, state = m(mx.array([piece]), state)
        out.append(np.array(logits.astype(mx.float32)))
    return out


@pytest.mark.parametrize(("bits", "group_size"), [(4, 32), (4, 64), (8, 64)])
def test_forced_route_gives_mlx_lm_attentions_logits(model, bits, group_size, monkeypatch):
    oracle = teacher_forced_logits(model, bits, group_size)  # mlx-lm's attention (CPU)

    monkeypatch.setattr(routing, "mlx_lm_quantized_attention_is_right", lambda: False)
    calls = counting(routing, "quantized_attention", monkeypatch)
    routed = teacher_forced_logits(model, bits, group_size)

    assert len(calls) >= 5 * 4, "kvstate's attention was not used for every layer and call"
    for want, got in zip(oracle, routed, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(mx.default_device().type == mx.DeviceType.gpu, reason="a CPU check")
def test_on_the_cpu_mlx_lm_form_states_keep_mlx_lm_attention(model, monkeypatch):
    """Where mlx-lm's attention is right it stays the one that reads (its exact numbers)."""
    calls = counting(routing, "quantized_attention", monkeypatch)
    teacher_forced_logits(model, 4, 32)
    assert calls == []


@pytest.mark.parametrize("options", [{"bits": 4}, {"key_bits": 4, "value_bits": 3}])
def test_one_group_rows_read_through_their_dequantized_form(options, monkeypatch):
    """On a GPU a head-dim-64, group-64 state (one group a row, which MLX CUDA's kernel
    misreads) is read as its dequantized matrices: the same attention, without the kernel."""
    from kvstate import _quantized_attention as qa

    mx.random.seed(3)
    k, v = (mx.random.normal((2, 2, 40, 64)) for _ in range(2))
    q = mx.random.normal((2, 4, 5, 64))
    state = ks.quantize(ks.DenseKV(k, v, length=40), group_size=64, **options)
    want = ks.quantized_attention(q, state, scale=0.125, mask="causal")

    monkeypatch.setattr(qa, "one_group_rows_read_wrongly", lambda: True)
    kernel_calls = counting(qa.mx, "quantized_matmul", monkeypatch)
    got = ks.quantized_attention(q, state, scale=0.125, mask="causal")
    assert kernel_calls == []
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5)
