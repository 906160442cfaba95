"""What one forward of a wrapped real model costs at `B` rows and `w` tokens a row, on ragged
rows (merged from prompts of different lengths, as the engine's batch is): the cost curve a
speculative round's verify (w = drafts + 1) is weighed against (w = 1, a plain step).

Each (B, w): `--reps` forwards from one prefilled state (as a verify runs from the committed
state), each evaluated, median milliseconds; and w = 1 chained (each forward from the
previous one's state, as plain decoding runs), synchronous and pipelined (the next forward
built while the device runs this one, as `generate` decodes). Printed as measured.

    PYTHONPATH=/tmp/site:/tmp/src python3 benchmarks/probes/batch_step_cost.py
    .venv/bin/python benchmarks/probes/batch_step_cost.py --rows 1 2 --widths 1 3 --reps 2
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import _on_path  # noqa: F401  (benchmarks/ on the path, for real_speed)
import mlx.core as mx
from engine_rounds import work_of
from real_speed import target_model

import kvstate as ks
from kvstate.adapters import wrap


def evaluated(*things: Any) -> None:
    ks.eval(list(things))


def ragged_state(target: Any, prompts: list[list[int]]) -> tuple[Any, mx.array]:
    """The merged state of `prompts` prefilled one by one, and each row's next token."""
    states, nexts = [], []
    for p in prompts:
        logits, state = target.prefill(mx.array([p]), target.init_state(1))
        states.append(state)
        nexts.append(logits.argmax(-1))
    merged = ks.merge(states)
    evaluated(merged)
    return merged, mx.concatenate(nexts)


def median_ms(run: Any, reps: int) -> float:
    run()  # compile this shape
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def measure_rows(target: Any, prompts: list[list[int]], b: int, args: Any) -> None:
    state, nxt = ragged_state(target, prompts)
    for w in args.widths:
        ids = mx.repeat(nxt[:, None], w, axis=1)

        def verify(ids: mx.array = ids) -> None:
            logits, new = target(ids, state)
            evaluated(logits, new)

        print(f"B={b} w={w} from one state: {median_ms(verify, args.reps):.2f} ms", flush=True)
    steps = 16
    chained = {"s": state, "t": nxt[:, None]}

    def sync_steps() -> None:
        s, t = chained["s"], chained["t"]
        for _ in range(steps):
            logits, s = target(t, s)
            t = logits[:, -1].argmax(-1)[:, None]
            evaluated(t, s)
        chained["s"], chained["t"] = s, t

    def pipelined_steps() -> None:
        s, t = chained["s"], chained["t"]
        for _ in range(steps):
            logits, s = target(t, s)
            t = logits[:, -1].argmax(-1)[:, None]
            mx.async_eval([t, *ks.tree_flatten(s)[0]])
        evaluated(t, s)
        chained["s"], chained["t"] = s, t

    for name, run in [("chained sync", sync_steps), ("chained pipelined", pipelined_steps)]:
        chained["s"], chained["t"] = state, nxt[:, None]
        ms = median_ms(run, max(2, args.reps // 5)) / steps
        print(f"B={b} w=1 {name}: {ms:.2f} ms a step", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--widths", type=int, nargs="+", default=[1, 2, 3, 5, 9])
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    model, tokenizer = target_model(args.model, args.dtype)
    target = wrap(model)
    for b in args.rows:
        measure_rows(target, [p for p, _ in work_of(tokenizer, "code", b, 1, 1)], b, args)


if __name__ == "__main__":
    main()
