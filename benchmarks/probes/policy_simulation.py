"""The drafting policy's decision rule alone, on a simulated clock: how close does
`CostAwarePolicy` come to the best fixed k when every round costs exactly what a cost profile
says (no timing noise, no model)? Separates the rule's own losses (its exploratory first
rounds, its reaction to an early rejection) from what noisy timings on a real machine add.

A round verifying w drafts costs `profile(w)` plain steps; each draft is accepted with
probability p after the ones before it were (the oracle drafter's law); the policy's clock
advances by that cost. Printed: the best fixed k (0 = plain) and the policy, as tokens per
unit of time over plain decoding, means over seeds.

    .venv/bin/python benchmarks/probes/policy_simulation.py [--seeds 20]
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable

import _on_path  # noqa: F401

from kvstate.speculative import CostAwarePolicy

# Round cost over a plain step by verify width: an H200 launch-bound round (a verify costs
# about one step), a compute-bound CPU (each drafted token nearly a step), one between.
PROFILES: dict[str, Callable[[int], float]] = {
    "h200-like": lambda w: 1.0 if w == 0 else 1.15 + 0.03 * w,
    "between": lambda w: 1.0 if w == 0 else 1.1 + 0.15 * w,
    "cpu-like": lambda w: 1.0 if w == 0 else 1.3 + 0.45 * w,
}


def tokens_per_time(
    p: float, cost: Callable[[int], float], *, k: int | None, tokens: int, seed: int
) -> float:
    """One generation of `tokens` tokens at fixed `k`, or under a fresh policy (k None)."""
    rng = random.Random(seed)
    clock = [0.0]
    policy = None
    if k is None:
        policy = CostAwarePolicy(clock=lambda: clock[0])
        policy.begin(1)
    emitted = 0
    while emitted < tokens:
        room = [tokens - emitted]
        if policy is None:
            width = min(k or 0, max(0, room[0] - 1))
        else:
            asked = policy.depth(8, room, cheap=True)
            width = policy.cut([asked], room)[0] if asked else 0
            if not asked:
                policy.plain(1)
        accepted = 0
        while accepted < width and rng.random() < p:
            accepted += 1
        clock[0] += cost(width)
        if policy is not None:
            policy.observe([accepted])
        emitted += accepted + 1
    return tokens / clock[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--tokens", default="64,200")
    args = parser.parse_args()
    print(
        "| cost profile | p | tokens | best fixed k | best / plain | policy / plain | policy / best |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, cost in PROFILES.items():
        for p in (0.2, 0.5, 0.8, 0.95):
            for tokens in (int(t) for t in args.tokens.split(",")):

                def mean(
                    k: int | None,
                    p: float = p,
                    tokens: int = tokens,
                    cost: Callable[[int], float] = cost,
                ) -> float:
                    runs = [tokens_per_time(p, cost, k=k, tokens=tokens, seed=s)
                            for s in range(args.seeds)]  # fmt: skip
                    return sum(runs) / len(runs)

                fixed = {k: mean(k) for k in range(9)}
                best = max(fixed, key=lambda k: fixed[k])
                policy = mean(None)
                print(
                    f"| {name} | {p} | {tokens} | {best} | {fixed[best] / fixed[0]:.2f} | "
                    f"{policy / fixed[0]:.2f} | **{policy / fixed[best]:.2f}** |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
