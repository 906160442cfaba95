"""Does the verify kernel take a ragged batch's verify right, and what does it save?

1. `verify_attention` with each row's left padding (`first`) against MLX's attention with
   mlx-lm's padded causal mask (`causal_attention`), float32 and bfloat16: max abs error.
2. A wrapped model's verify forwards over ragged rows (prompts of different lengths, merged):
   for each (rows, width) the first forward at that shape (compiles, cuDNN graph builds) and
   the median of `--reps` more, with the kernel route (the default on CUDA) and without it
   (cuDNN over bucketed array masks, as before), and the max difference of their logits.
   `--reference float32`: both also against the same model in float32 through MLX's own
   attention (run with MLX_ENABLE_TF32=0): max difference and argmax agreement, so a bf16
   difference between the two routes can be told apart from either route erring.

    PYTHONPATH=/tmp/site:$PWD:$PWD/benchmarks KVSTATE_MODEL_CACHE=/tmp/models \\
        python3 benchmarks/probes/ragged_verify_kernel.py [--reference float32]
    .venv/bin/python benchmarks/probes/ragged_verify_kernel.py --model tiny --rows 2 --widths 2
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import _on_path  # noqa: F401  (benchmarks/ on the path, for real_speed)
import mlx.core as mx
import numpy as np

import kvstate as ks
from kvstate.adapters import wrap
from kvstate.adapters.kernels.verify_attention import causal_attention, verify_attention
from kvstate.adapters.tiny_models import tiny_model


def say(text: str) -> None:
    print(text, flush=True)


def kernel_check() -> None:
    rng = np.random.default_rng(0)
    for dtype in (mx.float32, mx.bfloat16):
        for rows, tokens, keys, dim in [(4, 2, 40, 64), (4, 5, 300, 64), (8, 9, 1029, 128),
                                        (3, 32, 70, 256)]:  # fmt: skip
            q = mx.array(rng.standard_normal((rows, 8, tokens, dim)), dtype)
            k = mx.array(rng.standard_normal((rows, 2, keys + 40, dim)), dtype)[..., :keys, :]
            v = mx.array(rng.standard_normal((rows, 2, keys + 40, dim)), dtype)[..., :keys, :]
            first = mx.array([int(x) for x in rng.integers(0, keys - tokens + 1, rows)], mx.int32)
            got = verify_attention(q, k, v, dim**-0.5, first).astype(mx.float32)
            want = causal_attention(q, k, v, dim**-0.5, first).astype(mx.float32)
            err = float(mx.abs(got - want).max())
            say(f"kernel {dtype} rows={rows} T={tokens} L={keys} D={dim}: max error {err:.2e}")


def model_of(name: str, dtype: str) -> tuple[Any, Any]:
    if name == "tiny":
        return tiny_model("llama", head_dim=32), None
    from real_speed import target_model

    return target_model(name, dtype)


def ragged(target: Any, rows: int, vocab: int) -> tuple[Any, mx.array]:
    rng = np.random.default_rng(rows)
    states = []
    for b in range(rows):
        prompt = [int(x) for x in rng.integers(0, vocab, 20 + 37 * b)]
        states.append(target(mx.array([prompt]), target.init_state(1))[1])
    state = ks.merge(states)
    ks.eval(state)
    return state, mx.array(rng.integers(0, vocab, (rows, 16)), mx.int32)


def timed(run: Any, reps: int) -> tuple[float, float]:
    start = time.perf_counter()
    run()
    first = time.perf_counter() - start
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return 1e3 * first, 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rows", type=int, nargs="+", default=[2, 5, 8])
    parser.add_argument("--widths", type=int, nargs="+", default=[2, 3, 5, 9])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--no-kernel-check", action="store_true")
    parser.add_argument("--reference", default=None, help="a dtype to compare both routes with")
    args = parser.parse_args()
    if not args.no_kernel_check and mx.cuda.is_available():
        kernel_check()
    model, _ = model_of(args.model, args.dtype)
    routed, bucketed = wrap(model), wrap(model, verify_kernel=False)
    reference = None
    if args.reference:
        reference = wrap(model_of(args.model, args.reference)[0], verify_kernel=False)
    for rows in args.rows:
        state, ids = ragged(routed, rows, routed.vocab_size)
        if reference is not None:
            reference_state = ragged(reference, rows, routed.vocab_size)[0]  # the same prompts
        for w in args.widths:
            out: dict[str, Any] = {}
            figures = []
            for name, target in (("kernel", routed), ("cuDNN", bucketed)):

                def verify(
                    target: Any = target,
                    name: str = name,
                    fed: mx.array = ids[:, :w],
                    start: Any = state,
                    out: dict[str, Any] = out,
                ) -> None:
                    logits, new = target(fed, start)
                    ks.eval([logits, new])
                    out[name] = logits

                first, steady = timed(verify, args.reps)
                figures.append(f"{name} first {first:.1f} ms, then {steady:.2f} ms")
            diff = float(mx.abs(out["kernel"].astype(mx.float32) - out["cuDNN"]).max())
            say(f"rows={rows} w={w}: {'; '.join(figures)}; logits differ by {diff:.2e}")
            if reference is not None:
                want = reference(ids[:, :w], reference_state)[0].astype(mx.float32)
                for name, got in out.items():
                    got = got.astype(mx.float32)
                    err = float(mx.abs(got - want).max())
                    same = float(mx.mean(got.argmax(-1) == want.argmax(-1)))
                    say(f"    {name} against {args.reference}: max difference {err:.3f}, "
                        f"argmax agrees at {same:.3f} of positions")  # fmt: skip


if __name__ == "__main__":
    main()
