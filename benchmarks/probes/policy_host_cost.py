"""What the drafting policy costs the host per round (issue 24): `depth`, `cut` (drafts and
labels stated, as `NGramDrafter` states them), `emitted` and `observe` over a batch of rows,
on scripted proposals made before the clock starts. A round of the engine's 8 SmolLM2 rows
takes ~18 ms on the H100, so each 0.1 ms here is ~0.5% of it.

`--before FILE`: a copy of an earlier kvstate/speculative/_policy.py (`git show
REV:kvstate/speculative/_policy.py > /tmp/before.py`), timed in the same run, interleaved.

    .venv/bin/python benchmarks/probes/policy_host_cost.py [--rows 8] [--before /tmp/before.py]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

from policy_replay import rule_from

from kvstate.speculative import CostAwarePolicy

LABELS = [(n, c) for n in (1, 2, 3) for c in (1, 2, 3)]


def scripted(rows: int, k: int, rounds: int, seed: int) -> list[tuple[Any, ...]]:
    """Per round: drafts, labels, and the tokens each row emits (a random accepted prefix
    of its drafts, then one more)."""
    rng = random.Random(seed)
    out = []
    for _ in range(rounds):
        drafts = [[rng.randrange(50) for _ in range(k)] for _ in range(rows)]
        labels = [rng.choice(LABELS) for _ in range(rows)]
        kept = [rng.randrange(k + 1) for _ in range(rows)]
        out.append((drafts, labels, kept))
    return out


def per_round(make: Any, script: list[tuple[Any, ...]], rows: int, k: int) -> float:
    """Seconds per round of the policy `make()` over the script (its first 200 rounds warm)."""
    policy = make()
    policy.begin(rows)
    room = [1 << 20] * rows
    start = None
    for i, (drafts, labels, kept) in enumerate(script):
        if i == 200:
            start = time.perf_counter()
        policy.depth(k, room, cheap=True)
        cut = policy.cut([k] * rows, room, labels, drafts)
        accepted = [min(a, c) for a, c in zip(kept, cut, strict=True)]
        policy.emitted([[*d[:a], 99] for d, a in zip(drafts, accepted, strict=True)])
        policy.observe(accepted)
    assert start is not None
    return (time.perf_counter() - start) / (len(script) - 200)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=1200)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--before", default=None)
    args = parser.parse_args()
    rules = {"now": CostAwarePolicy}
    if args.before:
        rules = {"before": rule_from(args.before), **rules}
    script = scripted(args.rows, args.k, args.rounds, 0)
    times: dict[str, list[float]] = {name: [] for name in rules}
    for rep in range(args.reps):
        order = list(rules.items())
        for name, make in order[rep % len(order) :] + order[: rep % len(order)]:
            times[name].append(per_round(make, script, args.rows, args.k))
    for name, ts in times.items():
        print(f"{name}: {statistics.median(ts) * 1e6:.0f} us per round ({args.rows} rows, k={args.k}; "
              f"median of {args.reps})")  # fmt: skip


if __name__ == "__main__":
    main()
