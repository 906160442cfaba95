"""Quality and decode speed of QuantizedKV's options (issue 9).

Part 1, per method: bytes per element (packed words, scales and biases), key and value
relative error ||x^ - x|| / ||x||, and attention-output relative error of
`kvstate.quantized_attention` against float32 attention on the unquantized K/V, on Gaussian
K/V and on K/V with 4 channels scaled x10, shape (1, 8, 1024, 128), 16 Gaussian queries.
Part 2: next-token KL(fp16 || quantized) and top-1 agreement against an fp16 dense state on
a random-init llama (float16, head_dim 128), teacher-forced over 48 tokens after a 256-token
prompt. Part 3: decode-step time of the wrapped model with asymmetric states against mlx-lm's
QuantizedKVCache at equal memory (K5/V3 vs 4 bits, K8/V4 vs 6, K4/V2 vs 3: the same bits per
key+value pair, same scales), interleaved, with the paired ratio (float32: the CPU has no
fast float16).

    python benchmarks/quantized_quality.py [--context 1024] [--steps 24] [--reps 5]
        [--parts quality,model,kernels,decode]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

import kvstate as ks
import kvstate.quantization
from kvstate.adapters import wrap
from kvstate.adapters.tiny_models import tiny_model

METHODS: list[tuple[str, dict[str, Any]]] = [
    ("affine K4/V4 g64", {"bits": 4, "group_size": 64}),
    ("affine K8/V8 g64", {"bits": 8, "group_size": 64}),
    ("affine K4/V3 g64", {"key_bits": 4, "value_bits": 3, "group_size": 64}),
    ("so4 K4/V3 g64", {"key_bits": 4, "value_bits": 3, "group_size": 64, "rotation": "so4"}),
    ("hadamard K4/V4 g64", {"bits": 4, "group_size": 64, "rotation": "hadamard"}),
    (
        "hadamard K4/V3 g64",
        {"key_bits": 4, "value_bits": 3, "group_size": 64, "rotation": "hadamard"},
    ),
    ("hadamard K3/V3 g64", {"bits": 3, "group_size": 64, "rotation": "hadamard"}),
    ("hadamard K2/V2 g32", {"bits": 2, "group_size": 32, "rotation": "hadamard"}),
]


def rel(a: mx.array, b: mx.array) -> float:
    x, y = np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32))
    return float(np.linalg.norm(x - y) / np.linalg.norm(y))


def kv_data(outliers: bool) -> tuple[mx.array, mx.array, mx.array]:
    rng = np.random.default_rng(0)
    k, v = (rng.standard_normal((1, 8, 1024, 128)).astype(np.float32) for _ in range(2))
    if outliers:
        channels = rng.choice(128, size=4, replace=False)
        k[..., channels] *= 10
        v[..., channels] *= 10
    q = rng.standard_normal((1, 8, 16, 128)).astype(np.float32)
    return mx.array(q), mx.array(k), mx.array(v)


def quality_rows() -> None:
    print("| method | bytes/elem K | bytes/elem V | data | key err | value err | attention err |")
    print("|---|---|---|---|---|---|---|")
    for name, options in METHODS:
        for outliers in (False, True):
            q, k, v = kv_data(outliers)
            state = ks.quantize(ks.DenseKV(k, v, length=1024), **options)
            kc, vc = ks.quantization.key_codec(state), ks.quantization.value_codec(state)
            k_hat, v_hat = kc.decode(state.keys), vc.decode(state.values)
            scale = 128**-0.5
            exact = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=None)
            approx = ks.quantized_attention(q, state, scale=scale)
            per = k.size
            kb = sum(a.nbytes for a in state.keys) / per
            vb = sum(a.nbytes for a in state.values) / per
            data = "outliers x10" if outliers else "Gaussian"
            print(
                f"| {name} | {kb:.3f} | {vb:.3f} | {data} | {rel(k_hat, k):.3f} | "
                f"{rel(v_hat, v):.3f} | {rel(approx, exact):.3f} |",
                flush=True,
            )


def turboquant_rows() -> None:
    """mlx-vlm's TurboQuant-MSE (keys and values at `bits`, seed 0) on the same data, decoded
    twice: by kvstate's TurboQuantKV (from_mlx_vlm, codecs rebuilt from its statics) and by
    mlx-vlm's own cache; attention through mlx-vlm's quantized_attention on the cache made back
    from the state. The two error columns must agree exactly (issue 9)."""
    from mlx_vlm import turboquant as tq

    from kvstate.adapters._vlm_turboquant import codecs
    from kvstate.adapters.vlm import from_mlx_vlm, to_mlx_vlm

    print(
        "\n| method | bytes/elem K | data | key err (state) | key err (mlx-vlm) | value err "
        "| attention err |"
    )
    print("|---|---|---|---|---|---|---|")
    for bits in (4, 3, 2):
        for outliers in (False, True):
            q, k, v = kv_data(outliers)
            cache = tq.TurboQuantKVCache(bits, seed=0)
            cache.update_and_fetch(k, v)
            state = from_mlx_vlm(cache)
            kc, vc = codecs(state)
            k_hat = kc.dequantize(tq.TurboQuantMSEState(state.key_norms[..., 0], state.key_indices))
            v_hat = vc.dequantize(
                tq.TurboQuantMSEState(state.value_norms[..., 0], state.value_indices)
            )
            theirs = cache.dequantize()[0]
            kb = (state.key_norms.nbytes + state.key_indices.nbytes) / k.size
            data = "outliers x10" if outliers else "Gaussian"
            back = to_mlx_vlm(state)
            exact = mx.fast.scaled_dot_product_attention(q, k, v, scale=128**-0.5, mask=None)
            approx = back.quantized_attention(q, scale=128**-0.5)
            print(
                f"| TurboQuant-MSE K{bits}/V{bits} | {kb:.3f} | {data} | {rel(k_hat, k):.3f} | "
                f"{rel(theirs, k):.3f} | {rel(v_hat, v):.3f} | {rel(approx, exact):.3f} |",
                flush=True,
            )


def model_rows() -> None:
    model = tiny_model(
        "llama",
        head_dim=128,
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=4,
        dtype=mx.float16,
        scale=2.0,
    )
    m = wrap(model)
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, 256, 256).tolist()
    follow = rng.integers(0, 256, 48).tolist()
    _, dense = m(mx.array([prompt]), m.init_state())
    ref, _ = m(mx.array([follow]), dense)
    p = mx.softmax(ref[0].astype(mx.float32), axis=-1)
    print("\n| method | next-token KL (fp16 -> method) | top-1 agreement |")
    print("|---|---|---|")
    for name, options in METHODS:
        logits, _ = m(mx.array([follow]), ks.quantize(dense, **options))
        x = logits[0].astype(mx.float32)
        log_q = x - mx.logsumexp(x, axis=-1, keepdims=True)
        kl = mx.sum(p * (mx.log(p + 1e-30) - log_q), axis=-1).mean().item()
        top1 = (logits[0].argmax(-1) == ref[0].argmax(-1)).astype(mx.float32).mean().item()
        print(f"| {name} | {kl:.5f} | {top1:.3f} |", flush=True)


PAIRS = [  # (kvstate's asymmetric options, mlx-lm's bits): the same bits per key+value pair
    # K4/V4 through kvstate's attention (a batch of one with left padding): its overhead alone
    ({"key_bits": 4, "value_bits": 4, "left_padded": 1}, 4),
    ({"key_bits": 5, "value_bits": 3}, 4),
    ({"key_bits": 8, "value_bits": 4}, 6),
    ({"key_bits": 4, "value_bits": 2}, 3),
]


def decode_rows(context: int, steps: int, reps: int) -> None:
    model = tiny_model(
        "llama",
        head_dim=128,
        hidden_size=512,
        num_attention_heads=8,
        num_key_value_heads=8,
        num_hidden_layers=4,
    )
    m = wrap(model)
    prompt = mx.array([np.random.default_rng(2).integers(0, 256, context).tolist()])
    _, dense = m(prompt, m.init_state())
    ks.eval(dense)
    token = mx.array([[7]])

    def ours(options: dict[str, int]) -> float:
        options = dict(options)
        source = ks.merge([dense]) if options.pop("left_padded", 0) else dense
        state = ks.eval(ks.quantize(source, group_size=64, **options))
        start = time.perf_counter()
        for _ in range(steps):
            logits, state = m(token, state)
            mx.eval(logits, ks.tree_flatten(state)[0])
        return (time.perf_counter() - start) / steps

    def theirs(bits: int) -> float:
        caches = make_prompt_cache(model)
        model(prompt, cache=caches)
        caches = [c.to_quantized(group_size=64, bits=bits) for c in caches]
        mx.eval([a for c in caches for a in (*c.keys, *c.values)])
        start = time.perf_counter()
        for _ in range(steps):
            logits = model(token, cache=caches)
            mx.eval(logits, [a for c in caches for a in (*c.keys, *c.values)])
        return (time.perf_counter() - start) / steps

    print(f"\ndecode step, context {context}, {steps} steps per rep, float32")
    print("| kvstate | mlx-lm | kvstate ms/step | mlx-lm ms/step | throughput ratio |")
    print("|---|---|---|---|---|")
    for options, bits in PAIRS:
        try:
            ours(options), theirs(bits)  # warm up (routing, first allocations)
        except RuntimeError as error:  # MLX CUDA lacks some quantized_matmul shapes
            print(f"| {options} | {bits}-bit | not run: {str(error)[:120]} | | |", flush=True)
            continue
        pairs = []
        for r in range(reps):
            if r % 2 == 0:
                a = ours(options)
                b = theirs(bits)
            else:
                b = theirs(bits)
                a = ours(options)
            pairs.append((a, b))
        ratio = statistics.median(b / a for a, b in pairs)
        name = f"K{options['key_bits']}/V{options['value_bits']}"
        name += " (left-padded)" if options.get("left_padded") else ""
        print(
            f"| {name} | {bits}-bit | {statistics.median(a for a, _ in pairs) * 1e3:.2f} | "
            f"{statistics.median(b for _, b in pairs) * 1e3:.2f} | {ratio:.2f}x |",
            flush=True,
        )
    print(f"(ratio: median over {reps} paired reps of mlx-lm time / kvstate time)")


def kernel_rows(context: int, reps: int = 50) -> None:
    """What one decode step's two quantized matmuls cost per bits (8 heads x 128, one query):
    the scores read keys with transpose=True, the output reads values with transpose=False."""
    q = mx.random.normal((1, 8, 1, 128))
    weights = mx.softmax(mx.random.normal((1, 8, 1, context)), axis=-1)
    data = mx.random.normal((1, 8, context, 128))
    print(f"\nmx.quantized_matmul, one query over {context} positions, group 64, ms per call")
    print("| bits | scores (keys, transpose=True) | output (values, transpose=False) |")
    print("|---|---|---|")
    for bits in ks.quantization.BITS:
        w = mx.quantize(data, group_size=64, bits=bits)
        mx.eval(w)
        times = []
        for x, transpose in ((q, True), (weights, False)):
            mx.eval(mx.quantized_matmul(x, *w, transpose=transpose, group_size=64, bits=bits))
            start = time.perf_counter()
            for _ in range(reps):
                mx.eval(mx.quantized_matmul(x, *w, transpose=transpose, group_size=64, bits=bits))
            times.append((time.perf_counter() - start) / reps)
        print(f"| {bits} | {times[0] * 1e3:.2f} | {times[1] * 1e3:.2f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--parts", default="quality,model,kernels,decode")
    args = parser.parse_args()
    parts = args.parts.split(",")
    print(f"mlx {mx.__version__}, {mx.default_device()}, {platform.machine()}\n")
    if "quality" in parts:
        quality_rows()
        turboquant_rows()
    if "model" in parts:
        model_rows()
    if "kernels" in parts:
        kernel_rows(args.context)
    if "decode" in parts:
        decode_rows(args.context, args.steps, args.reps)


if __name__ == "__main__":
    main()
