"""kvstate on models split over processes: agree's cost, split vs one device, wrap's overhead.

Run (it launches itself with `mlx.launch --backend BACKEND -n RANKS` when started alone):

    .venv/bin/python benchmarks/distributed.py [--quick]                 # CPU, ring, 2 ranks
    .venv/bin/python benchmarks/distributed.py --parts agree --ranks 4   # agree vs world size
    python3 benchmarks/distributed.py --backend nccl --size 1b          # 2 GPUs (h200x2.sh)
    mlx.launch --backend ring -n 2 .venv/bin/python benchmarks/distributed.py

On CUDA each rank runs on its own GPU: `mlx.launch --backend nccl` sets CUDA_VISIBLE_DEVICES
per rank; started another way (mpirun, a scheduler) with MLX_RANK set and every GPU visible,
the script pins rank r to GPU (MLX_LOCAL_RANK or r) mod the GPU count before MLX starts.
Every rank prints the device it got.

Parts (`--parts`, in this order):

1. `agree`: what `kvstate.distributed.agree` costs per round, alone: the median (and 10th /
   90th percentile) over N calls of agree on a batch-1 round's decisions (3 ints: row,
   accepted, next token) and on a 32-row round's (96 ints), next to the raw collective it
   is made of (`mx.distributed.all_gather` of 3 int32, read on the host) and agree's host
   work alone (checking the values, hashing them). Calls are timed one by one, in blocks of each kind in rotating order.
2. `speed`: tokens/s of the split model (tensor-parallel llama and qwen3_5-style hybrid,
   pipelined qwen3_next-style hybrid) against the same model whole on one device (rank 0
   alone, the other ranks waiting), plain greedy and speculative (the oracle drafter: the
   model's own greedy continuation, each draft right with probability 0.8, K = 4), through
   `kvstate.speculative.generate` (whose split runs include the per-round `agree`).
   Interleaved repetitions, medians; the split run's time per round, and the share of it
   that agree's median (part 1) is. "same tokens": speculative = plain, on each side (the
   split and the whole model's greedy tokens are not compared: their sums run in another
   order; tests/test_distributed.py checks exactness in float32).
3. `decode`: per-token decode of the split llama through `wrap` (which in a split model
   evaluates each forward's logits and state at once) vs the model on raw mlx-lm caches,
   blocks of BLOCK steps interleaved; the median of the per-repetition ratio
   time(raw) / time(kvstate) (>= 0.97: kvstate costs at most 3% more per token), on the
   wall clock and on this process's CPU time (on a loaded 2-core machine the wall clock
   mostly measures how long each rank waits for the other to be scheduled), and the host
   work a split model adds to a wrap step, timed alone.

Rank 0 prints every row as it is measured. Models: random-init; `--size tiny` (hidden 256,
4 layers, float32: the CPU) or `--size 1b` (hidden 2048, 16 layers, ~1.1B, bfloat16: GPUs).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
from typing import Any


def _pin_gpu() -> None:
    """Give this rank one GPU before MLX starts, unless the launcher already did."""
    if "MLX_RANK" not in os.environ or "CUDA_VISIBLE_DEVICES" in os.environ:
        return
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return
    listed = subprocess.run([smi, "-L"], capture_output=True, text=True, check=False).stdout
    gpus = sum(line.startswith("GPU ") for line in listed.splitlines())
    if gpus:
        local = int(os.environ.get("MLX_LOCAL_RANK", os.environ["MLX_RANK"]))
        os.environ["CUDA_VISIBLE_DEVICES"] = str(local % gpus)


_pin_gpu()

import mlx.core as mx  # noqa: E402
from _fixtures import BIG_MODELS, OracleDrafter  # noqa: E402
from _harness import (  # noqa: E402
    Contender,
    _quantile,
    device_name,
    environment,
    fmt_ratio,
    fmt_time,
    interleave,
    table,
)
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from kvstate import distributed  # noqa: E402
from kvstate.adapters import wrap  # noqa: E402
from kvstate.adapters.tiny_models import tiny_model  # noqa: E402
from kvstate.speculative import generate  # noqa: E402

TINY = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 32,
}
TINY_HYBRID = {
    **TINY,
    "num_experts": 0,
    "linear_num_value_heads": 8,
    "linear_num_key_heads": 4,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
}
LARGE = {"llama": BIG_MODELS["llama"], "hybrid": BIG_MODELS["qwen3_next"]}  # ~1.1B each
# name -> (mlx-lm module of tiny_model, overrides by size, how the model is split)
MODELS: dict[str, tuple[str, dict[str, dict[str, Any]], str]] = {
    "llama": ("llama", {"tiny": TINY, "1b": LARGE["llama"]}, "shard"),
    "qwen3_5": (
        "qwen3_next",
        {
            "tiny": {**TINY_HYBRID, "model_type": "qwen3_5"},
            "1b": {**LARGE["hybrid"], "model_type": "qwen3_5"},
        },
        "shard",
    ),
    "qwen3_next": ("qwen3_next", {"tiny": TINY_HYBRID, "1b": LARGE["hybrid"]}, "pipeline"),
}
LABEL = {
    "llama": "llama",
    "qwen3_5": "qwen3_5-style hybrid",
    "qwen3_next": "qwen3_next-style hybrid",
}
BLOCK = 32
PROMPT = [3, 17, 42, 99, 7, 250, 31, 8, 120, 64, 5, 77, 1, 2, 200, 9]


def build(name: str, size: str, group: Any = None) -> Any:
    """The model, whole, or split over `group` as its row of MODELS says."""
    arch, sizes, how = MODELS[name]
    large = size == "1b"
    model = tiny_model(
        arch, scale=1.0 if large else 4.0, dtype=mx.bfloat16 if large else mx.float32,
        **sizes[size],
    )  # fmt: skip
    if group is not None:
        model.shard(group) if how == "shard" else model.model.pipeline(group)
    return model


def barrier(group: Any) -> None:
    distributed.agree([1], group, what="barrier")


# ---------------------------------------------------------------------------- 1. agree


def agree_cost(group: Any, calls: int, say: Any) -> float:
    """Rows of agree's cost per call; returns the median of the batch-1 agree (seconds)."""
    one, many = [0, 3, 17], [v for b in range(32) for v in (b, b % 5, 100 + b)]
    raw = mx.array([one], mx.int32)
    kinds = {
        "agree, batch-1 round (3 ints)": lambda: distributed.agree(one, group),
        "agree, 32-row round (96 ints)": lambda: distributed.agree(many, group),
        "raw all_gather of 3 int32, read on the host": lambda: mx.distributed.all_gather(
            raw, group=group
        ).tolist(),
        "raw all_gather of 3 int32 built from a list, read": lambda: mx.distributed.all_gather(
            mx.array([one], mx.int32), group=group
        ).tolist(),
        "agree's host work alone (checks, digest; 3 ints)": lambda: distributed._digest(
            distributed._checked_values(one, "")
        ),
        "agree's host work alone (checks, digest; 96 ints)": lambda: distributed._digest(
            distributed._checked_values(many, "")
        ),
    }
    blocks = 5
    contenders = [
        Contender(name, lambda _, f=f: f(), lambda: barrier(group), max(1, calls // blocks), True)
        for name, f in kinds.items()
    ]
    # Blocks of each kind in rotating order, the ranks meeting before each; the first warms up.
    seen = interleave(contenders, blocks, warmup=1, keep_gc=True).times
    rows = []
    for name, times in seen.items():
        times.sort()
        rows.append(
            [
                name,
                len(times),
                f"**{statistics.median(times) * 1e6:.1f}**",
                f"{_quantile(times, 0.1) * 1e6:.1f}",
                f"{_quantile(times, 0.9) * 1e6:.1f}",
            ]
        )
    say(f"agree per call, {group.size()} ranks; rank 0:\n")
    say(table(["call", "calls", "median us", "p10 us", "p90 us"], rows))
    return statistics.median(seen["agree, batch-1 round (3 ints)"])


# ---------------------------------------------------------------------------- 2. speed


def _run(m: Any, drafter: Any, tokens: int) -> list[Any]:
    return list(generate(m, [PROMPT], drafter, k=4, max_tokens=tokens))


def _timed(m: Any, tokens: int, reps: int) -> dict[str, Any]:
    """Plain and speculative runs of `m`, interleaved: median seconds, rounds, same tokens."""
    vocab = int(m.vocab_size)
    truth = [t.token for r in _run(m, None, tokens + 8) for t in r]  # also the warm-up
    rounds: dict[str, int] = {}
    outputs: dict[str, list[int]] = {}

    def seen(name: str, got: list[Any]) -> None:
        outputs[name], rounds[name] = [t.token for r in got for t in r], len(got)

    contenders = [
        Contender("plain", lambda _: _run(m, None, tokens)),
        Contender(
            "speculative", lambda d: _run(m, d, tokens), lambda: OracleDrafter(truth, 0.8, vocab)
        ),
    ]
    # The first repetition warms up the speculative shapes.
    samples = interleave(contenders, reps, warmup=1, keep_gc=True, check=seen)
    same = outputs["plain"] == outputs["speculative"] == truth[:tokens]
    return {
        **{n: samples.median(n) for n in ("plain", "speculative")},
        "rounds": rounds,
        "same": same,
    }


def speed(
    group: Any, names: list[str], size: str, tokens: int, reps: int, agree_s: float, say: Any
) -> None:
    rank = group.rank()
    say(
        f"tokens/s, batch 1, {tokens} tokens a run, median of {reps} interleaved runs; split "
        f"over {group.size()} ranks vs whole on one device (rank 0 alone); speculative: oracle "
        "drafter p = 0.8, K = 4; rank 0:\n"
    )
    header = ["model", "split", "plain: one device", "plain: split", "split / one",
              "spec: one device", "spec: split", "split / one", "spec / plain (split)",
              "split: per round (spec; plain)", "agree / round (spec; plain)", "same tokens"]  # fmt: skip
    say("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for name in names:
        one: dict[str, Any] | None = None
        if rank == 0:
            one = _timed(wrap(build(name, size)), tokens, reps)
        barrier(group)
        split = _timed(wrap(build(name, size, group)), tokens, reps)
        barrier(group)
        if one is None:
            continue
        how = MODELS[name][2]

        def tps(seconds: float) -> str:
            return f"{tokens / seconds:.0f}"

        per_round = [split[n] / split["rounds"][n] for n in ("speculative", "plain")]
        row = [
            f"{LABEL[name]} ({size})",
            "tensor" if how == "shard" else "pipeline",
            tps(one["plain"]),
            tps(split["plain"]),
            f"**{one['plain'] / split['plain']:.2f}x**",
            tps(one["speculative"]),
            tps(split["speculative"]),
            f"**{one['speculative'] / split['speculative']:.2f}x**",
            f"{split['plain'] / split['speculative']:.2f}x",
            "; ".join(fmt_time(t) for t in per_round),
            "; ".join(f"{agree_s / t:.1%}" for t in per_round),
            "yes" if one["same"] and split["same"] else "**NO**",
        ]
        say("| " + " | ".join(str(c) for c in row) + " |")


# ---------------------------------------------------------------------------- 3. decode


def decode_overhead(group: Any, size: str, reps: int, say: Any) -> None:
    model = build("llama", size, group)
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

    # Blocks of BLOCK steps (time per step), in alternating order; two warm-up repetitions.
    blocks = [Contender(n, f, units=lambda _: BLOCK) for n, f in (("raw", raw), ("kvstate", kv))]
    samples = interleave(blocks, reps, warmup=2, keep_gc=True)
    rows = []
    for label, cpu in (("wall clock", False), ("this process's CPU time", True)):
        rows.append(
            [
                label,
                fmt_time(samples.median("raw", cpu)),
                fmt_time(samples.median("kvstate", cpu)),
                fmt_ratio(samples.paired_ratio("raw", "kvstate", cpu)),
            ]
        )
    # What a split model adds to wrap's step, without the collectives' scheduling noise:
    # stamping the placement and the eval walk over the state (arrays already evaluated).
    state, logits = held["state"], mx.zeros((1, 1, int(m.vocab_size)))
    mx.eval(logits)
    adopt = Contender("adopt", lambda _: m.adopt(state, logits), inner=2000)
    added = interleave([adopt], 1, warmup=0, keep_gc=True).median("adopt")
    rows.append(["host work a split model adds to a wrap step", "", fmt_time(added), ""])
    say(f"llama ({size}) tensor-sharded over {group.size()} ranks, per token; rank 0:\n")
    say(table(["per token", "raw mlx-lm caches", "kvstate", "raw / kvstate"], rows))


# ---------------------------------------------------------------------------- launch


_LAUNCH = "from mlx._distributed_utils.launch import main; main()"


def relaunch(backend: str, ranks: int) -> int:
    """Start this script on `ranks` local processes and pass its output through."""
    beside = os.path.join(os.path.dirname(sys.executable), "mlx.launch")
    found = shutil.which("mlx.launch") or (beside if os.path.exists(beside) else None)
    launcher = [found] if found else [sys.executable, "-c", _LAUNCH]  # installed --target
    command = [*launcher, "--backend", backend, "-n", str(ranks)]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command += ["--starting-port" if backend == "ring" else "--nccl-port", str(port)]
    return subprocess.call([*command, sys.executable, os.path.abspath(__file__), *sys.argv[1:]])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (smoke run)")
    parser.add_argument("--backend", default="ring", choices=["ring", "nccl", "mpi", "jaccl"])
    parser.add_argument("--ranks", type=int, default=2, help="processes, when it launches itself")
    parser.add_argument("--size", default="tiny", choices=["tiny", "1b"])
    parser.add_argument("--parts", default="agree,speed,decode", help="agree,speed,decode")
    parser.add_argument("--models", default="llama,qwen3_5,qwen3_next")
    parser.add_argument("--tokens", type=int, default=0, help="tokens a run (0: by size)")
    parser.add_argument("--calls", type=int, default=0, help="agree calls (0: 2000, quick 300)")
    args = parser.parse_args()
    if "MLX_RANK" not in os.environ:  # not started by a launcher: launch the ranks
        sys.exit(relaunch(args.backend, args.ranks))
    group = mx.distributed.init(strict=True, backend=args.backend)
    rank = group.rank()
    say = (lambda *a, **k: print(*a, **k, flush=True)) if rank == 0 else (lambda *a, **k: None)
    say(f"## kvstate split over {group.size()} ranks ({args.backend} backend)\n")
    say(environment(args.quick) + f"\n- ranks: {group.size()}, size {args.size}")
    barrier(group)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
    print(f"- rank {rank}: {device_name()}, CUDA_VISIBLE_DEVICES={visible}", flush=True)
    barrier(group)
    say("")
    parts = args.parts.split(",")
    agree_s = float("nan")
    if "agree" in parts:
        agree_s = agree_cost(group, args.calls or (300 if args.quick else 2000), say)
        say("")
    if "speed" in parts:
        tokens = args.tokens or (24 if args.quick else 48 if args.size == "tiny" else 128)
        reps = 2 if args.quick else 5
        speed(group, args.models.split(","), args.size, tokens, reps, agree_s, say)
        say("")
    if "decode" in parts:
        decode_overhead(group, args.size, 5 if args.quick else 21, say)


if __name__ == "__main__":
    main()
