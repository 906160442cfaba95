"""Time to the first token and peak memory of a prompt's prefill: kvstate's `generate` against
mlx-lm's `generate_step`, on a random-init llama with Qwen's vocabulary (151,936).

Each measurement runs in a process of its own (peak memory is per process), contenders
alternating (mlx-lm, kvstate, kvstate, mlx-lm, ...), so drift on a shared machine hits both.
A process builds the model (bf16, seeded: the same weights in every process), warms up on a
64-token prompt, then times the prompt from the call to the first token on the host (the
median of 5 calls for 512 tokens, else one call):
- mlx-lm: `next(generate_step(prompt, model, max_tokens=1, prefill_step_size=2048))`;
- kvstate: `next(generate(wrap(model), [prompt], None, max_tokens=1, prefill_step_size=2048))`;
- kvstate, one forward (with --old, or at the smallest size): what `generate` prefilled with
  before (`m(prompt, m.init_state())`, the logits of every position, the last one read).
Peak memory: MLX's peak above the memory held before the call (the weights), and the
process's maximum resident set. A figure is the median over processes; the ratios are
kvstate / mlx-lm (target: <= 1.05).

    .venv/bin/python benchmarks/prefill.py --quick    # 512 and 4k tokens, one process each
    .venv/bin/python benchmarks/prefill.py            # 512 / 4k / 16k, 3 processes each
    python3 benchmarks/prefill.py --large             # a 1.5B llama (hidden 2048, 16 layers): the H200
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 151_936  # Qwen's
STEP = 2048  # mlx-lm's prefill_step_size default, and kvstate's

# Small enough that a 16k-token prompt finishes on a 2-core CPU (~5 GFLOP/s).
SMALL = {
    "vocab_size": VOCAB,
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
}
LARGE = {
    "vocab_size": VOCAB,
    "hidden_size": 2048,
    "num_hidden_layers": 16,
    "intermediate_size": 8192,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
}
CONTENDERS = ("mlx-lm", "kvstate", "kvstate one forward")


def worker(contender: str, tokens: int, large: bool, seed: int) -> dict[str, Any]:
    """One measurement in this process: (seconds to the first token, MLX peak bytes above
    the weights, maximum resident set bytes, the first token)."""
    import mlx.core as mx
    import numpy as np

    from kvstate.adapters import wrap
    from kvstate.adapters.tiny_models import tiny_model

    model = tiny_model("llama", seed=0, scale=1.0, dtype=mx.bfloat16, **(LARGE if large else SMALL))
    prompt = [int(t) for t in np.random.default_rng(seed).integers(0, VOCAB, tokens)]
    target = wrap(model)

    def first_token(ids: list[int]) -> int:
        if contender == "mlx-lm":
            from mlx_lm.generate import generate_step

            steps = generate_step(mx.array(ids), model, max_tokens=1, prefill_step_size=STEP)
            return int(next(steps)[0])
        if contender == "kvstate":
            from kvstate.speculative import generate

            rounds = generate(target, [ids], None, max_tokens=1, prefill_step_size=STEP)
            return next(rounds)[0].token
        logits, _ = target(mx.array([ids]), target.init_state())
        return int(logits[0, -1].argmax().item())

    first_token(prompt[:64])  # warm-up: kernels, the wrapper's probe
    # Short prompts take a fraction of a second: the median of a few calls, each from
    # empty caches (the peak is the largest of them).
    seconds, peak = [], 0
    for _ in range(max(1, min(5, 4096 // tokens))):
        mx.synchronize()
        mx.clear_cache()
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        start = time.perf_counter()
        token = first_token(prompt)
        seconds.append(time.perf_counter() - start)
        peak = max(peak, mx.get_peak_memory() - before)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    return {"seconds": statistics.median(seconds), "peak": peak, "rss": rss, "token": token}


def measure(contender: str, tokens: int, large: bool, seed: int) -> dict[str, Any]:
    """`worker` in a fresh process."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    args = [sys.executable, __file__, "--worker", contender, "--tokens", str(tokens)]
    args += ["--seed", str(seed)] + (["--large"] if large else [])
    out = subprocess.run(args, capture_output=True, text=True, env=env, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{contender} at {tokens} tokens failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def mib(n: float) -> str:
    return f"{n / 2**20:,.0f}"


def run(sizes: list[int], processes: int, large: bool, old: bool) -> str:
    rows = []
    for tokens in sizes:
        contenders = ["mlx-lm", "kvstate"]
        if old or tokens == min(sizes):
            contenders.append("kvstate one forward")
        found: dict[str, list[dict[str, Any]]] = {c: [] for c in contenders}
        for rep in range(processes):
            order = contenders if rep % 2 == 0 else contenders[::-1]
            for c in order:
                found[c].append(measure(c, tokens, large, seed=rep))
                last = found[c][-1]
                print(
                    f"  {tokens:>6} {c:<20} {last['seconds']:8.2f} s  peak {mib(last['peak'])} MiB"
                    f"  rss {mib(last['rss'])} MiB",
                    file=sys.stderr,
                    flush=True,
                )
        med = {c: {k: statistics.median(r[k] for r in found[c]) for k in ("seconds", "peak", "rss")}
               for c in contenders}  # fmt: skip
        for c in contenders:
            m, ref = med[c], med["mlx-lm"]
            same = all(
                a["token"] == b["token"] for a, b in zip(found[c], found["mlx-lm"], strict=True)
            )
            rows.append(
                [
                    str(tokens),
                    c,
                    f"{m['seconds']:.2f}",
                    f"{m['seconds'] / ref['seconds']:.2f}x",
                    mib(m["peak"]),
                    f"{m['peak'] / ref['peak']:.2f}x",
                    mib(m["rss"]),
                    "yes" if same else "**no**",
                ]
            )
    header = ["prompt tokens", "contender", "TTFT s", "vs mlx-lm", "MLX peak MiB",
              "vs mlx-lm", "max RSS MiB", "first token = mlx-lm's"]  # fmt: skip
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="512 and 4k tokens, one process each")
    parser.add_argument("--large", action="store_true", help="a 1.5B llama (for a GPU)")
    parser.add_argument("--old", action="store_true", help="the one-forward prefill at every size")
    parser.add_argument("--sizes", type=str, default=None, help="prompt lengths, e.g. 512,4096")
    parser.add_argument("--processes", type=int, default=None, help="processes per contender")
    parser.add_argument("--worker", choices=CONTENDERS, help=argparse.SUPPRESS)
    parser.add_argument("--tokens", type=int, default=512, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.tokens, args.large, args.seed)))
        return
    sizes = [512, 4096] if args.quick else [512, 4096, 16384]
    if args.sizes:
        sizes = [int(s) for s in args.sizes.split(",")]
    processes = args.processes or (1 if args.quick else 3)
    import mlx.core as mx
    import mlx_lm

    config = LARGE if args.large else SMALL
    print(
        f"# prefill: llama {config['num_hidden_layers']} layers, hidden {config['hidden_size']}, "
        f"vocab {VOCAB}, bf16, random init; {mx.default_device()}; prefill_step_size {STEP}; "
        f"{processes} process(es) per contender and size; mlx {mx.__version__}, "
        f"mlx-lm {mlx_lm.__version__}; {time.strftime('%Y-%m-%d %H:%M %Z')}"
    )
    print(run(sizes, processes, args.large, args.old))


if __name__ == "__main__":
    main()
