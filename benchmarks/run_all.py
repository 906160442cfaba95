"""Run every kvstate benchmark and write the results to stdout as markdown.

    .venv/bin/python benchmarks/run_all.py            # full run (~4 min on a 2-core CPU)
    .venv/bin/python benchmarks/run_all.py --quick    # fewer repetitions (~1 min)
    .venv/bin/python benchmarks/run_all.py --only decode commit
    .venv/bin/python benchmarks/run_all.py --large    # decode's ~1.1B model on a CPU too

Decode runs first, so a run cut short by a time limit still has it.

Every figure is a ratio of two contenders timed side by side in this one run (interleaved
repetitions, median of per-repetition ratios), so it survives a noisy, shared machine
better than absolute times do. A benchmark that fails is reported, not hidden, and the
others still run.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from collections.abc import Callable
from functools import partial

import batch_ops
import commit
import decode
import snapshot
from _harness import environment

BENCHMARKS: dict[str, Callable[[bool], str]] = {
    "decode": decode.run,
    "snapshot": snapshot.run,
    "commit": commit.run,
    "batch_ops": batch_ops.run,
}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (smoke run)")
    parser.add_argument("--only", nargs="+", choices=list(BENCHMARKS), help="run only these")
    parser.add_argument(
        "--large", action="store_true", help="decode: the ~1.1B bf16 model (default on a GPU)"
    )
    args = parser.parse_args()
    if args.large:
        BENCHMARKS["decode"] = partial(decode.run, large=True)
    names = args.only or list(BENCHMARKS)
    print(f"# kvstate benchmarks\n\n{environment(args.quick)}\n", flush=True)
    failed = 0
    for name in names:
        start = time.perf_counter()
        try:
            section = BENCHMARKS[name](args.quick)
        except Exception:  # report and go on: one broken benchmark must not hide the rest
            failed += 1
            section = f"## {name}: FAILED\n\n```\n{traceback.format_exc()}```"
        took = time.perf_counter() - start
        print(f"{section}\n\n_({name}: {took:.0f} s wall)_\n", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
