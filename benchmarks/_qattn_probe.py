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
