"""Where speculative rounds and decode steps lose time on a GPU: rounds with fixed acceptance
patterns (every draft kept, 3 of 4 kept, alternating, drawn at p=0.8), the pre-verify state held
or dropped, and decode steps through wrap with its per-step pieces switched off one at a time.

    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/probes/round_patterns.py          # on the H200
    .venv/bin/python benchmarks/probes/round_patterns.py --small                   # a CPU smoke run

Each row: median ms per round (or per token) over interleaved repetitions; printed as measured.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import _on_path  # noqa: F401  (benchmarks/ on the path, for verify)
import mlx.core as mx
import numpy as np
from verify import BIG, build, copied, prefilled, say

import kvstate as ks
from kvstate.adapters import to_mlx_lm, wrap
from kvstate.adapters.wrapped.forward import run


def rounds(m: Any, base: Any, pattern: Callable[[int], int], k: int, n: int, hold: bool) -> float:
    """ms per round of verify (1 + k tokens, capture) -> read logits -> commit."""
    state = copied(base)
    times = []
    y = 1
    for i in range(n + 3):
        start = time.perf_counter()
        fed = mx.array([[y, *range(2, 2 + k)]])
        if hold:
            logits, verified, checkpoints = m(fed, state, capture=True)
        else:
            box = [state]
            del state
            logits, verified, checkpoints = m(fed, box.pop(), capture=True)
        accepted = pattern(i)
        y = int(logits[0, accepted].argmax().item()) % 1000
        state = ks.commit_prefix(verified, accepted + 1, checkpoints)
        del verified, checkpoints, logits
        times.append(time.perf_counter() - start)
    mx.eval(ks.tree_flatten(state)[0])
    return statistics.median(times[3:]) * 1e3


def decode(step: Callable[[mx.array, Any], tuple[mx.array, Any]], start: Any, n: int) -> float:
    """ms per token of a pipelined greedy loop (like mlx-lm's generate_step)."""
    y = mx.array([1])
    state = start
    logits, state = step(y[:, None], state)
    y = logits[:, -1].argmax(-1)
    mx.eval(y)
    t = time.perf_counter()
    for _ in range(n):
        logits, state = step(y[:, None], state)
        nxt = logits[:, -1].argmax(-1)
        mx.async_eval(nxt)
        int(y.item())
        y = nxt
    mx.eval(y)
    return (time.perf_counter() - t) / n * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--model", default="llama", choices=list(BIG))
    args = parser.parse_args()
    context, n = (64, 8) if args.small else (1024, 60)
    model = build(args.model, args.small)
    m = wrap(model)
    base = prefilled(m, context)
    say(f"# round patterns: {args.model}, {mx.default_device()}, context {context}\n")
    rng = np.random.default_rng(0)
    drawn = [int(min(4, rng.geometric(0.2) - 1)) for _ in range(n + 3)]
    patterns: dict[str, Callable[[int], int]] = {
        "keep all 4": lambda i: 4,
        "keep 3 of 4": lambda i: 3,
        "keep 0 of 4": lambda i: 0,
        "alternate 4 / 1": lambda i: 4 if i % 2 else 1,
        "drawn, p=0.8": lambda i: drawn[i],
    }
    say("| pattern | held: ms / round | dropped: ms / round |")
    say("|---|---|---|")
    for repeat in range(2):
        for name, pattern in patterns.items():
            held = rounds(m, base, pattern, 4, n, True)
            dropped = rounds(m, base, pattern, 4, n, False)
            say(f"| {repeat}: {name} | {held:.2f} | {dropped:.2f} |")

    def raw_step(tokens: mx.array, caches: Any) -> tuple[mx.array, Any]:
        return model(tokens, cache=caches), caches

    def plain_step(tokens: mx.array, state: Any) -> tuple[mx.array, Any]:
        return m(tokens, state)

    def unguarded_step(tokens: mx.array, state: Any) -> tuple[mx.array, Any]:
        out = run(m.model, tokens, state)
        return out.logits, m.adopt(out.state)

    say("\n| decode contender | ms / token (median of 5) | / raw |")
    say("|---|---|---|")
    contenders = {"raw mlx-lm": raw_step, "wrap": plain_step, "wrap.run only": unguarded_step}
    found: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(5):
        for name, step in contenders.items():
            start = to_mlx_lm(copied(base)) if name == "raw mlx-lm" else copied(base)
            found[name].append(decode(step, start, 4 * n))
    raw = statistics.median(found["raw mlx-lm"])
    for name, times in found.items():
        say(f"| {name} | {statistics.median(times):.3f} | {statistics.median(times) / raw:.3f} |")


if __name__ == "__main__":
    main()
