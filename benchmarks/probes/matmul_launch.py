"""What a verify's matmuls cost the host on MLX CUDA, by rows (diagnostic, H100 / H200).

A speculative round of one SmolLM2 row takes the H100 1.7-2x a pipelined plain step (11-13
against 6.5 ms), and the 1.1B llama's 5-token verify forward takes ~1.1 ms more to encode
than a 1-token step (benchmarks/HISTORY.md, "Where a verify's host time went"). One
suspect: a 1-row matmul runs MLX's own gemv kernel, a several-row one a library GEMM whose
launch costs the host more. This times, for a chain of SmolLM2-shaped projections (576 ->
1536 -> 576, bf16), the host's launch (`mx.async_eval`: MLX encodes each kernel from the
Python thread) per matmul and the wait, at M = 1, 2, 5, 9, 16 rows, written three ways: a
plain matmul, the rows as a batch of one-row products (`x[:, None] @ w.T`: a batched gemv
if MLX takes it so), and a 4-bit quantized matmul (group 64).

    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/probes/matmul_launch.py
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import mlx.core as mx

HIDDEN, INNER, LAYERS = 576, 1536, 30


def say(text: str) -> None:
    print(text, flush=True)


def chain(
    x: mx.array, up: Callable[[mx.array], mx.array], down: Callable[[mx.array], mx.array]
) -> mx.array:
    for _ in range(LAYERS):
        x = down(up(x))
    return x


def timed(build: Callable[[], mx.array], reps: int) -> tuple[float, float, float]:
    """Median ms of (build, launch, wait) over `reps` after two warm-ups."""
    phases = []
    for rep in range(reps + 2):
        t0 = time.perf_counter()
        y = build()
        t1 = time.perf_counter()
        mx.async_eval(y)
        t2 = time.perf_counter()
        mx.eval(y)
        t3 = time.perf_counter()
        if rep >= 2:
            phases.append((t1 - t0, t2 - t1, t3 - t2))
    return tuple(statistics.median(p) * 1e3 for p in zip(*phases, strict=True))  # type: ignore[return-value]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--rows", default="1,2,5,9,16")
    args = parser.parse_args()
    say(
        f"device: {mx.default_device()}; {LAYERS} x (up, down) projections {HIDDEN} -> {INNER} -> {HIDDEN}"
    )
    w_up = mx.random.normal((INNER, HIDDEN)).astype(mx.bfloat16) * 0.02
    w_down = mx.random.normal((HIDDEN, INNER)).astype(mx.bfloat16) * 0.02
    q_up = mx.quantize(w_up, group_size=64, bits=4)
    q_down = mx.quantize(w_down, group_size=64, bits=4)
    mx.eval(w_up, w_down, q_up, q_down)

    def plain(x: mx.array) -> mx.array:
        return chain(x, lambda h: h @ w_up.T, lambda h: h @ w_down.T)

    def as_gemvs(x: mx.array) -> mx.array:
        def one(w: mx.array) -> Callable[[mx.array], mx.array]:
            return lambda h: (h[:, None] @ w.T)[:, 0]

        return chain(x, one(w_up), one(w_down))

    def quantized(x: mx.array) -> mx.array:
        def one(q: tuple[mx.array, ...]) -> Callable[[mx.array], mx.array]:
            return lambda h: mx.quantized_matmul(h, *q, transpose=True, group_size=64, bits=4)

        return chain(x, one(q_up), one(q_down))

    say("\n| rows | form | build ms | launch ms | launch us per matmul | wait ms |")
    say("|---|---|---|---|---|---|")
    kernels = 2 * LAYERS
    for m in (int(r) for r in args.rows.split(",")):
        x = mx.random.normal((m, HIDDEN)).astype(mx.bfloat16)
        mx.eval(x)
        for name, form in (("matmul", plain), ("batched 1-row", as_gemvs), ("4-bit", quantized)):
            build, launch, wait = timed(lambda form=form, x=x: form(x), args.reps)
            say(
                f"| {m} | {name} | {build:.3f} | {launch:.3f} | {launch * 1e3 / kernels:.1f} | {wait:.3f} |"
            )


if __name__ == "__main__":
    main()
