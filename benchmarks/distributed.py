"""kvstate on a tensor-parallel model, 2 processes: decode overhead and speculative speedup.

Run (it launches itself with `mlx.launch --backend ring -n 2` when started alone):

    .venv/bin/python benchmarks/distributed.py [--quick]
    mlx.launch --backend ring -n 2 .venv/bin/python benchmarks/distributed.py

1. Per-token decode, same sharded llama, same run: one 1-token step through `wrap` (which in
   a distributed model evaluates each forward's logits and state at once) vs the model on raw
   mlx-lm caches (`logits = model(y, cache=caches)`, then an eval of the logits and every
   cache array). Blocks of BLOCK steps interleaved in rotating order, both contexts growing
   alike; figure: the median of the per-repetition ratio time(raw) / time(kvstate)
   (>= 0.97 means kvstate costs at most 3% more per token), with its inter-quartile range,
   on the wall clock and on this process's CPU time (on a loaded 2-core machine the wall
   clock mostly measures how long each rank waits for the other to be scheduled).
   Also timed alone (no collectives): the host work a split model adds to each wrap step.
2. Speculative decoding on the sharded qwen3_5-style hybrid (gated delta + attention): the
   generator with a drafter that proposes the true greedy continuation, each draft right
   with probability 0.8 (as in the verify issue's figures), k = 4, against the same
   generator with no drafter (plain greedy steps). Both include the per-round agreement
   check of the ranks. Speedup = time(plain) / time(speculative); tokens are compared.

Rank 0 prints every row as it is measured. Models: random-init, fp32, sizes below.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

import mlx.core as mx
import numpy as np
from _harness import _quantile, environment, fmt_ratio, fmt_time, table
from mlx_lm.models.cache import make_prompt_cache

from kvstate.adapters import wrap
from kvstate.adapters.tiny_models import VOCAB, tiny_model
from kvstate.speculative import Proposal, Sampler, generate

SIZE = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 32,
}
HYBRID = {
    **SIZE,
    "model_type": "qwen3_5",
    "num_experts": 0,
    "linear_num_value_heads": 8,
    "linear_num_key_heads": 4,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
}
BLOCK = 32
PROMPT = [3, 17, 42, 99, 7, 250, 31, 8, 120, 64, 5, 77, 1, 2, 200, 9]


class OracleDrafter:
    """Drafts the true greedy continuation, each token right with probability p (a seeded
    choice, identical on every rank)."""

    def __init__(self, truth: list[int], p: float) -> None:
        self.truth, self.p, self.at = truth, p, 1
        self.rng = np.random.default_rng(0)

    def start(self, prompts: list[list[int]]) -> None:
        pass

    def propose(self, last: list[int], k: int, sampler: Sampler) -> Proposal:
        true = (self.truth + [0] * (k + 1))[self.at : self.at + k]
        drafts = [t if self.rng.random() < self.p else (t + 1) % VOCAB for t in true]
        return Proposal(mx.array([drafts], mx.int32), [k], None)

    def accept(self, fed: mx.array, kept: list[int]) -> None:
        self.at += kept[0]

    def keep_rows(self, rows: list[int]) -> None:
        pass


def decode_overhead(group: Any, reps: int, say: Any) -> None:
    model = tiny_model("llama", **SIZE)
    model.shard(group)
    m = wrap(model)
    caches = make_prompt_cache(model)
    raw_logits = model(mx.array([PROMPT]), cache=caches)
    logits, state = m([PROMPT], m.init_state())
    mx.eval(raw_logits, logits, [(c.keys, c.values) for c in caches])
    held = {"raw_y": mx.argmax(raw_logits[:, -1:], -1), "y": mx.argmax(logits[:, -1:], -1)}
    held["state"] = state

    def raw(_: Any) -> None:
        y = held["raw_y"]
        for _ in range(BLOCK):
            out = model(y, cache=caches)
            y = mx.argmax(out[:, -1:], -1)
            mx.eval(y, [(c.keys, c.values) for c in caches])
        held["raw_y"] = y

    def kv(_: Any) -> None:
        y, s = held["y"], held["state"]
        for _ in range(BLOCK):
            out, s = m(y, s)
            y = mx.argmax(out[:, -1:], -1)
            mx.eval(y)
        held["y"], held["state"] = y, s

    contenders = {"raw": raw, "kvstate": kv}
    wall: dict[str, list[float]] = {n: [] for n in contenders}
    cpu: dict[str, list[float]] = {n: [] for n in contenders}
    for r in range(reps + 2):  # two warm-up repetitions
        for name in ["raw", "kvstate"] if r % 2 == 0 else ["kvstate", "raw"]:
            w0, c0 = time.perf_counter(), time.process_time()
            contenders[name](None)
            if r >= 2:
                wall[name].append((time.perf_counter() - w0) / BLOCK)
                cpu[name].append((time.process_time() - c0) / BLOCK)
    rows = []
    for label, seconds in (("wall clock", wall), ("this process's CPU time", cpu)):
        ratios = sorted(a / b for a, b in zip(seconds["raw"], seconds["kvstate"], strict=True))
        stats = (statistics.median(ratios), _quantile(ratios, 0.25), _quantile(ratios, 0.75))
        rows.append(
            [
                label,
                fmt_time(statistics.median(seconds["raw"])),
                fmt_time(statistics.median(seconds["kvstate"])),
                fmt_ratio(stats),
            ]
        )
    # What a split model adds to wrap's step, without the collectives' scheduling noise:
    # stamping the placement and the eval walk over the state (arrays already evaluated).
    state, logits = held["state"], mx.zeros((1, 1, VOCAB))
    mx.eval(logits)
    n = 2000
    started = time.perf_counter()
    for _ in range(n):
        m.adopt(state, logits)
    added = (time.perf_counter() - started) / n
    rows.append(["host work a split model adds to a wrap step", "", fmt_time(added), ""])
    say("llama hidden 256, 4 layers, 8 q / 4 kv heads, tensor-sharded over 2 ranks; rank 0:\n")
    say(table(["per token", "raw mlx-lm caches", "kvstate", "raw / kvstate"], rows))


def speculative_speedup(group: Any, reps: int, tokens: int, say: Any) -> None:
    model = tiny_model("qwen3_next", **HYBRID)
    model.shard(group)
    m = wrap(model)
    truth = [t.token for r in generate(m, [PROMPT], None, max_tokens=tokens + 8) for t in r]
    times: dict[str, list[float]] = {"plain": [], "speculative": []}
    outputs: dict[str, list[int]] = {}
    for rep in range(reps + 1):
        order = ["plain", "speculative"] if rep % 2 == 0 else ["speculative", "plain"]
        for name in order:
            drafter = OracleDrafter(truth, 0.8) if name == "speculative" else None
            started = time.perf_counter()
            out = [
                t.token for r in generate(m, [PROMPT], drafter, k=4, max_tokens=tokens) for t in r
            ]
            elapsed = time.perf_counter() - started
            if rep:  # the first repetition warms up
                times[name].append(elapsed)
            outputs[name] = out
    same = outputs["plain"] == outputs["speculative"] == truth[:tokens]
    plain, spec = (statistics.median(times[n]) for n in ("plain", "speculative"))
    ratios = sorted(p / s for p, s in zip(times["plain"], times["speculative"], strict=True))
    say(
        table(
            [
                "model",
                "tokens",
                "plain greedy",
                "speculative (p=0.8, k=4)",
                "speedup",
                "same tokens",
            ],
            [
                [
                    "qwen3_5-style hybrid hidden 256, 4 layers, tensor-sharded over 2",
                    tokens,
                    f"{fmt_time(plain)} ({tokens / plain:.0f} tok/s)",
                    f"{fmt_time(spec)} ({tokens / spec:.0f} tok/s)",
                    f"**{statistics.median(ratios):.2f}x** [{ratios[0]:.2f}, {ratios[-1]:.2f}]",
                    "yes" if same else "**NO**",
                ]
            ],
        )
    )


def relaunch() -> int:
    """Start this script on 2 ranks (ring backend, loopback) and pass its output through."""
    launcher = shutil.which("mlx.launch") or os.path.join(
        os.path.dirname(sys.executable), "mlx.launch"
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [launcher, "--backend", "ring", "-n", "2", "--starting-port", str(port)]
    return subprocess.call([*command, sys.executable, os.path.abspath(__file__), *sys.argv[1:]])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (smoke run)")
    args = parser.parse_args()
    group = mx.distributed.init()
    if group.size() == 1:
        sys.exit(relaunch())
    say = print if group.rank() == 0 else (lambda *a, **k: None)
    say(f"## kvstate on a tensor-parallel model ({group.size()} ranks, ring backend)\n")
    say(environment(args.quick) + f"\n- ranks: {group.size()} processes on this machine\n")
    decode_overhead(group, 5 if args.quick else 21, say)
    say("")
    speculative_speedup(group, 2 if args.quick else 5, 24 if args.quick else 48, say)


if __name__ == "__main__":
    main()
