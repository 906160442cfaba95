"""Does MLX CUDA pay per new sequence length in multi-token attention? Times
mx.fast.scaled_dot_product_attention for a 5-token query over L keys, L new each call
(as in speculative rounds) and L repeated, with mask="causal", an array mask, and no mask.

    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/probes/sdpa_shapes.py
"""

from __future__ import annotations

import statistics
import time

import mlx.core as mx


def attend(q: mx.array, k: mx.array, mask: object) -> float:
    """ms for one attention call, evaluated."""
    start = time.perf_counter()
    mx.eval(mx.fast.scaled_dot_product_attention(q, k, k, scale=0.1, mask=mask))
    mx.synchronize()
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    b, hq, hk, d, n = 1, 16, 8, 128, 5
    q = mx.random.normal((b, hq, n, d)).astype(mx.bfloat16)
    masks = {
        "causal": lambda L: "causal",
        "array": lambda L: mx.tril(mx.ones((n, L), mx.bool_), k=L - n),
        "none": lambda L: None,
    }
    for name, mask in masks.items():
        new, again = [], []
        for L in range(1030, 1030 + 4 * 12, 4):
            k = mx.random.normal((b, hk, L, d)).astype(mx.bfloat16)
            mx.eval(k)
            m = mask(L)
            new.append(attend(q, k, m))
            again.append(attend(q, k, m))
        print(
            f"{name:7s} new L: median {statistics.median(new):.2f} ms (first {new[0]:.1f}); "
            f"same L again: median {statistics.median(again):.2f} ms",
            flush=True,
        )
    q1 = q[:, :, :1]
    new = []
    for L in range(2030, 2030 + 12):
        k = mx.random.normal((b, hk, L, d)).astype(mx.bfloat16)
        mx.eval(k)
        new.append(attend(q1, k, None))
    print(f"1-token query, new L each call: median {statistics.median(new):.2f} ms", flush=True)


if __name__ == "__main__":
    main()
