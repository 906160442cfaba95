"""The MTP-style drafter (`MTPDrafter` with a DeepSeek-V3-style `MTPHead`) against plain greedy
decoding with the same target, on the CPU; rows printed as measured.

Random-init targets have no trained MTP head, so the head is trained here, briefly, to
predict the target's greedy tokens from its hidden states (distillation on random token
sequences, teacher forced; measured on greedy decoding from other prompts). Rows: plain greedy;
the random-init head (acceptance ~0: the cost of drafting for nothing); the trained head;
and the target itself as a "head" (every draft right, each costing a full target forward:
the upper bound on acceptance, not a speedup). Every row's tokens must equal plain greedy's.

    .venv/bin/python benchmarks/mtp.py [--tokens 64] [--steps 300]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim

from kvstate.adapters import MTPHead, wrap
from kvstate.adapters.tiny_models import tiny_model
from kvstate.speculative import MTPDrafter, Sampler, generate

TARGET = {"num_hidden_layers": 8}  # the tiny llama (hidden 64, vocab 256), 8 layers deep
# Weights x1.5 (not the tests' x4): greedy text then has structure (repeats), as real text
# does; at x4 a random model's next token is a pseudo-random function a head cannot learn
# (a trained head's acceptance stayed at 1-2%).
SCALE = 1.5


def say(text: str) -> None:
    print(text, flush=True)


class TargetHead:
    """The target as a draft head (ignores the hidden states): drafts what the target
    decodes. An upper bound on acceptance at a full target forward per draft."""

    def __init__(self, target: Any) -> None:
        self.target = target

    def init_state(self, batch_size: int = 1) -> Any:
        return self.target.init_state(batch_size)

    def __call__(self, hidden: mx.array, tokens: mx.array, state: Any, *, capture: bool = False):
        out = self.target(tokens, state, capture=capture, hidden=True)
        return (out[0], out[-1], *out[1:-1])


class Counting(MTPDrafter):
    """Counts the drafts proposed, for the acceptance rate."""

    proposed = 0

    def propose(self, last: list[int], k: int, sampler: Sampler) -> Any:
        proposal = super().propose(last, k, sampler)
        self.proposed += sum(proposal.counts)
        return proposal


def train(head: MTPHead, target: Any, steps: int, vocab: int) -> float:
    """Distillation on random token sequences: head position i (the target's hidden state
    at i - 1, token i) learns the target's greedy choice at i (its prediction of i + 1)."""
    tokens = mx.random.randint(0, vocab, (256, 32), key=mx.random.key(1))
    logits, _, hidden = target(tokens, target.init_state(tokens.shape[0]), hidden=True)
    labels = logits.argmax(-1)
    before = mx.concatenate([mx.zeros_like(hidden[:, :1]), hidden[:, :-1]], axis=1)
    mx.eval(labels, before)

    def loss(model: MTPHead, h: mx.array, x: mx.array, y: mx.array) -> mx.array:
        out, _ = model.forward(h, x)
        return nn.losses.cross_entropy(out, y, reduction="mean")

    step = nn.value_and_grad(head, loss)
    optimizer = optim.Adam(learning_rate=3e-3)
    value = mx.array(0.0)
    for i in range(steps):
        rows = mx.random.randint(0, tokens.shape[0], (32,), key=mx.random.key(100 + i))
        value, grads = step(head, before[rows], tokens[rows], labels[rows])
        optimizer.update(head, grads)
        mx.eval(head.trainable_parameters(), optimizer.state, value)
    return float(value.item())


def decode(target: Any, prompts: list[list[int]], drafter: Any, k: int, n: int):
    start = time.perf_counter()
    out: list[list[int]] = [[] for _ in prompts]
    drafted = 0
    for tokens in generate(target, prompts, drafter, k=k, max_tokens=n):
        for t in tokens:
            out[t.row].append(t.token)
            drafted += t.from_draft
    return out, drafted, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args()
    model = tiny_model("llama", scale=SCALE, **TARGET)
    target = wrap(model)
    vocab, n = target.vocab_size, args.tokens
    test_prompts = mx.random.randint(0, vocab, (4, 4), key=mx.random.key(8)).tolist()
    say(f"# mtp: llama {TARGET['num_hidden_layers']} layers, hidden {model.args.hidden_size}, "
        f"vocab {vocab}, weights x{SCALE}; {mx.default_device()}; {n} tokens, k={args.k}, "
        f"batch 1, 4 prompts x {args.reps} reps")  # fmt: skip
    start = time.perf_counter()
    trained = MTPHead(model)
    final = train(trained, target, args.steps, vocab)
    say(f"trained a head: {args.steps} steps of 32 random sequences x 32 positions, final "
        f"loss {final:.2f}, {time.perf_counter() - start:.0f} s")  # fmt: skip

    heads = {
        "plain greedy": None,
        "MTP head, random init": lambda: MTPHead(model),
        f"MTP head, trained ({args.steps} steps)": lambda: trained,
        "the target as its own head": lambda: TargetHead(target),
    }
    # totals per drafter: seconds, tokens, drafts accepted, drafts proposed, all equal to plain
    totals = {name: [0.0, 0, 0, 0, True] for name in heads}
    for make in heads.values():  # warm-up, untimed
        decode(target, test_prompts[:1], None if make is None else Counting(make()), args.k, 8)
    for _ in range(args.reps):  # interleaved, so that the machine's noise hits every row
        for prompt in test_prompts:
            truth = None
            for name, make in heads.items():
                drafter = None if make is None else Counting(make())
                out, drafted, spent = decode(target, [prompt], drafter, args.k, n)
                truth = truth or out[0]
                row = totals[name]
                row[0], row[1], row[2] = row[0] + spent, row[1] + n, row[2] + drafted
                row[3] += 0 if drafter is None else drafter.proposed
                row[4] = row[4] and out[0] == truth
    say(f"{'drafter':38} {'tok/s':>8} {'vs plain':>9} {'accepted':>9}  same tokens as plain")
    baseline = totals["plain greedy"][1] / totals["plain greedy"][0]
    for name, (seconds, emitted, drafted, proposed, same) in totals.items():
        rate = emitted / seconds
        accepted = f"{drafted / proposed:9.0%}" if proposed else f"{'-':>9}"
        say(f"{name:38} {rate:8.1f} {rate / baseline:8.2f}x {accepted}  {same}")


if __name__ == "__main__":
    main()
