"""Where the serving engine's n-gram speculation loses at 8 concurrent rows (issue 23: the
engine measured 0.77x of itself without a drafter on engine.py's code-like text, where
`generate` on one code prompt reaches 1.57x).

Prompts of one kind from benchmarks/policy_prompts.json (chat prompts through the chat
template). `--queue 1`: one request a row, all arriving at once, `--tokens` each (prefill is
one shared cost; the batch then runs until its slowest row ends). `--queue N`: rows x N
requests of drawn lengths through a batch of `--rows`, all queued at once (a closed loop: a
finished row's place is taken by the next request), which is what a server under a steady
load of `rows` clients sees. Contenders, interleaved, `--reps` times: the engine without a
drafter, with the n-gram drafter (its default policy; fixed k=4; the default with the
ragged commit as it was before its moves were shared by the layers), and with `--queue 1`
the batched generator (`generate` over the same prompts, with and without the n-gram
drafter). Each engine run reports its steps after the batch first filled, split by kind
(plain step: depth 0; verify: depth > 0), and each kind's mean milliseconds; then one
profiled run of two engine contenders, host functions by own and by cumulative time.

    PYTHONPATH=/tmp/site:/tmp/src python3 benchmarks/probes/engine_rounds.py --queue 4
    .venv/bin/python benchmarks/probes/engine_rounds.py --rows 2 --tokens 8 --reps 1
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import random
import statistics
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _on_path  # noqa: F401  (benchmarks/ on the path, for real_speed)
import mlx.core as mx
from real_speed import encoded, target_model

from kvstate import _dense
from kvstate._dense import padding_or_zeros
from kvstate._one_sync import materialise
from kvstate.adapters import wrap
from kvstate.engine import Engine, RequestParams
from kvstate.speculative import NGramDrafter, generate

HELD = Path(__file__).resolve().parents[1] / "policy_prompts.json"


Work = list[tuple[list[int], int]]  # (prompt, max_tokens) of each request, in arrival order


def work_of(tokenizer: Any, kind: str, count: int, tokens: int, queue: int) -> Work:
    """`count` requests of `kind`'s prompts in turn; with `queue` 1 each of `tokens`, else
    (a closed loop: more requests than rows) each of 0.5-1.5x `tokens`, drawn."""
    texts = json.loads(HELD.read_text())[kind]
    rng = random.Random(len(kind) + count)
    sizes = [tokens if queue == 1 else rng.randint(tokens // 2, tokens * 3 // 2)
             for _ in range(count)]  # fmt: skip
    return [(encoded(tokenizer, kind, texts[i % len(texts)]), sizes[i]) for i in range(count)]


class Timed:
    """One run: each request's tokens, wall seconds, and (the engine's) steps by kind after
    the batch first filled (plain step: depth 0; verify: depth > 0)."""

    def __init__(self) -> None:
        self.tokens: list[list[int]] = []
        self.seconds = 0.0
        self.kinds: dict[str, list[float]] = {"plain": [], "verify": []}
        self.acceptance = 0.0
        self.rounds: Counter[int] = Counter()  # steps by the policy's span
        self.reasons: Counter[str] = Counter()  # steps by the policy's reason for its span
        self.costs = ""


def run_engine(target: Any, work: Work, rows: int, **options: Any) -> Timed:
    engine = Engine(target, max_batch=rows, **options)
    requests = [engine.submit(p, RequestParams(max_tokens=n)) for p, n in work]
    out = Timed()
    started = time.perf_counter()
    full = False
    spans: list[int] = []  # each step's verified span (-1: not the policy's)
    reasons: list[str] = []  # each step's `Decision.reason`
    while engine.has_work():
        t0 = time.perf_counter()
        engine.step()
        took = time.perf_counter() - t0
        if full:
            out.kinds["verify" if engine._depth else "plain"].append(took)
            last = engine.policy.last if engine.policy is not None else None
            spans.append(-1 if last is None else last.span)
            if last is not None:
                reasons.append(last.reason)
        full = full or len(engine.running) == min(rows, len(work))
    out.seconds = time.perf_counter() - started
    out.tokens = [list(r.tokens) for r in requests]
    out.acceptance = engine.stats()["acceptance"]
    out.rounds = Counter(spans)
    out.reasons = Counter(reasons)
    if engine.policy is not None:
        out.costs = cost_table(engine.policy)
    return out


def cost_table(policy: Any) -> str:
    """What the policy's cost model holds: per batch size, per width, timings kept and their
    least (ms), and the ratios it would use at 8 rows."""
    times = policy.cost._times
    parts = []
    for rows in sorted(times):
        cells = [
            f"w{w}:{len(t)}x{1e3 * min(x for _, x in t):.1f}"
            for w, t in sorted(times[rows].items())
            if t
        ]
        parts.append(f"rows {rows}: " + " ".join(cells))
    ratios = " ".join(f"{policy.cost.ratio(8, w):.2f}" for w in range(1, 5))
    return "; ".join(parts) + f" | ratio(8, 1..4) {ratios}"


def run_generate(target: Any, work: Work, drafter: Any) -> Timed:
    out = Timed()
    rows: list[list[int]] = [[] for _ in work]
    started = time.perf_counter()
    for emitted in generate(target, [p for p, _ in work], drafter, max_tokens=work[0][1]):
        for t in emitted:
            rows[t.row].append(t.token)
    out.seconds = time.perf_counter() - started
    out.tokens = rows
    return out


def per_layer_commit_ragged(
    buffers: list[mx.array],
    left_padding: mx.array | None,
    length: int,
    appended: int,
    counts: tuple[int, ...],
) -> tuple[list[mx.array], mx.array, int]:
    """`kvstate._dense.commit_ragged` before its moves were shared by the layers (each layer
    built its gather index on the device): the contender "per-layer commit"."""
    batch = len(counts)
    start = length - appended
    new_length = start + max(counts)
    holes = mx.array([max(counts) - c for c in counts], mx.int32)
    ends = start + mx.array(counts, mx.int32)
    lp = padding_or_zeros(left_padding, batch)
    moved = mx.minimum(holes, ends - lp)
    width = max(max(counts) - c for c in counts)
    j = mx.arange(width, dtype=mx.int32)[None, :]
    skip = width - moved[:, None]
    dest = new_length - width + j
    src = mx.where(j >= skip, lp[:, None] + (j - skip), dest)
    index = src[:, None, :, None]
    moving = [mx.take_along_axis(a, index, axis=2) for a in buffers]
    materialise(moving)

    def fill(a: mx.array, block: mx.array) -> mx.array:
        out = a[...]
        out[..., new_length - width : new_length, :] = block
        return out

    return [fill(a, m) for a, m in zip(buffers, moving, strict=True)], lp + holes, new_length


def with_per_layer_commit(run: Callable[[], Timed]) -> Callable[[], Timed]:
    def patched() -> Timed:
        shared = _dense.commit_ragged
        _dense.commit_ragged = per_layer_commit_ragged
        try:
            return run()
        finally:
            _dense.commit_ragged = shared

    return patched


def profile(name: str, run: Callable[[], Timed], top: int) -> None:
    profiler = cProfile.Profile()
    profiler.enable()
    got = run()
    profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    count = sum(len(t) for t in got.tokens)
    print(f"--- {name}: {count} tokens, {stats.total_tt:.2f} s profiled", flush=True)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumtime").print_stats(top)
    lines = [line for line in text.getvalue().splitlines() if line.strip()]
    print("\n".join(lines[3:]), flush=True)


def measure_kind(target: Any, work: Work, kind: str, args: Any) -> None:
    rows = args.rows
    contenders: dict[str, Callable[[], Timed]] = {
        "engine plain": lambda: run_engine(target, work, rows),
        "engine ngram": lambda: run_engine(target, work, rows, drafter="ngram"),
        "engine ngram k=4": lambda: run_engine(target, work, rows, drafter="ngram",
                                               adaptive=False),
        "engine ngram, per-layer commit": with_per_layer_commit(
            lambda: run_engine(target, work, rows, drafter="ngram")
        ),
    }  # fmt: skip
    if args.queue == 1:  # the generator takes a fixed set of rows
        contenders["generate plain"] = lambda: run_generate(target, work, None)
        contenders["generate ngram"] = lambda: run_generate(target, work, NGramDrafter())
    if args.only:
        contenders = {name: run for name, run in contenders.items() if name in args.only}
    for run in contenders.values():  # warm: compile every shape once
        run()
    rates: dict[str, list[float]] = {name: [] for name in contenders}
    want = None
    for rep in range(args.reps):
        names = list(contenders)
        names = names[rep % len(names) :] + names[: rep % len(names)]
        for name in names:
            got = contenders[name]()
            count = sum(len(t) for t in got.tokens)
            rates[name].append(count / got.seconds)
            want = got.tokens if want is None else want
            same = sum(a == b for a, b in zip(got.tokens, want, strict=True))
            rounds = " ".join(
                f"{k} {len(v)} x {1e3 * statistics.mean(v):.2f} ms"
                for k, v in got.kinds.items()
                if v
            )
            print(
                f"{kind} rep {rep} {name}: {count} tokens {got.seconds:.3f} s "
                f"({count / got.seconds:.0f} tok/s) "
                f"acceptance {got.acceptance:.2f} {rounds} rows as the first run {same}/{len(want)}"
                + (
                    f"\n    spans {dict(sorted(got.rounds.items()))} "
                    f"reasons {dict(got.reasons.most_common())} costs {got.costs}"
                    if got.costs
                    else ""
                ),
                flush=True,
            )
    base = statistics.median(rates["engine plain"])
    for name in contenders:
        print(
            f"{kind} {name}: {statistics.median(rates[name]):.0f} tok/s "
            f"({statistics.median(rates[name]) / base:.2f}x engine plain)",
            flush=True,
        )
    if not args.no_profile:
        for name in ["engine plain", "engine ngram"]:
            profile(f"{kind} {name}", contenders[name], args.top)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kinds", nargs="+", default=["code", "prose"])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument(
        "--queue", type=int, default=1,
        help="requests per row: 1, every row's request arrives at once (and the generator runs "
        "too); N > 1, rows x N requests of drawn lengths through a batch of `rows` (a closed "
        "loop: a finished row's place is taken by the next request at once)",
    )  # fmt: skip
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--only", nargs="+", default=None, help="contenders by name")
    args = parser.parse_args()
    model, tokenizer = target_model(args.model, args.dtype)
    target = wrap(model)
    for kind in args.kinds:
        work = work_of(tokenizer, kind, args.rows * args.queue, args.tokens, args.queue)
        measure_kind(target, work, kind, args)


if __name__ == "__main__":
    main()
