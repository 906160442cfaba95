"""Where the drafting policy loses on the hybrid of benchmarks/policy.py (issue 24): one
generation per drawn acceptance p under the default `CostAwarePolicy`, every round written
down (its span, whether a probe, a calibration plain step "C" or a span halved from w "Hw"
to time a second width, the seconds its round clock timed, what the cost model held), then:
rounds, tokens and timed seconds by span; the time lost against plain decoding by reason,
from the round clock (each verify's seconds less its tokens at the run's pipelined plain
step, which two wall times are too noisy to show on a shared 2-core machine); the cost
ratios and acceptance held over the run; the cost timings behind a wide span drafted at a
low acceptance.

With `--smollm code,prose,chat`: SmolLM2-135M with prompt lookup on policy.py's prompts
instead, each run timed against plain decoding and fixed k = 8, and the policy's cost
timings both fresh (as `generate`'s default starts) and carried over from the run before.

    .venv/bin/python benchmarks/probes/policy_rounds.py [--p 0.2,0.95] [--reps 2] [--trace]
    .venv/bin/python benchmarks/probes/policy_rounds.py --smollm code --tokens 200 --trace
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from collections import Counter, defaultdict
from typing import Any

import _on_path  # noqa: F401  (benchmarks/ on the path, for policy and _fixtures)
from _fixtures import OracleDrafter
from _hybrid_run import hybrid_run

from kvstate.speculative import CostAwarePolicy, NGramDrafter, generate


class Logged(CostAwarePolicy):
    """The default policy, each round's decision and timing written down (`log`)."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.log: list[dict[str, Any]] = []
        self._tags = ""  # calibration "C" and halved spans "Hw" (not the policy's own `_why`)

    def depth(self, k: int, room: Any, *, cheap: bool | None = None) -> int:
        self._tags = ""
        return super().depth(k, room, cheap=cheap)

    def _calibrating(self, rows: int, score: float) -> bool:
        out = super()._calibrating(rows, score)
        self._tags += "C" if out else ""
        return out

    def _explored(self, rows: int, span: int) -> int:
        out = super()._explored(rows, span)
        self._tags += f"H{span}" if out != span else ""
        return out

    def observe(self, accepted: Any, width: Any = None, *, timed: bool = True) -> None:
        start, decision = self._started_at, self.last
        super().observe(accepted, width, timed=timed)
        times = getattr(self.cost, "_times", {}).get(1, {})
        self.log.append({
            "span": 0 if decision is None else decision.span,
            "probe": bool(decision and decision.probe),
            "why": ("" if decision is None else decision.reason) + self._tags,
            "accepted": sum(accepted),
            "seconds": None if start is None else self.clock() - start,
            "ratios": [round(self.cost.ratio(1, w), 2) for w in (1, 2, 4, 8)],
            "alpha": round(self.acceptance[0], 2),
            "table": {w: [round(x * 1e3, 1) for _, x in t] for w, t in times.items()},
        })  # fmt: skip


def report(log: list[dict[str, Any]], n: int, plain_s: float, trace: bool) -> None:
    by: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for e in log:
        by[f"{e['span']}{'p' if e['probe'] else ''} {e['why']}".strip()].append(e)
    print("| span | rounds | tokens | timed s | median ms |\n|---|---|---|---|---|")
    for tag in sorted(by, key=lambda t: (int(t.split()[0].rstrip("p")), t)):
        secs = [e["seconds"] for e in by[tag] if e["seconds"] is not None]
        tokens = sum(e["accepted"] + 1 for e in by[tag])
        median = statistics.median(secs) * 1e3 if secs else float("nan")
        print(f"| {tag} | {len(by[tag])} | {tokens} | {sum(secs):.3f} | {median:.1f} |")
    # a plain step after a plain step: pipelined
    steps = [b["seconds"] for a, b in itertools.pairwise(log)
             if a["span"] == 0 and b["span"] == 0 and b["seconds"]]  # fmt: skip
    step = statistics.median(steps) if steps else plain_s / n  # no plain step: plain decoding's
    lost: dict[str, float] = defaultdict(float)
    for i, e in enumerate(log):
        if e["seconds"] is None:
            continue
        what = "probes" if e["probe"] else "first 8 rounds" if i < 8 else "rule"
        if e["span"]:
            lost[what] += e["seconds"] - (e["accepted"] + 1) * step
        elif i and log[i - 1]["span"]:
            lost["plain steps after a verify"] += e["seconds"] - step
    cells = ", ".join(f"{k} {v / (n * step):+.3f}" for k, v in lost.items())
    print(f"time lost on the round clock, in {n} plain steps of {step * 1e3:.2f} ms: {cells}, "
          f"total {sum(lost.values()) / (n * step):+.3f} (the drain of the pipeline before a "
          "verify that follows a plain step is on no round's clock)")  # fmt: skip
    for lo, hi in itertools.pairwise([0, 4, 8, 16, 32, 64, 128, 1 << 30]):
        if log[lo:hi]:
            last = log[lo:hi][-1]
            spans = dict(sorted(Counter(e["span"] for e in log[lo:hi]).items()))
            print(f"rounds {lo}-{min(hi, len(log)) - 1}: spans {spans}; after them ratios "
                  f"(1, 2, 4, 8) {last['ratios']}, acceptance {last['alpha']}")  # fmt: skip
    odd = [i for i, e in enumerate(log) if i and e["span"] >= 3 and e["alpha"] < 0.5]
    if odd:
        i = odd[0]
        print(f"span {log[i]['span']} at acceptance {log[i]['alpha']} (round {i}): timings "
              f"held before it (ms) {log[i - 1]['table']}")  # fmt: skip
    if trace:
        for i, e in enumerate(log):
            ms = "-" if e["seconds"] is None else f"{e['seconds'] * 1e3:.1f}"
            print(i, e["span"], "probe" if e["probe"] else "", e["why"], e["accepted"], ms,
                  e["ratios"], e["alpha"])  # fmt: skip


def timed(run: Any) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def smollm(kinds: list[str], n: int, reps: int, trace: bool) -> None:
    from policy import loaded_smollm2, smollm_prompts

    from kvstate.adapters import wrap

    model, tokenizer = loaded_smollm2()
    target = wrap(model)
    prompts = {label.split()[0]: p for label, p in smollm_prompts(tokenizer).items()}

    def run(prompt: list[int], **kw: Any) -> None:
        drafter = NGramDrafter() if kw.pop("ngram", True) else None
        list(generate(target, [prompt], drafter, max_tokens=n, **kw))

    for kind in kinds:
        prompt = prompts[kind]
        run(prompt, k=8, adaptive=False)  # warm every shape
        run(prompt, policy=Logged())
        carried = Logged()
        run(prompt, policy=carried)
        for rep in range(reps):
            plain = timed(lambda: run(prompt, ngram=False))  # noqa: B023
            fixed = timed(lambda: run(prompt, k=8, adaptive=False))  # noqa: B023
            fresh = Logged()
            t_fresh = timed(lambda: run(prompt, policy=fresh))  # noqa: B023
            carried.log = []
            t_carried = timed(lambda: run(prompt, policy=carried))  # noqa: B023
            print(f"\n## {kind}, run {rep}: plain {plain:.3f} s, k=8 {plain / fixed:.2f}x, "
                  f"policy fresh {plain / t_fresh:.2f}x ({len(fresh.log)} rounds), carried "
                  f"over {plain / t_carried:.2f}x ({len(carried.log)} rounds)")  # fmt: skip
            for name, policy in (("fresh", fresh), ("carried over", carried)):
                print(f"### {name}")
                report(policy.log, n, plain, trace)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--p", default="0.2,0.5,0.8,0.95")
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--trace", action="store_true", help="print every round")
    parser.add_argument("--smollm", default="", help="SmolLM2 prompts: code,prose,chat")
    args = parser.parse_args()
    n = args.tokens
    if args.smollm:
        smollm(args.smollm.split(","), n, args.reps, args.trace)
        return
    target, vocab, prompt, truth = hybrid_run(n)
    list(generate(target, [prompt], OracleDrafter(truth, 0.5, vocab), max_tokens=n))  # warm
    for p in (float(x) for x in args.p.split(",")):
        for rep in range(args.reps):
            policy = Logged()
            start = time.perf_counter()
            list(generate(target, [prompt], OracleDrafter(truth, p, vocab), max_tokens=n,
                          policy=policy))  # fmt: skip
            total = time.perf_counter() - start
            start = time.perf_counter()
            list(generate(target, [prompt], None, max_tokens=n))
            plain = time.perf_counter() - start
            print(f"\n## p = {p}, run {rep}: {total:.3f} s, plain decoding {plain:.3f} s (one "
                  f"run each: {plain / total:.2f}x), {len(policy.log)} rounds")  # fmt: skip
            report(policy.log, n, plain, args.trace)


if __name__ == "__main__":
    main()
