"""Host time per draft step (graph build only, no evaluation): a draft model's k one-token
steps as k wrapped calls `m(y, state)`, as one `m.chain(y, state, k, pick)`, and as mlx-lm's
speculative loop builds them (`model(y, cache=caches)` on its own caches).

Each repetition builds one round of each contender from the same start (interleaved,
rotating order), then evaluates it untimed (mlx-lm's caches are trimmed back); the figure is
the median over repetitions of the round's build time / k. Python calls per draft step
(cProfile, one round of each after the timing) do not drift with the machine.

    .venv/bin/python benchmarks/draft_chain.py [--layers 16] [--k 4] [--reps 200]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from _harness import environment
from mlx_lm.models.cache import make_prompt_cache

from kvstate import tree_flatten
from kvstate.adapters import wrap
from kvstate.adapters.tiny_models import tiny_model


def _pick(logits: mx.array) -> mx.array:
    return logits.argmax(-1, keepdims=True).astype(mx.int32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--reps", type=int, default=200)
    args = parser.parse_args()
    k = args.k
    model = tiny_model("llama", num_hidden_layers=args.layers)
    m = wrap(model)
    prompt = mx.array([list(range(1, 33))])
    _, start = m(prompt, m.init_state())
    caches = make_prompt_cache(model)
    model(prompt, cache=caches)
    mx.eval(*tree_flatten(start)[0], *[c.state for c in caches])
    y = mx.array([[7]], mx.int32)

    # Each returns what it built; `_arrays` (untimed) lists it for evaluation.
    def calls() -> Any:
        state, out, token = start, [], y
        for _ in range(k):
            logits, state = m(token, state)
            token = _pick(logits[:, -1])
            out.append(token)
        return out, state

    def chain() -> Any:
        _, picks, state = m.chain(y, start, k, _pick)
        return [picks], state

    def mlx_lm() -> Any:
        out, token = [], y
        for _ in range(k):
            token = _pick(model(token, cache=caches)[:, -1])
            out.append(token)
        return out, caches

    def evaluate(name: str, built: Any) -> None:
        tokens, held = built
        if name == "mlx-lm on its caches":
            mx.eval(*tokens, *[c.state for c in held])
            for c in held:
                c.trim(k)
        else:
            mx.eval(*tokens, *tree_flatten(held)[0])

    contenders: dict[str, Callable[[], Any]] = {
        "m(...) per step": calls,
        "m.chain": chain,
        "mlx-lm on its caches": mlx_lm,
    }
    times: dict[str, list[float]] = {name: [] for name in contenders}
    names = list(contenders)
    for rep in range(args.reps + 10):
        for name in names[rep % 3 :] + names[: rep % 3]:
            began = time.perf_counter()
            built = contenders[name]()
            elapsed = time.perf_counter() - began
            evaluate(name, built)
            if rep >= 10:  # warm-up: compiled guards, first conversions
                times[name].append(elapsed)
    calls_per_step = {}
    for name in names:
        profile = cProfile.Profile()
        profile.enable()
        built = contenders[name]()
        profile.disable()
        evaluate(name, built)
        calls_per_step[name] = pstats.Stats(profile).total_calls / k
    print(f"# draft steps, host time per step (graph build), llama {args.layers} layers, k={k}\n")
    print(environment(False) + "\n")
    print("| contender | us / draft step | vs mlx-lm | Python calls / draft step |")
    print("|---|---|---|---|")
    base = statistics.median(times["mlx-lm on its caches"])
    for name in names:
        median = statistics.median(times[name])
        row = f"| {name} | {median / k * 1e6:.0f} | {median / base:.2f}x"
        print(f"{row} | {calls_per_step[name]:.0f} |", flush=True)


if __name__ == "__main__":
    main()
