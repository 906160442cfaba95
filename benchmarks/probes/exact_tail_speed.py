"""Decode-step time of QuantizedKV with and without its exact tail (`exact_latest`), beside
the unquantized state, on a real model: what reading the latest R tokens unquantized costs.

Each option prefills the same random prompt of CONTEXT tokens, then decodes STEPS tokens one
at a time (greedy, each step evaluated); the options take turns, REPS rounds, and each round's
ms/step is printed as it is measured, then the median and the ratio to K4/V3 Hadamard with no
tail (same round, side by side).

    python benchmarks/probes/exact_tail_speed.py MODEL_DIR [CONTEXT] [STEPS] [REPS]

MODEL_DIR: an mlx-lm model directory (e.g. the SmolLM2 cache `kvstate.adapters.load_model`
writes), read with `mlx_lm.utils.load_model` in bfloat16.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.utils import load_model

import kvstate as ks
from kvstate.adapters import wrap

K4V3 = {"key_bits": 4, "value_bits": 3, "group_size": 64, "rotation": "hadamard"}
OPTIONS = {
    "unquantized": None,
    "K4/V3 hadamard": K4V3,
    "K4/V3 hadamard exact32": {**K4V3, "exact_latest": 32},
    "K4/V3 hadamard exact64": {**K4V3, "exact_latest": 64},
}


def ms_per_step(m: object, options: dict | None, prompt: mx.array, steps: int) -> float:
    state = m.init_state()  # type: ignore[attr-defined]
    if options is not None:
        state = ks.quantize(state, **options)
    logits, state = m(prompt, state)  # type: ignore[operator]
    token = logits[:, -1].argmax(-1, keepdims=True)
    mx.eval(token, *ks.tree_flatten(state)[1])
    started = time.perf_counter()
    for _ in range(steps):
        logits, state = m(token, state)  # type: ignore[operator]
        token = logits[:, -1].argmax(-1, keepdims=True)
        mx.eval(token)
    return (time.perf_counter() - started) * 1000 / steps


def main() -> None:
    folder = Path(sys.argv[1])
    given = [int(a) for a in sys.argv[2:5]]
    context, steps, reps = [*given, *[2048, 64, 3][len(given) :]]
    model = load_model(folder)[0]
    model.set_dtype(mx.bfloat16)
    m = wrap(model)
    prompt = mx.random.randint(0, 40000, (1, context), key=mx.random.key(0))
    print(f"{folder.name}, bf16, {mx.default_device()}, context {context}, {steps} steps")
    times: dict[str, list[float]] = {name: [] for name in OPTIONS}
    ms_per_step(m, OPTIONS["K4/V3 hadamard exact32"], prompt[:, :64], 4)  # compile / warm up
    for rep in range(reps):
        for name, options in OPTIONS.items():
            times[name].append(ms_per_step(m, options, prompt, steps))
            print(f"  round {rep}: {name}: {times[name][-1]:.2f} ms/step", flush=True)
    print("\n| option | ms/step (median) | vs K4/V3 hadamard (paired median) |\n|---|---|---|")
    base = times["K4/V3 hadamard"]
    for name, ts in times.items():
        ratio = statistics.median(t / b for t, b in zip(ts, base, strict=True))
        print(f"| {name} | {statistics.median(ts):.2f} | {ratio:.3f}x |")


if __name__ == "__main__":
    main()
