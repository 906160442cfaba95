"""The drafting policy's rule on a simulated clock shaped like `generate`'s loop (issue 24):
plain steps pipelined (after a plain round the policy's `plain_ahead` says whether the next
is plain before its tokens are read), a verify costs `profile(w)` plain steps, and a verify
that follows a plain step the policy could not build ahead first waits for that step (the
pipeline's drain, `--drain` plain steps, on no round's clock: benchmarks/probes/
verify_between_plain.py measured 0.05-0.4 on the 2-core CPU). Each draft is accepted with
probability p after the ones before it were (the oracle's law). Printed: the policy's tokens
per unit of time over the best fixed k (every round a verify of k, or plain), means over
seeds; with `--detail`, the time each kind of round lost against the best fixed k's rate.
The drafter is cheap (asked for every draft, the cut decides) unless `--dear-drafter`.

`--policy module:Class` puts another rule in (a subclass of `CostAwarePolicy`); `--low`
replaces the cost model's figure per width (the least of its timings) by the lower quartile
or the median; `--noisy` draws each round's cost as measured on the CPU (5% of rounds
0.83-0.92x, 5% stalled 1.3-3x, the rest within ~3%).

    .venv/bin/python benchmarks/probes/policy_loop_simulation.py [--profile cpu] [--detail]
"""

from __future__ import annotations

import argparse
import importlib
import json
import random
import statistics
from collections import defaultdict
from collections.abc import Callable

import _on_path  # noqa: F401

import kvstate.speculative._policy as policy_module

# (a verify of w drafts in plain steps, the drain in plain steps)
PROFILES: dict[str, tuple[Callable[[int], float], float]] = {
    "cpu": (lambda w: 1.0 if w == 0 else 1.33 + 0.2 * w, 0.38),  # the hybrid on 2 cores
    "cpu-steep": (lambda w: 1.0 if w == 0 else 1.4 + 0.45 * w, 0.38),
    "between": (lambda w: 1.0 if w == 0 else 1.1 + 0.15 * w, 0.1),
    "h200": (lambda w: 1.0 if w == 0 else 1.15 + 0.03 * w, 0.0),  # host-bound
}
LOW: dict[str, Callable[[list[float]], float]] = {
    "min": min,
    "lq": lambda t: sorted(t)[len(t) // 4],
    "median": statistics.median,
}


def expected(p: float, w: int) -> float:
    return sum(p**i for i in range(w + 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--policy", default="kvstate.speculative:CostAwarePolicy")
    parser.add_argument("--options", default="{}", help="the policy's keywords, as JSON")
    parser.add_argument("--profile", default="cpu", choices=list(PROFILES))
    parser.add_argument("--drain", type=float, default=None, help="default: the profile's")
    parser.add_argument("--seeds", type=int, default=100)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--p", default="0.2,0.5,0.8,0.95")
    parser.add_argument("--low", choices=list(LOW), default=None)
    parser.add_argument("--noisy", action="store_true")
    parser.add_argument("--detail", action="store_true")
    parser.add_argument(
        "--dear-drafter",
        action="store_true",
        help="a drafter that is not cheap (asked for the policy's depth)",
    )
    args = parser.parse_args()
    module, name = args.policy.split(":")
    make = getattr(importlib.import_module(module), name)
    if args.low is not None:
        policy_module._low = LOW[args.low]  # type: ignore[assignment]
    cost, drain = PROFILES[args.profile]
    drain = drain if args.drain is None else args.drain
    out = []
    for p in (float(x) for x in args.p.split(",")):
        rates = {k: expected(p, k) / cost(k) for k in range(9)}
        best = max(rates, key=lambda k: rates[k])
        lost: dict[str, float] = defaultdict(float)
        rounds: dict[str, int] = defaultdict(int)
        total = tokens = 0.0
        for seed in range(args.seeds):
            draws, noise, clock = random.Random(seed), random.Random(1000 + seed), [0.0]
            policy = make(clock=lambda clock=clock: clock[0], **json.loads(args.options))
            policy.begin(1)
            emitted, ahead, drained = 0, False, False
            while emitted < args.tokens:
                room = [args.tokens - emitted]
                asked = 0 if ahead else policy.depth(8, room, cheap=not args.dear_drafter)
                width = policy.cut([asked], room)[0] if asked else 0
                if not asked and not ahead:
                    policy.plain(1)
                probe = bool(policy.last and policy.last.probe)
                accepted = 0
                while accepted < width and draws.random() < p:
                    accepted += 1
                seconds = cost(width)
                if args.noisy:
                    u = noise.random()
                    seconds *= (noise.uniform(0.83, 0.92) if u < 0.05 else noise.uniform(1.3, 3.0)
                                if u < 0.1 else noise.lognormvariate(0, 0.03))  # fmt: skip
                clock[0] += seconds
                left = args.tokens - emitted - accepted - 1
                extra, ahead = (drain if drained else 0.0), False
                drained = False
                policy.observe([accepted])
                if width == 0 and left > 2:
                    ahead = policy.plain_ahead(8, [left - 1])
                    if not ahead:  # the next round reads this step first, off its clock
                        drained = True
                        clock[0] += drain
                total += seconds + extra
                tokens += accepted + 1
                emitted += accepted + 1
                kind = ("probe" if probe else "rule") + f" w={width}"
                kind += " after a drained plain step" if extra else ""
                lost[kind] += seconds + extra - expected(p, width) / rates[best]
                rounds[kind] += 1
        out.append(f"p = {p}: {tokens / total / rates[best]:.3f}")
        if args.detail:
            print(f"p = {p}, best fixed k = {best} ({rates[best]:.2f}x plain): the policy "
                  f"{tokens / total / rates[best]:.3f} of it")  # fmt: skip
            for kind in sorted(lost, key=lambda x: -lost[x]):
                if abs(lost[kind]) > 0.003 * total:
                    print(f"    {kind:36s} {rounds[kind] / args.seeds:6.1f} rounds a run, "
                          f"lost {lost[kind] / total:+.3f} of the time")  # fmt: skip
    print(f"{args.profile}: policy / best fixed k, " + " | ".join(out))


if __name__ == "__main__":
    main()
