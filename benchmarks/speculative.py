"""kvstate's speculative generator against mlx-lm's `speculative_generate_step` and plain
greedy decoding, on the same models and drafts; rows printed as measured.

The draft model is the target with its weights perturbed by 1% (random-init models have no
genuinely smaller model that predicts them), so acceptance is high and a draft forward costs
what a target forward costs: what matters is kvstate / mlx-lm on identical work. Both
generators' tokens are compared too (greedy: they must be equal).

    .venv/bin/python benchmarks/speculative.py [--large] [--tokens 64]
    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/speculative.py --large   # on the H200
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.generate import generate_step, speculative_generate_step

from kvstate.adapters import wrap
from kvstate.adapters.tiny_models import tiny_model
from kvstate.speculative import ModelDrafter, NGramDrafter, generate

LARGE = {
    "vocab_size": 32000, "hidden_size": 2048, "num_hidden_layers": 16,
    "intermediate_size": 8192, "num_attention_heads": 16, "num_key_value_heads": 8,
    "head_dim": 128, "max_position_embeddings": 8192,
}  # fmt: skip


def say(text: str) -> None:
    print(text, flush=True)


def perturbed(model: nn.Module, noise: float = 0.01) -> nn.Module:
    params = tree_flatten(model.parameters())
    keys = iter(mx.random.split(mx.random.key(1), len(params)))
    model.update(
        tree_unflatten(
            [
                (
                    k,
                    v
                    + noise * mx.random.normal(v.shape, key=next(keys)).astype(v.dtype) * mx.abs(v),
                )
                for k, v in params
            ]
        )
    )
    mx.eval(model.parameters())
    return model


def timed(fn: Any) -> tuple[list[int], float]:
    start = time.perf_counter()
    tokens = fn()
    return tokens, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--large", action="store_true", help="a ~1.1B llama (GPU)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    config = LARGE if args.large else {}
    dtype = mx.bfloat16 if args.large else mx.float32
    model = tiny_model("llama", scale=4.0 if not args.large else 1.0, dtype=dtype, **config)
    draft = perturbed(
        tiny_model("llama", scale=4.0 if not args.large else 1.0, dtype=dtype, **config)
    )
    prompt = list(range(3, 40))
    n = args.tokens
    say(
        f"# speculative: llama {'~1.1B bf16' if args.large else 'tiny'}, {mx.default_device()}, {n} tokens"
    )
    say(
        "\n| k | contender | tok/s (median) | / plain greedy | / mlx-lm speculative | draft tokens |"
    )
    say("|---|---|---|---|---|---|")

    def plain() -> list[int]:
        return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n)]

    def theirs(k: int) -> list[int]:
        steps = speculative_generate_step(
            mx.array(prompt), model, draft, num_draft_tokens=k, max_tokens=n
        )
        return [int(t) for t, _, _ in steps]

    def ours(k: int, drafter: Any) -> list[int]:
        return [
            t.token
            for r in generate(wrap(model), [prompt], drafter, k=k, max_tokens=n, adaptive=False)
            for t in r
        ]

    reference, _ = timed(plain)
    for k in (2, 4):
        times: dict[str, list[float]] = {
            "plain": [],
            "mlx-lm": [],
            "kvstate": [],
            "kvstate n-gram": [],
        }
        drafted = 0
        for _ in range(args.reps):
            times["plain"].append(timed(plain)[1])
            out, t = timed(lambda k=k: theirs(k))
            assert out == reference, "mlx-lm's speculative output differs from greedy"
            times["mlx-lm"].append(t)
            out, t = timed(lambda k=k: ours(k, ModelDrafter(wrap(draft))))
            assert out == reference, "kvstate's speculative output differs from greedy"
            times["kvstate"].append(t)
            out, t = timed(lambda k=k: ours(k, NGramDrafter()))
            assert out == reference
            times["kvstate n-gram"].append(t)
        drafted = sum(
            t.from_draft
            for r in generate(
                wrap(model), [prompt], ModelDrafter(wrap(draft)), k=k, max_tokens=n, adaptive=False
            )
            for t in r
        )
        base, mlx = statistics.median(times["plain"]), statistics.median(times["mlx-lm"])
        for name, ts in times.items():
            median = statistics.median(ts)
            say(f"| {k} | {name} | {n / median:.1f} | {base / median:.2f} | {mlx / median:.2f} "
                f"| {drafted if name == 'kvstate' else ''} |")  # fmt: skip


if __name__ == "__main__":
    main()
