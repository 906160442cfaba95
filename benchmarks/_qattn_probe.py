"""Diagnose kvstate.quantized_attention on this device (which inputs MLX CUDA refuses)."""
import mlx.core as mx

import kvstate as ks

dense = ks.DenseKV(mx.random.normal((1, 8, 1280, 128)), mx.random.normal((1, 8, 1280, 128)), None, 1025)
for name, options in (("4/4", {"bits": 4}), ("5/3", {"key_bits": 5, "value_bits": 3})):
    state = ks.eval(ks.quantize(dense, group_size=64, **options))
    print(name, "keys", [(a.shape, a.dtype) for a in state.keys], flush=True)
    base = mx.random.normal((1, 1, 8, 128))
    for label, q in (
        ("contiguous q", mx.random.normal((1, 8, 1, 128))),
        ("transposed q", base.transpose(0, 2, 1, 3)),
        ("contiguous(transposed q)", mx.contiguous(base.transpose(0, 2, 1, 3))),
    ):
        for mask in (None, "causal"):
            try:
                mx.eval(ks.quantized_attention(q, state, scale=0.1, mask=mask))
                print(name, label, mask, "ok", flush=True)
            except Exception as error:  # noqa: BLE001
                print(name, label, mask, "FAILED", str(error)[:150], flush=True)

# The decode path: print what reaches mx.quantized_matmul in a wrapped model's step.
from kvstate.adapters import wrap  # noqa: E402
from kvstate.adapters.tiny_models import tiny_model  # noqa: E402

real = mx.quantized_matmul


def spy(x, w, scales, biases=None, **kw):
    print("qmm x", x.shape, x.dtype, "w", w.shape, w.dtype, "scales", scales.shape, scales.dtype,
          "biases", None if biases is None else (biases.shape, biases.dtype), kw, flush=True)
    out = real(x, w, scales, biases, **kw)
    try:
        mx.eval(out)
        print("  ok", flush=True)
    except Exception as error:  # noqa: BLE001
        print("  FAILED", str(error)[:120], flush=True)
        for label, fixed in (("contiguous x", (mx.contiguous(x), w, scales, biases)),
                             ("contiguous all", tuple(mx.contiguous(a) for a in (x, w, scales, biases)))):
            try:
                mx.eval(real(*fixed, **kw))
                print("  with", label, "ok", flush=True)
            except Exception as again:  # noqa: BLE001
                print("  with", label, "FAILED", str(again)[:80], flush=True)
    return out


mx.quantized_matmul = spy
model = tiny_model("llama", head_dim=128, hidden_size=512, num_attention_heads=8,
                   num_key_value_heads=8, num_hidden_layers=1)
m = wrap(model)
_, state = m(mx.array([list(range(1, 200))]), m.init_state())
state = ks.eval(ks.quantize(state, group_size=64, key_bits=5, value_bits=3))
logits, state = m(mx.array([[7]]), state)
mx.eval(logits)
