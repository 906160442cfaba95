"""The serving engine (`kvstate.engine`) against mlx-lm's `BatchGenerator` on the same arrival
schedule, and the engine with the n-gram drafter against itself without one.

A schedule: `c` requests, each with its own prompt (half of them behind a shared 32-token
system prompt) and its own max_tokens, each arriving before a random step of the first
half of the run; both systems take the requests that arrived, then make one step (the
engine's `step()`, mlx-lm's `BatchGenerator.next()`: one decode for every running row, and
prefill), until every request finished. Greedy, fp32, random-init models, batch bounds
equal (max_batch = completion_batch_size = c). A figure is generated tokens / wall time of
the whole schedule; ratios are medians of per-repetition ratios (interleaved runs) with
their inter-quartile range, and every run's tokens are compared with the other system's.

Code-like prompts (for the drafter): each prompt repeats a random 12-token "line" with small
edits, the shape of code and lists; the model is the target fine-tuned to nothing, so what
the n-gram drafter finds is the model's own repetition: the row reports the acceptance too.
Prose-like prompts: random tokens.

    .venv/bin/python benchmarks/engine.py [--sizes tiny,small] [--concurrency 1,8,32] [--reps 3]
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from _harness import Contender, environment, fmt_ratio, interleave, table
from mlx_lm.generate import BatchGenerator

from kvstate.adapters import wrap
from kvstate.adapters.tiny_models import tiny_model
from kvstate.engine import Engine, RequestParams

SIZES: dict[str, dict[str, Any]] = {
    "tiny": {},  # hidden 64, 4 layers, vocab 256
    "small": {
        "vocab_size": 4096, "hidden_size": 256, "num_hidden_layers": 8,
        "intermediate_size": 768, "num_attention_heads": 8, "num_key_value_heads": 4,
        "head_dim": 32,
    },
}  # fmt: skip

Schedule = list[tuple[int, list[int], int]]  # (arrival step, prompt, max_tokens)


def say(text: str) -> None:
    print(text, flush=True)


def schedule(c: int, vocab: int, seed: int, code: bool = False) -> Schedule:
    """`c` requests: (the step before which it arrives, its prompt, its max_tokens)."""
    rng = random.Random(seed)
    system = [rng.randrange(vocab) for _ in range(32)]
    out = []
    for i in range(c):
        if code:
            line = [rng.randrange(vocab) for _ in range(12)]
            own = []
            for _ in range(rng.randint(4, 8)):
                edited = list(line)
                edited[rng.randrange(12)] = rng.randrange(vocab)
                own += edited
        else:
            own = [rng.randrange(vocab) for _ in range(rng.randint(16, 64))]
        prompt = (system if i % 2 else []) + own
        out.append((0, prompt, rng.randint(32, 96)))
    horizon = max(1, sum(n for _, _, n in out) // (2 * c))
    return sorted(((rng.randrange(horizon) if i else 0, p, n) for i, (_, p, n) in enumerate(out)),
                  key=lambda x: x[0])  # fmt: skip


def run_engine(target: Any, plan: Schedule, c: int, drafter: Any = None) -> tuple[list[list[int]], dict]:
    engine = Engine(target, drafter() if callable(drafter) else drafter, max_batch=c)
    requests, i, step = [], 0, 0
    while i < len(plan) or engine.has_work():
        while i < len(plan) and plan[i][0] <= step:
            requests.append(engine.submit(plan[i][1], RequestParams(max_tokens=plan[i][2])))
            i += 1
        engine.step()
        step += 1
    return [r.tokens for r in requests], engine.stats()


def run_mlx_lm(model: nn.Module, plan: Schedule, c: int) -> list[list[int]]:
    gen = BatchGenerator(model, completion_batch_size=c, prefill_batch_size=min(c, 8))
    tokens: dict[int, list[int]] = {}
    order: list[int] = []
    open_uids: set[int] = set()
    i, step = 0, 0
    while i < len(plan) or open_uids:
        arrived = []
        while i < len(plan) and plan[i][0] <= step:
            arrived.append(plan[i])
            i += 1
        if arrived:
            uids = gen.insert([p for _, p, _ in arrived], max_tokens=[n for _, _, n in arrived])
            order += uids
            open_uids.update(uids)
            tokens.update({u: [] for u in uids})
        if open_uids:
            _, responses = gen.next()
            for r in responses:
                tokens[r.uid].append(int(r.token))
                if r.finish_reason is not None:
                    open_uids.discard(r.uid)
        step += 1
    gen.close()
    return [tokens[u] for u in order]


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    same = sum(x == y for x, y in zip(a, b, strict=True))
    return same / len(a)


def figures(
    plan: Schedule, runs: dict[str, Callable[[], Any]], reps: int
) -> tuple[dict[str, float], Any]:
    """Tokens/s per contender (median time; every request runs to its max_tokens: no stop
    ids) and the samples (a time ratio a / b is the speed ratio b / a)."""
    tokens = sum(n for _, _, n in plan)
    samples = interleave([Contender(name, lambda _, f=f: f()) for name, f in runs.items()], reps,
                         warmup=1)  # fmt: skip
    rates = {name: tokens / samples.median(name) for name in runs}
    return rates, samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="tiny,small")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    say(environment(False))
    for size in args.sizes.split(","):
        model = tiny_model("llama", **SIZES[size])
        target = wrap(model)
        vocab = target.vocab_size
        rows = []
        for c in [int(x) for x in args.concurrency.split(",")]:
            plan = schedule(c, vocab, args.seed + c)
            ours, _ = run_engine(target, plan, c)
            theirs = run_mlx_lm(model, plan, c)
            agree = agreement(ours, theirs)
            runs = {
                "engine": lambda p=plan, c=c: run_engine(target, p, c),
                "mlx-lm": lambda p=plan, c=c: run_mlx_lm(model, p, c),
            }
            rates, samples = figures(plan, runs, args.reps)
            rows.append([
                size, c, len(plan), f"{rates['engine']:.0f}", f"{rates['mlx-lm']:.0f}",
                fmt_ratio(samples.paired_ratio("mlx-lm", "engine")), f"{agree:.2f}",
            ])  # fmt: skip
            say(f"  {rows[-1]}")
        say("")
        say(f"### engine vs mlx-lm BatchGenerator ({size}; greedy, random arrivals)")
        say(table(["size", "concurrent", "requests", "engine tok/s", "mlx-lm tok/s",
                   "engine / mlx-lm", "same tokens"], rows))  # fmt: skip
        rows = []
        for kind, code in [("code-like", True), ("prose", False)]:
            for c in [int(x) for x in args.concurrency.split(",")]:
                plan = schedule(c, vocab, args.seed + 100 + c, code=code)
                plain, _ = run_engine(target, plan, c)
                drafted, stats = run_engine(target, plan, c, "ngram")
                runs = {
                    "ngram": lambda p=plan, c=c: run_engine(target, p, c, "ngram"),
                    "plain": lambda p=plan, c=c: run_engine(target, p, c),
                }
                rates, samples = figures(plan, runs, args.reps)
                rows.append([
                    size, kind, c, f"{rates['ngram']:.0f}", f"{rates['plain']:.0f}",
                    fmt_ratio(samples.paired_ratio("plain", "ngram")),
                    f"{stats['acceptance']:.2f}", f"{agreement(plain, drafted):.2f}",
                ])  # fmt: skip
                say(f"  {rows[-1]}")
        say("")
        say(f"### engine with the n-gram drafter vs without ({size}; greedy)")
        say(table(["size", "prompts", "concurrent", "ngram tok/s", "plain tok/s",
                   "ngram / plain", "acceptance", "same tokens"], rows))  # fmt: skip


if __name__ == "__main__":
    main()
