"""The drafting policy in a serving engine's closed loop, on a simulated clock: `rows` rows
always running (a finished request's row is taken by the next one at once, as under a steady
load of `rows` clients), each request with its own per-draft acceptance, and a clock with
what the H200 showed (benchmarks/probes/engine_rounds.py, BENCHMARKS.md): a round's cost
hardly depends on its rows or width, the first round of each (rows, width) shape compiles
(tens of ms), the round after a row joins carries its merge, and the host stalls at random.
How close does `CostAwarePolicy` come to the best fixed k there? On the H200 it reached 1.05x
of plain decoding on code prompts where fixed k=4 reached 1.51x. `--drift`: the host's speed
also wanders (a random walk over the simulated clock, the same for every contender of a seed).

Printed per acceptance mix: tokens per unit of time over plain decoding, for fixed k = 1..k
and the policy, means over seeds; and the policy's spans.

`--policy module:Class` puts another rule in (a subclass of `CostAwarePolicy`).

    .venv/bin/python benchmarks/probes/engine_policy_simulation.py [--seeds 10] [--drift 0.05]
"""

from __future__ import annotations

import argparse
import importlib
import math
import random
import statistics
from collections import Counter
from typing import Any

import _on_path  # noqa: F401

from kvstate.speculative import CostAwarePolicy

PLAIN_S = 0.012  # a plain step over 8 rows on the H200 (SmolLM2-135M, bf16)
COMPILE_S = 0.040  # the first round of a new (rows, width) shape
MERGE_S = 0.006  # the round after a row joined (its merge runs then)


def round_cost(rows: int, width: int, rng: random.Random) -> float:
    """What the H200 measured, roughly: a verify costs 1.1-1.3 plain steps at any width up
    to 8 and any rows up to 16; one round in five stalls 1.5-3x (a shared host)."""
    base = PLAIN_S * (1.0 if width == 0 else 1.15 + 0.03 * width) * (1 + 0.01 * rows)
    return base * (rng.uniform(1.5, 3.0) if rng.random() < 0.2 else 1.0)


class Request:
    def __init__(self, rng: random.Random, mean_alpha: float, tokens: int) -> None:
        self.left = rng.randint(tokens // 2, tokens * 3 // 2)
        self.alpha = min(0.95, max(0.0, rng.betavariate(4, 4) * 2 * mean_alpha))
        self.matches = rng.uniform(0.5, 1.0)  # the chance the n-gram finds a match a round


class HostSpeed:
    """How slow the host runs at a time: a random walk of its logarithm over 50 ms steps of
    the simulated clock, `drift` per step, within 0.5x-2x (the H200's host moved ~2x within
    one call). A function of the clock and the seed alone: every contender of a seed meets
    the same host at the same time."""

    def __init__(self, seed: int, drift: float) -> None:
        self.rng, self.drift, self.factors = random.Random(10_000 + seed), drift, [1.0]

    def at(self, t: float) -> float:
        step = int(t / 0.05)
        while len(self.factors) <= step:
            x = math.log(self.factors[-1]) + self.rng.gauss(0.0, self.drift)
            self.factors.append(math.exp(min(math.log(2.0), max(math.log(0.5), x))))
        return self.factors[step]


def simulate(mean_alpha: float, k: int | None, *, rows: int, requests: int, tokens: int,
             most: int, seed: int, drift: float = 0.0,
             make: Any = CostAwarePolicy) -> tuple[float, Counter[int]]:  # fmt: skip
    """Tokens per second of `requests` through `rows` rows at fixed `k` (0: plain), or
    under a fresh default policy (k None), and the spans the rounds verified. `drift`: the
    host's speed moves (`HostSpeed`)."""
    rng = random.Random(seed)
    work = [Request(rng, mean_alpha, tokens) for _ in range(requests)]
    clock, shapes, spans = [0.0], set(), Counter()
    host = HostSpeed(seed, drift)
    policy = make(clock=lambda: clock[0]) if k is None else None
    if policy is not None:
        policy.begin(0)
    running: list[Request] = []
    emitted, joined = 0, False
    while work or running:
        if work and len(running) < rows:  # the next request joins (prefilled outside the clock)
            running.append(work.pop(0))
            if policy is not None:
                policy.join(1)
            joined = True
            continue
        room = [r.left for r in running]
        proposed = [most if rng.random() < r.matches else 0 for r in running]
        if policy is None:
            counts = [min(k or 0, p, max(0, r - 1)) for p, r in zip(proposed, room, strict=True)]
        else:
            asked = policy.depth(most, room)
            counts = [0] * len(running)
            if asked:
                counts = policy.cut([min(asked, p) for p in proposed], room)
            else:
                policy.plain(len(running))
        width = max(counts)
        accepted = []
        for r, c in zip(running, counts, strict=True):
            a = 0
            while a < c and rng.random() < r.alpha:
                a += 1
            accepted.append(a)
        cost = round_cost(len(running), width, rng) * host.at(clock[0])
        if (len(running), width) not in shapes:
            shapes.add((len(running), width))
            cost += COMPILE_S
        if joined:
            cost += MERGE_S
            joined = False
        clock[0] += cost
        if policy is not None:
            policy.observe(accepted)
        spans[width] += 1
        alive = []
        for i, (r, a) in enumerate(zip(running, accepted, strict=True)):
            got = min(a + 1, r.left)
            r.left -= got
            emitted += got
            if r.left > 0:
                alive.append(i)
        if len(alive) < len(running):
            running = [running[i] for i in alive]
            if policy is not None:
                policy.keep(alive)
    return emitted / clock[0], spans


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument(
        "--drift", type=float, default=0.0,
        help="the host's speed: a random walk of its log, this much per 50 ms (0: steady)",
    )  # fmt: skip
    parser.add_argument("--policy", default="kvstate.speculative:CostAwarePolicy")
    args = parser.parse_args()
    module, name = args.policy.split(":")
    options = dict(rows=args.rows, requests=args.requests, tokens=args.tokens, most=args.k,
                   drift=args.drift, make=getattr(importlib.import_module(module), name))  # fmt: skip
    for mean_alpha in (0.1, 0.25, 0.45, 0.65, 0.85):
        rates: dict[str, list[float]] = {}
        spans: Counter[int] = Counter()
        for seed in range(args.seeds):
            for k in [*range(args.k + 1), None]:
                rate, used = simulate(mean_alpha, k, seed=seed, **options)
                rates.setdefault("policy" if k is None else f"k={k}", []).append(rate)
                if k is None:
                    spans += used
        plain = statistics.mean(rates["k=0"])
        cells = [f"{name} {statistics.mean(r) / plain:.2f}" for name, r in rates.items()]
        best = max(statistics.mean(r) for name, r in rates.items() if name != "policy")
        share = statistics.mean(rates["policy"]) / best
        print(f"mean alpha {mean_alpha}: {'  '.join(cells)}  policy/best {share:.3f}  "
              f"spans {dict(sorted(spans.items()))}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
