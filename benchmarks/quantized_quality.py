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
Part 2b (`windows`): the same on a random-init gemma3_text (float16, head_dim 256 as Gemma 3
270M, 5 sliding layers of window 64 to each global one, a 256-token prompt: every ring has
wrapped), the 48 follow-up tokens decoded one at a time (each ring slot rewritten in place),
with only the global layers quantized (all kvstate could do before QuantizedRotatingKV, and
more than mlx-lm can: it refuses the model) against every layer quantized, and the state's
bytes after the prompt.
Part 1b (`turboquant`, also run with `quality`): mlx-vlm's TurboQuantKVCache at integer (MSE)
and x.5 (Split) bits and HybridQuantKVCache on the same data, each error computed from
kvstate's TurboQuantKV and from mlx-vlm's own cache side by side.

    python benchmarks/quantized_quality.py [--context 1024] [--steps 24] [--reps 5]
        [--parts quality,turboquant,model,windows,kernels,decode]
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


TURBOQUANT_METHODS = [  # (name, TurboQuantKVCache key_bits, value_bits)
    ("TurboQuant-MSE K4/V4", 4, 4),
    ("TurboQuant-MSE K3/V3", 3, 3),
    ("TurboQuant-MSE K2/V2", 2, 2),
    ("TurboQuant-Split K3.5/V3.5", 3.5, 3.5),
    ("TurboQuant-Split K2.5/V2.5", 2.5, 2.5),
    ("TurboQuant-Split K3.5/V2.5", 3.5, 2.5),
]
HYBRID_METHODS = [  # (name, policy bits, group size, key scheme / bits, value scheme / bits)
    ("Hybrid K tq-Split3.5 / V uniform4 g64", 3.5, 64, "turboquant", 3.5, "uniform", 4),
    ("Hybrid K uniform8 g64 / V tq-MSE3", 3, 64, "uniform", 8, "turboquant", 3),
]


def _side_bytes(state: Any, side: str, per: int) -> float:
    parts = ("norms", "indices", "high_norms", "high_indices", "scales", "biases")
    found = [getattr(state, f"{side}_{p}") for p in parts]
    return sum(a.nbytes for a in found if a is not None) / per


def _decoded(state: Any, side: str) -> mx.array:
    """One side decoded from kvstate's state alone: codecs rebuilt from its statics (or
    mx.dequantize for a Hybrid cache's uniform side)."""
    from kvstate.adapters.caches.vlm.turboquant import codec_of, side_state

    if state.form == "hybrid" and getattr(state, f"{side}_scheme") == "uniform":
        packed, scales, biases = (
            getattr(state, f"{side}_{p}") for p in ("indices", "scales", "biases")
        )
        bits = int(getattr(state, f"{side}_bits"))
        return mx.dequantize(packed, scales, biases, group_size=state.group_size, bits=bits)
    return codec_of(state, side).dequantize(side_state(state, side))


def turboquant_rows() -> None:
    """mlx-vlm's TurboQuant caches (seed 0) fed the same data: TurboQuantKVCache at integer bits
    (MSE) and x.5 bits (Split: data-chosen high channels), and HybridQuantKVCache (one side
    TurboQuant, the other mx.quantize). Each error twice, side by side: decoded from kvstate's
    state (codecs rebuilt from its statics and channels) and by mlx-vlm's own cache; attention
    through the cache made back from the state and through mlx-vlm's original cache
    (TurboQuant: its quantized_attention; Hybrid: SDPA over its dequantized K/V, what its
    attention reads). The pairs must agree exactly (issue 9)."""
    from mlx_vlm import turboquant as tq
    from mlx_vlm.kv_quant import from_legacy

    from kvstate.adapters.vlm import from_mlx_vlm, to_mlx_vlm

    print(
        "\n| method | bytes/elem K | bytes/elem V | data | key err (state / mlx-vlm) "
        "| value err (state / mlx-vlm) | attention err (state / mlx-vlm) |"
    )
    print("|---|---|---|---|---|---|---|")
    scale = 128**-0.5

    def attention(cache: Any, q: mx.array) -> mx.array:
        if isinstance(cache, tq.HybridQuantKVCache):
            k_hat, v_hat = cache.dequantize()
            return mx.fast.scaled_dot_product_attention(q, k_hat, v_hat, scale=scale, mask=None)
        return cache.quantized_attention(q, scale=scale)

    made: list[tuple[str, Any]] = [
        (name, lambda kb=kb, vb=vb: tq.TurboQuantKVCache(3, seed=0, key_bits=kb, value_bits=vb))
        for name, kb, vb in TURBOQUANT_METHODS
    ]
    for name, bits, group, k_scheme, k_bits, v_scheme, v_bits in HYBRID_METHODS:
        policy = from_legacy(bits, "turboquant", group, k_bits, v_bits, k_scheme, v_scheme)
        made.append((name, lambda policy=policy: tq.HybridQuantKVCache(policy, seed=0)))
    for name, new_cache in made:
        for outliers in (False, True):
            q, k, v = kv_data(outliers)
            cache = new_cache()
            cache.update_and_fetch(k, v)
            state = from_mlx_vlm(cache)
            theirs_k, theirs_v = cache.dequantize()
            exact = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=None)
            ours_att, theirs_att = attention(to_mlx_vlm(state), q), attention(cache, q)
            pairs = [
                (rel(_decoded(state, "key"), k), rel(theirs_k, k)),
                (rel(_decoded(state, "value"), v), rel(theirs_v, v)),
                (rel(ours_att, exact), rel(theirs_att, exact)),
            ]
            data = "outliers x10" if outliers else "Gaussian"
            cells = " | ".join(f"{a:.3f} / {b:.3f}" for a, b in pairs)
            kb, vb = _side_bytes(state, "key", k.size), _side_bytes(state, "value", v.size)
            print(f"| {name} | {kb:.3f} | {vb:.3f} | {data} | {cells} |", flush=True)


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


WINDOW_METHODS = [m for m in METHODS if m[0] != "hadamard K2/V2 g32"]


def _only_dense(state: Any, options: dict[str, Any]) -> Any:
    layers = tuple(
        ks.quantize(p, **options) if isinstance(p, ks.DenseKV) else p for p in state.layers
    )
    return ks.kinds.with_parts(state, layers)


def window_rows() -> None:
    model = tiny_model(
        "gemma3_text",
        head_dim=256,
        query_pre_attn_scalar=256,
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=1,
        num_hidden_layers=6,
        sliding_window=64,
        sliding_window_pattern=6,
        dtype=mx.float16,
        scale=2.0,
    )
    m = wrap(model)
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, 256, 256).tolist()
    follow = rng.integers(0, 256, 48).tolist()
    _, fp = m(mx.array([prompt]), m.init_state())
    kinds = sorted({type(p).__name__ for p in fp.layers})

    def decode(state: Any) -> mx.array:
        out = []
        for t in follow:
            logits, state = m(mx.array([[t]]), state)
            out.append(logits[0, -1].astype(mx.float32))
        return mx.stack(out)

    ref = decode(fp)
    p = mx.softmax(ref, axis=-1)

    def scores(state: Any) -> tuple[float, float]:
        x = decode(state)
        log_q = x - mx.logsumexp(x, axis=-1, keepdims=True)
        kl = mx.sum(p * (mx.log(p + 1e-30) - log_q), axis=-1).mean().item()
        top1 = (x.argmax(-1) == ref.argmax(-1)).astype(mx.float32).mean().item()
        return kl, top1

    print(f"\ngemma3_text (random init, {kinds}), fp16 state after the prompt: "
          f"{ks.nbytes(fp)} bytes")  # fmt: skip
    print("\n| method | layers quantized | state bytes | next-token KL (fp16 -> method) "
          "| top-1 agreement |")  # fmt: skip
    print("|---|---|---|---|---|")
    for name, options in WINDOW_METHODS:
        for label, state in (
            ("global only (windows fp16)", _only_dense(fp, options)),
            ("all (windows: QuantizedRotatingKV)", ks.quantize(fp, **options)),
        ):
            kl, top1 = scores(state)
            print(f"| {name} | {label} | {ks.nbytes(state)} | {kl:.5f} | {top1:.3f} |",
                  flush=True)  # fmt: skip


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
    print("| kvstate | mlx-lm | kvstate ms/step | mlx-lm ms/step | throughput ratio [IQR] |")
    print("|---|---|---|---|---|")
    for options, bits in PAIRS:
        name = f"K{options['key_bits']}/V{options['value_bits']}"
        name += " (left-padded)" if options.get("left_padded") else ""
        raised = {}
        for side, run, arg in (("kvstate", ours, options), ("mlx-lm", theirs, bits)):
            try:
                run(arg)  # warm up (routing, first allocations)
            except RuntimeError as error:  # MLX CUDA 0.32 lacks some quantized_matmul forms
                raised[side] = str(error)[:120]
        if raised:
            print(f"| {name} | {bits}-bit | not run: {raised} | | |", flush=True)
            continue
        pairs = []
        for r in range(reps):  # ABBA: each side first in every other rep
            if r % 2 == 0:
                a = ours(options)
                b = theirs(bits)
            else:
                b = theirs(bits)
                a = ours(options)
            pairs.append((a, b))
        ratios = [b / a for a, b in pairs]
        q1, _, q3 = statistics.quantiles(ratios, n=4)
        print(
            f"| {name} | {bits}-bit | {statistics.median(a for a, _ in pairs) * 1e3:.2f} | "
            f"{statistics.median(b for _, b in pairs) * 1e3:.2f} | "
            f"{statistics.median(ratios):.2f}x [{q1:.2f}, {q3:.2f}] |",
            flush=True,
        )
    print(f"(ratio: median and IQR over {reps} paired reps of mlx-lm time / kvstate time)")


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
    if "quality" in parts or "turboquant" in parts:
        turboquant_rows()
    if "model" in parts:
        model_rows()
    if "windows" in parts:
        window_rows()
    if "kernels" in parts:
        kernel_rows(args.context)
    if "decode" in parts:
        decode_rows(args.context, args.steps, args.reps)


if __name__ == "__main__":
    main()
