"""What a verify round costs inside `generate`'s loop on the hybrid of benchmarks/policy.py,
in a run of verifies and between plain steps (issue 24: the policy's round clock said a
1-draft verify costs ~1.4 plain steps; its probes and first rounds verify between plain
steps). A scripted policy repeats a pattern of spans (0: a plain step, pipelined as the
default policy's are: the next one is built before this one's tokens are read), the oracle
drafter at p = 0.8; the wall time of each pattern, less the plain steps at the all-plain
pattern's cost a round, over the verify rounds, in plain-decoding steps. Also what the round
clock (`depth` to `observe`) of each kind of round held, and the time on no round's clock.

    .venv/bin/python benchmarks/probes/verify_between_plain.py [--reps 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from typing import Any

import _on_path  # noqa: F401  (benchmarks/ on the path, for policy and _fixtures)
from _fixtures import OracleDrafter
from _hybrid_run import hybrid_run

from kvstate.speculative import CostAwarePolicy, Decision, FixedCost, generate

PATTERNS = [[0], [1], [2], [4], [0, 0, 1], [0, 0, 2], [0] * 7 + [2], [0, 1], [1, 1, 1, 0]]


class Scripted(CostAwarePolicy):
    """Spans from a repeating pattern; each round's clock kept by the kind of round."""

    def __init__(self, pattern: list[int]) -> None:
        super().__init__(cost=FixedCost(lambda w: 1.0))
        self.pattern, self.at, self.spans = pattern, 0, Counter[int]()
        self.clocks: dict[str, list[float]] = defaultdict(list)
        self._start: float | None = None
        self._previous = -1

    def _next(self) -> int:
        self.at += 1
        return self.pattern[(self.at - 1) % len(self.pattern)]

    def depth(self, k: int, room: Sequence[int], *, cheap: bool | None = None) -> int:
        self._start = time.perf_counter()
        return min(self._next(), max(0, room[0] - 1))

    def plain_ahead(self, k: int, room: Sequence[int]) -> bool:
        self._start = time.perf_counter()
        if self.pattern[self.at % len(self.pattern)] != 0:
            return False
        self._next()
        self.plain(1)
        return True

    def cut(
        self, counts: Sequence[int], room: Sequence[int], labels: Any = None, drafts: Any = None
    ) -> list[int]:
        out = [min(c, max(0, r - 1)) for c, r in zip(counts, room, strict=True)]
        self.last = Decision(max(counts), out, max(out), 1.0, 1.0, False)
        self._pending = (out, [None])
        return out

    def observe(self, accepted: Any, width: Any = None, *, timed: bool = True) -> None:
        span = self.last.span if self.last is not None else 0
        if self._start is not None:
            kind = "plain" if span == 0 else f"verify {span}"
            after = "a plain step" if self._previous == 0 else "a verify"
            self.clocks[f"{kind} after {after}"].append(time.perf_counter() - self._start)
        self._start, self._previous = None, span
        self.spans[span] += 1
        self._pending = None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    n = args.tokens
    target, vocab, prompt, truth = hybrid_run(n)

    def scripted(pattern: list[int]) -> tuple[float, Scripted]:
        policy = Scripted(pattern)
        start = time.perf_counter()
        list(generate(target, [prompt], OracleDrafter(truth, 0.8, vocab), max_tokens=n, k=8,
                      policy=policy))  # fmt: skip
        return time.perf_counter() - start, policy

    def plain(tokens: int) -> float:
        start = time.perf_counter()
        list(generate(target, [prompt], None, max_tokens=tokens))
        return time.perf_counter() - start

    for pattern in PATTERNS:  # warm every shape up
        scripted(pattern)
    walls: dict[str, list[float]] = defaultdict(list)
    policies: dict[str, Scripted] = {}
    plains, prefills = [], []
    for _ in range(args.reps):  # interleaved
        plains.append(plain(n))
        prefills.append(plain(1))
        for pattern in PATTERNS:
            wall, policies[str(pattern)] = scripted(pattern)
            walls[str(pattern)].append(wall)
    prefill = statistics.median(prefills)
    step = (statistics.median(plains) - prefill) / (n - 1)  # plain decoding's step
    every = policies["[0]"]
    per_plain = (statistics.median(walls["[0]"]) - prefill) / sum(every.spans.values())
    print(f"plain decoding: {step * 1e3:.2f} ms a step; the all-plain pattern in the "
          f"generator: {per_plain / step:.3f} of it a round\n")  # fmt: skip
    print("| pattern | wall ms (median, range) | rounds | a verify, in plain steps |")
    print("|---|---|---|---|")
    for pattern in PATTERNS:
        name, spans = str(pattern), policies[str(pattern)].spans
        wall = statistics.median(walls[name])
        verifies = sum(v for w, v in spans.items() if w)
        cost = (wall - prefill - spans[0] * per_plain) / verifies / step if verifies else 0.0
        print(f"| {name} | {wall * 1e3:.0f} ({min(walls[name]) * 1e3:.0f}-"
              f"{max(walls[name]) * 1e3:.0f}) | {dict(spans)} | {cost:.2f} |")  # fmt: skip
    for name in ("[0, 0, 1]", "[0, 1]"):
        policy = policies[name]
        held = {k: round(statistics.median(v) * 1e3, 2) for k, v in sorted(policy.clocks.items())}
        total = sum(sum(v) for v in policy.clocks.values())
        off = statistics.median(walls[name]) - prefill - total
        print(f"\n{name}, the round clocks' medians (ms): {held}; on no round's clock: "
              f"{off * 1e3:.0f} ms, {off / policy.spans[1] * 1e3:.1f} ms a verify")  # fmt: skip


if __name__ == "__main__":
    main()
