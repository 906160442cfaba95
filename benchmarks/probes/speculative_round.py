"""What a speculative round costs in this checkout against an earlier commit, side by side:
does checking every proposal (on the host, and on the device with the round's one read) and
handing the drafter its own key cost a round anything measurable?

Per round of `generate` (a whole generation timed, divided by its rounds: prefill included),
on a tiny llama (2 layers, vocabulary 256) target with, as drafter, a tiny llama of the same
vocabulary (`ModelDrafter`), greedy and sampled (temperature 1), and prompt lookup
(`NGramDrafter`, greedy); 4 rows, k = 4, 48 tokens a row. Worker processes of the two
versions alternate (old, new, new, old, ...), as in benchmarks/hot_paths.py, whose helpers
this reuses; figures are medians over workers of new / old.

    .venv/bin/python benchmarks/probes/speculative_round.py --against 101a23c [--workers 6]
    python3 benchmarks/probes/speculative_round.py --against-tree DIR   # a machine without git
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import _on_path  # noqa: F401  (benchmarks/ on the path)
from hot_paths import ROOT, _export

HERE = Path(__file__).resolve().parent


def worker() -> dict[str, float]:
    """Seconds per round of each configuration (median of 5 timed generations)."""
    from kvstate.adapters import wrap
    from kvstate.adapters.tiny_models import tiny_model
    from kvstate.speculative import ModelDrafter, NGramDrafter, Sampler, generate

    target = wrap(tiny_model("llama", num_hidden_layers=2, seed=3))
    draft = wrap(tiny_model("llama", num_hidden_layers=2, seed=3, scale=3.9))
    prompts = [[3, 17, 42, 99, 7, 5, 3, 17, 42], [100, 101, 102, 5, 6, 7, 8, 9, 10]] * 2
    configs: dict[str, tuple[Any, Sampler]] = {
        "ModelDrafter, greedy": (lambda: ModelDrafter(draft), Sampler()),
        "ModelDrafter, sampled": (lambda: ModelDrafter(draft), Sampler(temperature=1.0)),
        "NGramDrafter, greedy": (lambda: NGramDrafter(), Sampler()),
    }
    out: dict[str, float] = {}
    for name, (make, sampler) in configs.items():
        times = []
        for i in range(6):  # the first is a warm-up
            start = time.perf_counter()
            rounds = 0
            for _ in generate(target, prompts, make(), k=4, max_tokens=48, sampler=sampler,
                              seed=i):  # fmt: skip
                rounds += 1
            if i:
                times.append((time.perf_counter() - start) / rounds)
        out[f"{name}: one round"] = statistics.median(times)
    return out


def _run_worker(source: Path) -> dict[str, float]:
    path = os.pathsep.join(p for p in (str(source), os.environ.get("PYTHONPATH", "")) if p)
    code = (
        "import sys, json; sys.path[:0] = [sys.argv[1], sys.argv[2]]; import hot_paths; "
        "hot_paths.use_adapters_of(sys.argv[3]); import speculative_round as s; "
        "print(json.dumps(s.worker()))"
    )
    run = subprocess.run(
        [sys.executable, "-c", code, str(HERE), str(ROOT / "benchmarks"), str(source)],
        env={**os.environ, "PYTHONPATH": path},
        cwd=source,
        capture_output=True,
        text=True,
        check=True,
    )
    result: dict[str, float] = json.loads(run.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", default="101a23c", help="the earlier commit")
    parser.add_argument(
        "--against-tree", type=Path, help="a folder holding the earlier version's files instead"
    )
    parser.add_argument("--workers", type=int, default=6, help="worker processes per version")
    args = parser.parse_args()
    old_tree = args.against_tree or _export(args.against)
    against = str(args.against_tree) if args.against_tree else args.against
    try:
        runs: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
        for i in range(args.workers):
            for side in ("old", "new") if i % 2 == 0 else ("new", "old"):
                runs[side].append(_run_worker(old_tree if side == "old" else ROOT))
            print(f"worker pair {i + 1}/{args.workers} done", file=sys.stderr)
    finally:
        if not args.against_tree:
            shutil.rmtree(old_tree.parent, ignore_errors=True)
    print(f"## speculative round: this checkout vs {against}\n")
    print("| configuration | old us/round | new us/round | new / old [IQR of pairs] |")
    print("|---|---|---|---|")
    for name in runs["new"][0]:
        olds = [r[name] for r in runs["old"]]
        news = [r[name] for r in runs["new"]]
        ratios = sorted(n / o for n, o in zip(news, olds, strict=True))
        q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
        print(
            f"| {name} | {statistics.median(olds) * 1e6:.0f} | {statistics.median(news) * 1e6:.0f}"
            f" | {statistics.median(ratios):.3f} [{q[0]:.2f}, {q[2]:.2f}] |"
        )


if __name__ == "__main__":
    main()
