"""Where kvstate's plain decoding loses to mlx-lm's `generate_step` on a real model with a short
prompt (on the H200 real_speed.py measured kvstate plain at 0.83-0.85x on the chat prompts
and Gemma's code prompt, ~1.0x on the long prose prompts: a host cost per step that the
device's time hides once the context is long).

For each model: per-token time of `generate_step` and of `generate(target, [prompt])` (no
drafter), interleaved repetitions, medians; then one run of each under cProfile, its host
functions by own time (the read-back that waits for the device shows as `tolist` / `item`).
`--self-draft`: also one profiled run with the 4-bit self-draft (`ModelDrafter`).

    PYTHONPATH=/tmp/site:/tmp/src python3 benchmarks/probes/generator_host.py --models gemma3-270m
    .venv/bin/python benchmarks/probes/generator_host.py --models smollm2-135m --tokens 16 --reps 1
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any

import _on_path  # noqa: F401  (benchmarks/ on the path, for real_speed)
import mlx.core as mx
from mlx_lm.generate import generate_step
from real_speed import encoded, prompt_texts, target_model

from kvstate.adapters import quantized_draft, wrap
from kvstate.speculative import ModelDrafter, generate


def per_token(tokens: Callable[[], Iterable[int]]) -> float:
    """Seconds a token after the first (the prefill's)."""
    first, count = 0.0, 0
    for count, _ in enumerate(tokens(), 1):
        if count == 1:
            first = time.perf_counter()
    return (time.perf_counter() - first) / max(count - 1, 1)


def profile(name: str, tokens: Callable[[], Iterable[int]], top: int) -> None:
    profiler = cProfile.Profile()
    profiler.enable()
    count = sum(1 for _ in tokens())
    profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    print(f"--- {name}: {count} tokens, {stats.total_tt * 1e3 / count:.2f} ms a token (profiled)")
    stats.sort_stats("tottime").print_stats(top)
    lines = [line for line in text.getvalue().splitlines() if line.strip()]
    print("\n".join(lines[3:]), flush=True)


def measure(name: str, kind: str, model: Any, target: Any, prompt: list[int], args: Any) -> None:
    n = args.tokens

    def theirs() -> Iterable[int]:
        return (int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n))

    def ours() -> Iterable[int]:
        return (t.token for r in generate(target, [prompt], max_tokens=n) for t in r)

    contenders = {"generate_step": theirs, "kvstate plain": ours}
    times: dict[str, list[float]] = {k: [] for k in contenders}
    for f in contenders.values():  # warm-up: compiles, caches
        per_token(f)
    for rep in range(args.reps):
        order = list(contenders)[rep % 2 :] + list(contenders)[: rep % 2]
        for k in order:
            times[k].append(per_token(contenders[k]))
    ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    ratios = [a / b for a, b in zip(times["generate_step"], times["kvstate plain"], strict=True)]
    print(
        f"{name} {kind} ({len(prompt)} prompt tokens, {n} tokens): generate_step "
        f"{ms['generate_step']:.3f} ms a token, kvstate plain {ms['kvstate plain']:.3f}; "
        f"kvstate tokens/s over generate_step {statistics.median(ratios):.3f} "
        f"[{min(ratios):.3f}, {max(ratios):.3f}]",
        flush=True,
    )
    for k, f in contenders.items():
        profile(f"{name} {kind} {k}", f, args.top)
    if args.self_draft:  # the 4-bit self-draft, profiled only (real_speed.py times it)
        drafter = wrap(quantized_draft(model, bits=4))

        def drafted() -> Iterable[int]:
            rounds = generate(target, [prompt], ModelDrafter(drafter), max_tokens=n)
            return (t.token for r in rounds for t in r)

        for _ in range(2):
            per_token(drafted)
        profile(f"{name} {kind} kvstate 4-bit self-draft", drafted, args.top)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    parser.add_argument("--kinds", nargs="+", default=["chat", "prose"])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--top", type=int, default=18)
    parser.add_argument("--self-draft", action="store_true",
                        help="also profile generate with the 4-bit self-draft")  # fmt: skip
    args = parser.parse_args()
    for name in args.models:
        model, tokenizer = target_model(name, args.dtype)
        target = wrap(model)
        for kind in args.kinds:
            prompt = encoded(tokenizer, kind, prompt_texts(kind, 1)[0])
            measure(name, kind, model, target, prompt, args)


if __name__ == "__main__":
    main()
