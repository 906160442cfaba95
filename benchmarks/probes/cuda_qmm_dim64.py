"""Is `mx.quantized_matmul` right at head dim 64? It is what quantized attention calls twice:
scores q . k^T (transpose=True, keys quantized over the head dim) and weights @ v
(transpose=False, values quantized over the head dim, contracted over positions).

On MLX CUDA 0.32.4 SmolLM2 (head dim 64, 3 KV heads, 9 query heads) under kvstate's
asymmetric / rotated quantized states gave perplexity ~2000 instead of 11, and mlx-lm's
QuantizedKVCache raised "No implementation for problem shape: 256x256x64x9" (Findings in
BENCHMARKS.md). This compares each call against `mx.dequantize` then `mx.matmul` on the
same operands, one line per case: the relative error, or the exception. Shapes are
attention's: (batch, kv heads, repeats * queries, dim) against (batch, kv heads, positions,
dim), for head dims 64, 128 and 256. Part 2: `kvstate.quantized_attention` on this
device against the same call on the CPU stream (a correct path), SmolLM2's shapes.

    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/probes/cuda_qmm_dim64.py     # on the H200
"""

from __future__ import annotations

import itertools

import mlx.core as mx

import kvstate


def relative_error(
    dim: int, bits: int, group: int, transpose: bool, m: int, n: int, dtype: mx.Dtype
) -> str:
    heads = 3
    mx.random.seed(0)
    data = mx.random.normal((1, heads, n, dim)).astype(dtype)
    w, scales, biases = mx.quantize(data, group_size=group, bits=bits)
    dense = mx.dequantize(w, scales, biases, group_size=group, bits=bits)
    # transpose=True: x (.., m, dim) @ dense^T -> (.., m, n); False: x (.., m, n) @ dense.
    x = mx.random.normal((1, heads, m, dim if transpose else n)).astype(dtype)
    try:
        got = mx.quantized_matmul(
            x, w, scales, biases, transpose=transpose, group_size=group, bits=bits
        )
        want = x @ (dense.swapaxes(-1, -2) if transpose else dense)
        err = mx.max(mx.abs(got - want)) / mx.maximum(mx.max(mx.abs(want)), 1e-6)
        return f"{err.item():.2e}"
    except (RuntimeError, ValueError) as e:
        return "raises: " + str(e).splitlines()[0][:70]


def main() -> None:
    print(
        f"# mx.quantized_matmul vs dequantize+matmul on {mx.default_device()}, mlx {mx.__version__}"
    )
    print("dim bits group transpose dtype m n -> max |err| / max |want|")
    cases = itertools.product(
        (64, 128, 256),
        (3, 4, 8),
        (32, 64),
        (True, False),
        (mx.float32, mx.bfloat16),
        ((3, 256), (9, 256), (27, 300), (256 * 3, 256)),
    )
    for dim, bits, group, transpose, dtype, (m, n) in cases:
        result = relative_error(dim, bits, group, transpose, m, n, dtype)
        print(
            dim, bits, group, transpose, str(dtype).split(".")[-1], m, n, "->", result, flush=True
        )


def attention_against_cpu(dim: int, options: dict, queries: int, dtype: mx.Dtype) -> str:
    """Max |device - cpu| / max |cpu| of quantized attention over 256 positions, 9 query heads
    on 3 KV heads."""
    mx.random.seed(1)
    k, v = (mx.random.normal((1, 3, 256, dim)).astype(dtype) for _ in range(2))
    q = mx.random.normal((1, 9, queries, dim)).astype(dtype)
    state = kvstate.quantize(kvstate.DenseKV(k, v, length=256), **options)

    def attend() -> mx.array:
        out = kvstate.quantized_attention(q, state, scale=dim**-0.5, mask="causal")
        return out.astype(mx.float32)

    try:
        got = attend()
        mx.eval(got)
    except (RuntimeError, ValueError) as e:
        return "raises: " + str(e).splitlines()[0][:70]
    with mx.stream(mx.cpu):
        want = attend()
        mx.eval(want)
    err = mx.max(mx.abs(got - want)) / mx.maximum(mx.max(mx.abs(want)), 1e-6)
    return f"{err.item():.2e}"


OPTIONS = {
    "K4/V4": {"bits": 4, "group_size": 32},
    "K4/V3": {"key_bits": 4, "value_bits": 3, "group_size": 32},
    "K4/V3 hadamard": {"key_bits": 4, "value_bits": 3, "group_size": 32, "rotation": "hadamard"},
    "K8/V8": {"bits": 8, "group_size": 64},
}


def attention_main() -> None:
    print("# kvstate.quantized_attention on the device vs the CPU stream: option dim L dtype")
    for name, dim, queries, dtype in itertools.product(
        OPTIONS, (64, 128), (1, 5, 256), (mx.float32, mx.bfloat16)
    ):
        result = attention_against_cpu(dim, OPTIONS[name], queries, dtype)
        print(name, dim, queries, str(dtype).split(".")[-1], "->", result, flush=True)


if __name__ == "__main__":
    attention_main()
    main()
