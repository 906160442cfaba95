"""Which `mx.quantized_matmul` problems this device implements, for the shapes quantized
attention uses: one or a few queries (M) against N cached positions of head dim 128 in 8 heads,
scores with transpose=True (keys) and the output with transpose=False (values).

MLX CUDA 0.32.4 raised "No implementation for problem shape" for some of them at eval time
(5-bit keys, 1025 positions). Prints one line per (bits, group, transpose, dtype): the (M, N)
pairs that failed, or "all ok".

    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/probes/cuda_qmm_support.py     # on the H200
"""

from __future__ import annotations

import mlx.core as mx


def works(
    bits: int, group: int, transpose: bool, dtype: mx.Dtype, m: int, n: int, sliced: bool = False
) -> bool:
    """`sliced`: the quantized keys are the first n positions of a longer buffer (a cache's
    capacity), a strided view, as quantized attention reads them."""
    heads, dim = 8, 128
    data = mx.random.normal((1, heads, n + 256 * sliced, dim)).astype(dtype)
    w, scales, biases = (a[..., :n, :] for a in mx.quantize(data, group_size=group, bits=bits))
    x = mx.random.normal((1, heads, m, dim if transpose else n)).astype(dtype)
    try:
        y = mx.quantized_matmul(
            x, w, scales, biases, transpose=transpose, group_size=group, bits=bits
        )
        mx.eval(y)
        return True
    except (RuntimeError, ValueError):
        return False


def main() -> None:
    print(f"# mx.quantized_matmul support on {mx.default_device()}, mlx {mx.__version__}")
    for dtype in (mx.float32, mx.bfloat16):
        for bits in (2, 3, 4, 5, 6, 8):
            for group in (32, 64, 128):
                for transpose in (True, False):
                    failed = [
                        (m, n)
                        for m in (1, 5)
                        for n in (256, 1024, 1025)
                        if not works(bits, group, transpose, dtype, m, n)
                    ]
                    verdict = "all ok" if not failed else f"FAILED (M, N): {failed}"
                    print(
                        f"{dtype} bits {bits} group {group} transpose {transpose}: {verdict}",
                        flush=True,
                    )
    for bits in (2, 3, 4, 5, 6, 8):
        for transpose in (True, False):
            failed = [
                (m, n)
                for m in (1, 5)
                for n in (1024, 1025)
                if not works(bits, 64, transpose, mx.float32, m, n, sliced=True)
            ]
            verdict = "all ok" if not failed else f"FAILED (M, N): {failed}"
            print(
                f"sliced buffer, float32 bits {bits} transpose {transpose}: {verdict}", flush=True
            )


if __name__ == "__main__":
    main()
