"""The drafting policy on the hybrid of benchmarks/policy.py over oracle seeds (issue 24).
benchmarks/policy.py draws every contender's drafts from one seed, and the policy, which asks
for other depths than a fixed k, meets its own stretch of that stream: its figure moves with
its decisions' luck as much as with its rule. Here each repetition draws from another seed
(the same for every contender of that repetition), contenders interleaved in a rotating
order; printed: the median over repetitions of each contender's tokens/s over plain decoding
[25th, 75th percentile], and each policy over the best of plain and the fixed k listed (and,
where a fixed k is best, the median of each repetition's policy over that k's [quartiles]).

`--policies name=module:Class,...`: the policies compared (default: today's). To put an
older rule beside it, copy its _policy.py into the package under another name, with its
`CostAwarePolicy` subclassing today's (generate takes only a CostAwarePolicy), e.g.
`git show REV:kvstate/speculative/_policy.py > kvstate/speculative/_policy_old.py`, then
`--policies old=kvstate.speculative._policy_old:CostAwarePolicy,new=kvstate.speculative:CostAwarePolicy`.

`--draws position`: common random numbers. Each draft's fate is drawn per position of the
output (the draft at position j is right iff u[j] < p, u from the repetition's seed), not
from one stream in the order the drafts are asked for: the same law (each draft right with
probability p given the ones before it, independently), but every contender of a
repetition meets the same luck at the same tokens, so their ratios are compared on the same
draws (a fixed k and a policy no longer differ by which stretch of a stream they met). The
default (`stream`) is `OracleDrafter`'s, as benchmarks/policy.py runs it.

    .venv/bin/python benchmarks/probes/policy_seeds.py [--p 0.2,0.95] [--reps 10]
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import _on_path  # noqa: F401  (benchmarks/ on the path, for policy and _fixtures)
import mlx.core as mx
import numpy as np
from _fixtures import OracleDrafter
from _hybrid_run import hybrid_run

from kvstate.speculative import Proposal, Sampler, generate


class PositionOracle(OracleDrafter):
    """`OracleDrafter` with each draft's fate drawn per output position (`--draws position`)."""

    def __init__(self, truth: list[int], p: float, vocab: int, seed: int = 0) -> None:
        super().__init__(truth, p, vocab, seed)
        self.right = np.random.default_rng(seed).random(len(truth) + 64) < p

    def propose(self, last: list[int], k: int, sampler: Sampler) -> Proposal:
        true = (self.truth + [0] * (k + 1))[self.at : self.at + k]
        right = self.right[self.at : self.at + k]
        drafts = [t if ok else (t + 1) % self.vocab for t, ok in zip(true, right, strict=True)]
        return Proposal(mx.array([drafts], mx.int32), [k], None)


NEAR_BEST = {0.2: [1], 0.5: [1, 2], 0.8: [2, 3, 4, 5], 0.95: [5, 6, 7, 8]}  # fixed k timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--p", default="0.2,0.5,0.8,0.95")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--policies", default="policy=kvstate.speculative:CostAwarePolicy")
    parser.add_argument("--draws", choices=["stream", "position"], default="stream")
    args = parser.parse_args()
    policies: dict[str, Any] = {}
    for item in args.policies.split(","):
        name, spec = item.split("=")
        module, cls = spec.split(":")
        policies[name] = getattr(importlib.import_module(module), cls)
    n = args.tokens
    target, vocab, prompt, truth = hybrid_run(n)
    seed = [0]

    def ours(drafter: Any, **kw: Any) -> list[int]:
        return [t.token for r in generate(target, [prompt], drafter, max_tokens=n, **kw) for t in r]

    for p in (float(x) for x in args.p.split(",")):
        ks = NEAR_BEST.get(p, [1, 2, 4, 8])

        def oracle(p: float = p) -> OracleDrafter:
            make = PositionOracle if args.draws == "position" else OracleDrafter
            return make(truth, p, vocab, seed=seed[0])

        def fixed(k: int) -> list[int]:
            return ours(oracle(), k=k, adaptive=False)

        def adaptive(cls: Any) -> list[int]:
            return ours(oracle(), policy=cls())

        runs: dict[str, Callable[[], list[int]]] = {"plain": partial(ours, None)}
        for k in ks:
            runs[f"k={k}"] = partial(fixed, k)
        for name, cls in policies.items():
            runs[name] = partial(adaptive, cls)
        want = runs["plain"]()
        for name, run in runs.items():  # warm up, and check every output
            if run() != want:
                raise SystemExit(f"{name}: tokens differ from plain greedy decoding")
        times: dict[str, list[float]] = {name: [] for name in runs}
        names = list(runs)
        for rep in range(args.reps):
            seed[0] = rep
            for name in names[rep % len(names) :] + names[: rep % len(names)]:
                start = time.perf_counter()
                runs[name]()
                times[name].append(time.perf_counter() - start)
        over = {k: sorted(a / b for a, b in zip(times["plain"], v, strict=True))
                for k, v in times.items()}  # fmt: skip
        median = {k: statistics.median(v) for k, v in over.items()}
        best = max([1.0] + [median[f"k={k}"] for k in ks])
        cells = "  ".join(f"{k} {median[k]:.3f} [{v[len(v) // 4]:.2f}, {v[3 * len(v) // 4]:.2f}]"
                          for k, v in over.items() if k != "plain")  # fmt: skip
        shares = "  ".join(f"{name} / best {median[name] / best:.3f}" for name in policies)
        if best > 1.0:  # paired: each repetition's policy over the same repetition's best k
            top = max((f"k={k}" for k in ks), key=lambda k: median[k])
            for name in policies:
                pair = sorted(b / a for a, b in zip(times[name], times[top], strict=True))
                shares += (f"  {name} / {top} paired {statistics.median(pair):.3f} "
                           f"[{pair[len(pair) // 4]:.2f}, {pair[3 * len(pair) // 4]:.2f}]")  # fmt: skip
        print(f"p = {p}: {cells} | {shares}", flush=True)


if __name__ == "__main__":
    main()
