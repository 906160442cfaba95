"""Does kvstate's quantized attention run, and give the right numbers, on this device?

MLX CUDA 0.32's `quantized_matmul` (mlx/backend/cuda/quantized/quantized.cpp) raises "No
implementation for problem shape: MxNxKxB" when no kernel accepts the problem: every kernel
(qmm_sm90, qmm_sm80, qmm_naive, qmv) requires the quantized matrix, scales and biases to be
contiguous (flags().contiguous, last two dims row-major), so a cache buffer cut at
`length` < capacity (every decode step after the buffer grew) is refused. A broadcast matrix
passes that check but the kernels then read batch 0 for every batch (`broadcast_w`), so the
old GQA form (keys[:, :, None] against (B, kv, repeats, L, D) queries) gives wrong scores
whenever there is more than one kv head. kvstate now folds the repeats into the query rows
and hands `mx.contiguous` operands.

Part 1, one line per case: the new `kvstate.quantized_attention` and the old form (copied
below) against dequantize-then-attend in float32 on the same device, for GQA repeats 1/2/4,
L 1/5, (key, value) bits (4,4) (5,3) (8,4) (4,2), float32 and bfloat16, a buffer of exactly
1025 positions and one cut at 1025 of 1280. Part 2: 8 decode steps of a wrapped tiny llama
(GQA, head dim 128) with quantized states across the 1024 -> 1280 buffer growth, logits
against mlx-lm's own dense attention over dequantized K/V; and mlx-lm's QuantizedKVCache
decoding the same way. Part 3: ms per call of the values product at each bits,
quantized_matmul(transpose=False) vs dequantize-then-matmul (what item 2 of issue 9 would
pick per backend and bits).

    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/probes/cuda_qattn_probe.py
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, make_prompt_cache

import kvstate as ks
from kvstate.adapters import wrap
from kvstate.adapters.tiny_models import VOCAB, tiny_model
from kvstate.quantization import Codec, key_codec, value_codec

BIT_PAIRS = ((4, 4), (5, 3), (8, 4), (4, 2))
B, KV_HEADS, DIM, LENGTH, CAPACITY = 2, 2, 128, 1025, 1280
# relative error of the output; a wrong head or batch gives ~1. MLX's CPU kernel accumulates
# bfloat16 products in bfloat16 (~4e-2 over 1025 positions).
TOLERANCE = {mx.float32: 2e-3, mx.bfloat16: 1e-1}


def key_values(dtype: mx.Dtype, cut: bool) -> tuple[mx.array, mx.array]:
    rng = np.random.default_rng(0)
    n = CAPACITY if cut else LENGTH
    k, v = (rng.standard_normal((B, KV_HEADS, n, DIM)).astype(np.float32) for _ in range(2))
    return mx.array(k).astype(dtype), mx.array(v).astype(dtype)


def quantized_state(bits: tuple[int, int], dtype: mx.Dtype, cut: bool) -> ks.QuantizedKV:
    """`cut`: a 1280-position buffer of which 1025 are in use (rows past `length`, as after a
    commit), else a buffer of exactly 1025."""
    k, v = key_values(dtype, cut)
    n = int(k.shape[2])
    dense = ks.DenseKV(k, v, length=n, appended=n - LENGTH)
    state = ks.quantize(dense, key_bits=bits[0], value_bits=bits[1], group_size=64)
    return ks.eval(ks.commit_prefix(state, 0))


def reference(queries: mx.array, state: Any, scale: float, mask: Any) -> mx.array:
    """Dequantize-then-attend in float32 (mx ops on this device)."""
    n = state.length
    keys = Codec(state.key_bits, 64).decode(tuple(a[..., :n, :] for a in state.keys))
    values = Codec(state.value_bits, 64).decode(tuple(a[..., :n, :] for a in state.values))
    repeats = queries.shape[1] // keys.shape[1]
    keys, values = (mx.repeat(x.astype(mx.float32), repeats, axis=1) for x in (keys, values))
    scores = (queries.astype(mx.float32) * scale) @ keys.swapaxes(-1, -2)
    if mask == "causal":
        L = queries.shape[2]
        allowed = mx.arange(n - L, n)[:, None] >= mx.arange(n)[None]
        scores = mx.where(allowed, scores, -mx.inf)
    return mx.softmax(scores, axis=-1) @ values


def old_attention(queries: mx.array, state: Any, scale: float, mask: Any) -> mx.array:
    """kvstate's quantized attention before the fix: keys broadcast over the GQA repeats, the
    buffers cut at `length` and handed over as views."""
    n = state.length
    keys = tuple(a[..., :n, :] for a in state.keys)
    values = tuple(a[..., :n, :] for a in state.values)
    b, n_heads, L, dim = queries.shape
    repeats = n_heads // KV_HEADS
    q = queries * scale
    if repeats > 1:
        q = q.reshape(b, KV_HEADS, repeats, L, dim)
        keys = tuple(a[:, :, None] for a in keys)
        values = tuple(a[:, :, None] for a in values)
    scores = mx.quantized_matmul(q, *keys, transpose=True, group_size=64, bits=state.key_bits)
    if mask == "causal":
        scores = mx.where(
            mx.arange(n - L, n)[:, None] >= mx.arange(n)[None],
            scores,
            mx.finfo(scores.dtype).min,
        )
    weights = mx.softmax(scores, axis=-1, precise=True)
    out = mx.quantized_matmul(
        weights, *values, transpose=False, group_size=64, bits=state.value_bits
    )
    return out.reshape(b, n_heads, L, -1)


def verdict(fn: Any, queries: mx.array, state: Any, mask: Any, expected: mx.array) -> str:
    try:
        out = fn(queries, state, scale=DIM**-0.5, mask=mask)
        mx.eval(out)
    except (RuntimeError, ValueError) as error:
        return f"RAISED {str(error)[:110]}"
    diff = mx.linalg.norm((out.astype(mx.float32) - expected).flatten())
    rel = (diff / mx.linalg.norm(expected.flatten())).item()
    return f"{'ok' if rel <= TOLERANCE[queries.dtype] else 'WRONG'} (rel err {rel:.1e})"


def attention_cases() -> tuple[int, int]:
    failures = [0, 0]
    states = itertools.product((mx.float32, mx.bfloat16), BIT_PAIRS, (False, True))
    for dtype, bits, cut in states:
        state = quantized_state(bits, dtype, cut)
        form = f"{LENGTH} of {CAPACITY} (cut)" if cut else f"{LENGTH} (whole buffer)"
        for repeats, L in itertools.product((1, 2, 4), (1, 5)):
            rng = np.random.default_rng(repeats * 10 + L)
            shape = (B, KV_HEADS * repeats, L, DIM)
            queries = mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)
            mask = "causal" if L > 1 else None
            expected = reference(queries, state, DIM**-0.5, mask)
            lines = []
            for i, fn in enumerate((ks.quantized_attention, old_attention)):
                lines.append(verdict(fn, queries, state, mask, expected))
                failures[i] += not lines[-1].startswith("ok")
            print(
                f"K{bits[0]}/V{bits[1]} {dtype!s:14} repeats {repeats} L {L} buffer {form:22} "
                f"| new: {lines[0]:24} | old: {lines[1]}",
                flush=True,
            )
    return failures[0], failures[1]


class DequantizingCache(KVCache):
    """mlx-lm's KVCache of decode(encode(x)), read by mlx-lm's own dense attention."""

    def __init__(self, key_codec: Codec, value_codec: Codec) -> None:
        super().__init__()
        self.codecs = (key_codec, value_codec)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Any:
        k, v = (c.decode(c.encode(x)) for c, x in zip(self.codecs, (keys, values), strict=True))
        return super().update_and_fetch(k, v)


def oracle_from(state: Any, codecs: tuple[Codec, Codec]) -> list[DequantizingCache]:
    """Dequantizing caches holding exactly the state's dequantized K/V (quantizing the same
    prompt independently would flip roundings of near-tie values and drift apart)."""
    caches = []
    for layer in state.layers:
        cache = DequantizingCache(*codecs)
        n = layer.length
        keys = key_codec(layer).decode(tuple(a[..., :n, :] for a in layer.keys))
        values = value_codec(layer).decode(tuple(a[..., :n, :] for a in layer.values))
        cache.state = (keys, values, n)
        caches.append(cache)
    return caches


def wrapped_decode(steps: int = 8) -> int:
    """A wrapped tiny llama with quantized states: a 1020-token prefill, then `steps` decode
    steps across the buffer growth at 1024, logits against mlx-lm's dense attention over the
    same dequantized K/V (new tokens quantized by the same codecs). K4/V4 without rotation is
    mlx-lm's own QuantizedKVCache form (and attention)."""
    model = tiny_model("llama", head_dim=DIM)  # 4 query heads over 2 kv heads
    m = wrap(model)
    prompt = mx.array([np.random.default_rng(1).integers(0, VOCAB, 1020).tolist()])
    failures = 0
    cases = (((4, 4), "none"), ((4, 4), "hadamard"), ((5, 3), "none"), ((4, 2), "hadamard"))
    for bits, rotation in cases:
        codecs = (Codec(bits[0], 64, 0, rotation, 3), Codec(bits[1], 64, 0, rotation, 3))
        options = {"key_bits": bits[0], "value_bits": bits[1], "rotation": rotation, "seed": 3}
        state = ks.quantize(m.init_state(), group_size=64, **options)
        worst, line = 0.0, "ok"
        try:
            logits, state = m(prompt, state)
            oracle = oracle_from(state, codecs)
            token = logits[:, -1:].argmax(-1)
            for _ in range(steps):
                logits, state = m(token, state)
                expected = model(token, cache=oracle)
                worst = max(worst, mx.abs(logits - expected).max().item())
                token = expected[:, -1:].argmax(-1)
        except (RuntimeError, ValueError) as error:
            line = f"RAISED {str(error)[:110]}"
        if line == "ok" and worst > 1e-2:
            line = "WRONG"
        failures += line != "ok"
        path = "mlx-lm's attention" if bits[0] == bits[1] and rotation == "none" else "kvstate's"
        print(
            f"wrapped llama, K{bits[0]}/V{bits[1]} {rotation} ({path}), prefill 1020 + {steps} "
            f"decode steps: {line} (max |logit diff| {worst:.1e} vs dequantized-cache oracle)",
            flush=True,
        )
    caches = make_prompt_cache(model)
    model(prompt, cache=caches)
    caches = [c.to_quantized(group_size=64, bits=4) for c in caches]
    try:
        for _ in range(steps):
            mx.eval(model(mx.array([[5]]), cache=caches))
        line = "ran"
    except (RuntimeError, ValueError) as error:
        line = f"RAISED {str(error)[:110]}"
    print(f"mlx-lm QuantizedKVCache 4-bit decode, {steps} steps from 1020: {line}", flush=True)
    return failures


def values_product_times(reps: int = 20) -> None:
    """The output product of one decode step (8 heads x 128, 1 query, 1025 positions)."""
    rng = np.random.default_rng(2)
    data = mx.array(rng.standard_normal((1, 8, LENGTH, DIM)).astype(np.float32))
    weights = mx.softmax(mx.array(rng.standard_normal((1, 8, 1, LENGTH)), mx.float32), axis=-1)

    def ms(fn: Any) -> float:
        mx.eval(fn())
        start = time.perf_counter()
        for _ in range(reps):
            mx.eval(fn())
        return (time.perf_counter() - start) / reps * 1e3

    for bits in (2, 3, 4, 5, 6, 8):
        q = mx.quantize(data, group_size=64, bits=bits)
        mx.eval(q)
        rows = []
        for _ in range(3):  # alternating
            a = ms(lambda q=q, b=bits: mx.quantized_matmul(weights, *q, transpose=False, bits=b))
            d = ms(lambda q=q, b=bits: weights @ mx.dequantize(*q, group_size=64, bits=b))
            rows.append((a, d))
        a, d = (float(np.median([r[i] for r in rows])) for i in range(2))
        print(
            f"values product {bits} bits: quantized_matmul(transpose=False) {a:.3f} ms, "
            f"dequantize+matmul {d:.3f} ms",
            flush=True,
        )


def main() -> None:
    start = time.perf_counter()
    print(f"mlx {mx.__version__}, {mx.default_device()}", flush=True)
    new_failures, old_failures = attention_cases()
    print(
        f"attention cases: new form {new_failures} failed, old form {old_failures} failed "
        f"({time.perf_counter() - start:.1f} s)",
        flush=True,
    )
    wrapped_failures = wrapped_decode()
    values_product_times()
    print(
        f"SUMMARY new attention failures {new_failures}, wrapped decode failures "
        f"{wrapped_failures} ({time.perf_counter() - start:.1f} s)",
        flush=True,
    )


if __name__ == "__main__":
    main()
