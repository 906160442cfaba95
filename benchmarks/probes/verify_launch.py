"""Where a multi-token verify forward's host time goes on MLX CUDA (diagnostic, H200).

A speculative round on llama is host-bound: MLX encodes each kernel from the Python thread
when the verify is evaluated (`launch`), and a 5-token verify's launch took ~4 ms against
~2.2 ms for a one-token step. This script times, on raw mlx-lm caches at a 1k context, the
build (Python) / launch (`mx.async_eval`) / wait of one forward for: a 1-token step; a
5-token forward with mlx-lm's own causal mask; the same with kvstate's bucketed array mask
(what wrap did on CUDA before the kernel); with attention replaced by a pass-through (a lower
bound only: MLX then also drops the keys' and values' projections and cache writes, which
nothing reads); with attention as plain ops; with kvstate's verify attention kernel
(`adapters/kernels/verify_attention.py`) patched in; and through wrap's route (kernel or buckets).
Each row prints as it is measured. The kernel's correctness is tests/test_buckets.py's
(`bash benchmarks/h200.sh kernel-tests`).

    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/probes/verify_launch.py
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import _on_path  # noqa: F401  (benchmarks/ on the path, for verify)
import mlx.core as mx
import mlx_lm.models.llama as llama
import numpy as np
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache
from verify import BIG

from kvstate.adapters.instruments import buckets
from kvstate.adapters.kernels.verify_attention import verify_attention
from kvstate.adapters.tiny_models import tiny_model

ORIGINAL = llama.scaled_dot_product_attention


def say(text: str) -> None:
    print(text, flush=True)


def passthrough(queries: mx.array, keys: mx.array, values: mx.array, **_: Any) -> mx.array:
    return queries


def as_ops(queries: mx.array, keys: mx.array, values: mx.array, *, scale: float, mask: Any,
           **_: Any) -> mx.array:  # fmt: skip
    B, H, T, D = queries.shape
    kv = keys.shape[1]
    q = queries.reshape(B, kv, H // kv, T, D) * scale
    scores = q @ keys[:, :, None].swapaxes(-1, -2)
    L = keys.shape[2]
    causal = mx.arange(L)[None] <= (L - T + mx.arange(T))[:, None]
    scores = mx.where(causal, scores, mx.array(-float("inf"), scores.dtype))
    weights = mx.softmax(scores.astype(mx.float32), axis=-1).astype(values.dtype)
    return (weights @ values[:, :, None]).reshape(B, H, T, D)


def kernel(queries: mx.array, keys: mx.array, values: mx.array, *, scale: float, **_: Any) -> Any:
    return verify_attention(queries, keys, values, scale)


def timed_once(model: Any, caches: list[Any], tokens: mx.array,
               scope: Callable[[], Any]) -> tuple[float, float, float]:  # fmt: skip
    with scope():
        t0 = time.perf_counter()
        logits = model(tokens, cache=caches)
        t1 = time.perf_counter()
    mx.async_eval(logits)
    t2 = time.perf_counter()
    mx.eval(logits)
    t3 = time.perf_counter()
    trim_prompt_cache(caches, tokens.shape[1])
    return t1 - t0, t2 - t1, t3 - t2


class patched:
    def __init__(self, fn: Any = None, bucketed: Any = None, model: Any = None) -> None:
        self.fn, self.bucketed, self.model = fn, bucketed, model

    def __call__(self) -> Any:
        stack = ExitStack()
        if self.fn is not None:
            llama.scaled_dot_product_attention = self.fn
            stack.callback(setattr, llama, "scaled_dot_product_attention", ORIGINAL)
        if self.bucketed is not None:
            stack.enter_context(buckets.bucketing(self.bucketed, self.model))
        return stack


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=40)
    parser.add_argument("--context", type=int, default=1020)
    args = parser.parse_args()
    t = time.perf_counter()
    for _ in range(3):
        x = mx.zeros((8,))
        for _ in range(200):
            x = x + 1
        t = time.perf_counter()
        mx.async_eval(x)
        launch = time.perf_counter() - t
        mx.eval(x)
    say(f"launch of 200 tiny adds: {launch * 1e3:.2f} ms ({launch * 5e3:.1f} us per kernel)")
    for dtype in (mx.bfloat16, mx.float32):
        model = tiny_model("llama", scale=1.0, dtype=dtype, **BIG["llama"])
        caches = make_prompt_cache(model)
        rng = np.random.default_rng(1)
        mx.eval(model(mx.array(rng.integers(0, 32000, (1, args.context))), cache=caches))
        mx.eval([c.state for c in caches])
        say(
            f"\n## {dtype}, context {args.context}: ms, median of {args.reps} (build / launch / wait)\n"
        )
        say("| forward | build | launch | wait | build + launch | all three [IQR of the sum] |")
        say("|---|---|---|---|---|---|")
        one = mx.array([[7]])
        five = mx.array(rng.integers(0, 32000, (1, 5)))
        nine = mx.array(rng.integers(0, 32000, (1, 9)))
        rows = [
            ("1 token", one, patched()),
            ("5 tokens, mlx-lm causal mask (cuDNN, length seen)", five, patched()),
            ("5 tokens, kvstate buckets (array mask)", five, patched(bucketed=caches)),
            ("5 tokens, attention = pass-through (a lower bound)", five, patched(fn=passthrough)),
            ("5 tokens, attention as ops", five, patched(fn=as_ops)),
            ("5 tokens, kvstate verify kernel", five, patched(fn=kernel)),
            (
                "5 tokens, wrap's route (buckets + kernel)",
                five,
                patched(bucketed=caches, model=model),
            ),
            ("1 token, kvstate verify kernel", one, patched(fn=kernel)),
            ("9 tokens, kvstate buckets (array mask)", nine, patched(bucketed=caches)),
            ("9 tokens, kvstate verify kernel", nine, patched(fn=kernel)),
        ]
        # Interleaved: every rep runs every row once, in a rotating order (the host's speed
        # drifts by tens of percent within a run; blocks of one row each would measure it).
        phases: dict[str, list[tuple[float, float, float]]] = {name: [] for name, *_ in rows}
        for rep in range(args.reps + 3):
            shift = rep % len(rows)
            for name, tokens, scope in rows[shift:] + rows[:shift]:
                measured = timed_once(model, caches, tokens, scope)
                if rep >= 3:
                    phases[name].append(measured)
        for name, *_ in rows:
            build, launch, wait = (
                statistics.median(x) * 1e3 for x in zip(*phases[name], strict=True)
            )
            total = sorted(sum(p) * 1e3 for p in phases[name])
            q1, q3 = total[len(total) // 4], total[3 * len(total) // 4]
            say(
                f"| {name} | {build:.3f} | {launch:.3f} | {wait:.3f} | {build + launch:.3f} "
                f"| {build + launch + wait:.3f} [{q1:.2f}, {q3:.2f}] |"
            )
        del model, caches


if __name__ == "__main__":
    main()
