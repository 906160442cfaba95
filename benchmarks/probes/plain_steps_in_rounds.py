"""What a plain step costs inside the speculative generator against plain decoding (issue 24:
the policy must never fall below 0.97x of plain decoding; on the 2-core CPU it ran at
0.72-0.84x at p = 0.2 while verifying 6 of 127 rounds).

The random-init qwen3_next hybrid of benchmarks/policy.py, `--tokens` tokens: `generate` with
the oracle drafter at p = 0.2 under a policy whose costs say drafts never pay (`FixedCost`
of 100 plain steps a verify; probes every 64 rounds), so nearly every round is a plain step,
against `generate` without a drafter (pipelined: the next step is built while this one runs).
Interleaved repetitions, medians; then one profiled run of each, by own time.

    .venv/bin/python benchmarks/probes/plain_steps_in_rounds.py [--tokens 128] [--reps 5]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from collections.abc import Callable

import _on_path  # noqa: F401  (benchmarks/ on the path, for policy and _fixtures)
from _fixtures import OracleDrafter
from _hybrid_run import hybrid_run

from kvstate.speculative import CostAwarePolicy, FixedCost, generate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    n = args.tokens
    target, vocab, prompt, truth = hybrid_run(n)
    drafted = [0]

    def rounds() -> None:
        never = CostAwarePolicy(cost=FixedCost(lambda w: 100.0, plain=1.0), probe=64)
        run = generate(target, [prompt], OracleDrafter(truth, 0.2, vocab), max_tokens=n,
                       policy=never)  # fmt: skip
        list(run)
        drafted[0] = run.drafted

    def plain() -> None:
        list(generate(target, [prompt], None, max_tokens=n))

    contenders: dict[str, Callable[[], None]] = {"plain steps in rounds": rounds, "plain": plain}
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for run in contenders.values():
        run()
    for _ in range(args.reps):
        for name, run in contenders.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    rounds_s, plain_s = (statistics.median(times[name]) for name in contenders)
    print(f"{n} tokens: plain steps in rounds {rounds_s:.3f} s ({drafted[0]} drafts verified), "
          f"plain decoding {plain_s:.3f} s: {plain_s / rounds_s:.2f}x", flush=True)  # fmt: skip
    for name, run in contenders.items():
        profiler = cProfile.Profile()
        profiler.enable()
        run()
        profiler.disable()
        print(f"--- {name}", flush=True)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(6)


if __name__ == "__main__":
    main()
