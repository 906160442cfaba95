"""GPU check of `gated_delta_steps`: the kernel against the ops path, then timings.

1. Correctness. For tiny (Dk 16, as the test models use), odd (Dk 48, Dv 24: neither a
   multiple of 32 nor of the 4 rows a block holds) and realistic (qwen3_next: B 1, Hk 16,
   Hv 32, Dk = Dv = 128, bf16 q/k/v) shapes, T in 1, 2, 5, 9, 17, scalar and vector gating,
   with and without a mask: the max abs difference between the backend chosen on the default
   device (the CUDA kernel on an NVIDIA GPU) and mlx-lm's ops step run token by token on the
   same device, for y and for the state after every token.

   Tolerance, |kernel - ops| <= rtol * max|ops| per compared tensor. Both sides compute in
   float32 from the same inputs and differ only in the order of the two Dk-term sums per
   token (a warp butterfly against MLX's reduction), about Dk * 2^-24 relative per sum,
   carried through T tokens of a contractive recurrence (g < 1, |k| = 1): rtol 1e-4 for
   float32 outputs (states; y of float32 inputs). y in bf16 is that float32 value rounded, and
   two float32 values a hair apart can round to neighbouring bf16 values: rtol 2^-7, one bf16
   ulp at the largest magnitude. A wrong index or a lost update shows up as an O(1) error.
   Masked-out tokens leave the state bit-identical on both sides.

2. Timings for the realistic shape, T in 1, 5, 17 (median of 20 after warmup, each call
   ending in mx.eval): our kernel, the ops path (mlx-lm's step per token, every state kept),
   and mlx-lm's `gated_delta_update` (what models call today; on CUDA it runs the same ops
   loop, since mlx-lm's kernels are Metal-only, but keeps only the final state).

Run from the repository root: `python benchmarks/gated_delta_steps.py`. On a machine
without a GPU backend it still runs (the kernel rows then say "cpu: ops only").
"""

from __future__ import annotations

import importlib.util
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.gated_delta import compute_g, gated_delta_update, normalize_qk

ROOT = Path(__file__).resolve().parent.parent


def _load_gated_delta() -> ModuleType:
    """kvstate.adapters.kernels.gated_delta, installed or straight from this checkout."""
    try:
        from kvstate.adapters.kernels import gated_delta

        return gated_delta
    except ImportError:  # not installed: adapters/ becomes kvstate.adapters only on install
        sys.path.insert(0, str(ROOT))  # for `import kvstate` (needs attrs)
        spec = importlib.util.spec_from_file_location(
            "kvstate_gated_delta", ROOT / "adapters" / "kernels" / "gated_delta.py"
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module


gd = _load_gated_delta()


def say(line: str) -> None:
    print(line, flush=True)


def backend() -> str:
    if mx.default_device() == mx.gpu and mx.cuda.is_available():
        return "cuda kernel"
    if mx.default_device() == mx.gpu and mx.metal.is_available():
        return "metal kernel"
    return "cpu: ops only"


def make_inputs(
    B: int,
    T: int,
    Hk: int,
    Hv: int,
    Dk: int,
    Dv: int,
    dtype: mx.Dtype,
    vectorized: bool,
    masked: bool,
    seed: int = 0,
) -> dict[str, Any]:
    """Random inputs shaped like a gated delta layer's: normalized q/k, g in (0, 1)."""
    rng = np.random.default_rng(seed)

    def normal(*shape: int) -> mx.array:
        return mx.array(rng.standard_normal(shape).astype(np.float32))

    q, k = normalize_qk(normal(B, T, Hk, Dk), normal(B, T, Hk, Dk), inv_scale=Dk**-0.5, eps=1e-6)
    g_shape = (B, T, Hv, Dk) if vectorized else (B, T, Hv)
    mask = None
    if masked:
        mask = mx.array(rng.random((B, T)) < 0.6)
        mask[:, 0] = False  # at least one masked-out token
    return {
        "q": q.astype(dtype),
        "k": k.astype(dtype),
        "v": normal(B, T, Hv, Dv).astype(dtype),
        "g": mx.array(rng.uniform(0.5, 1.0, g_shape).astype(np.float32)),
        "beta": mx.sigmoid(normal(B, T, Hv)).astype(dtype),
        "state": 0.1 * normal(B, Hv, Dv, Dk),
        "mask": mask,
    }


def rtol_for(dtype: mx.Dtype) -> float:
    return 2.0**-7 if dtype in (mx.bfloat16, mx.float16) else 1e-4


def check(name: str, shape: tuple[int, int, int, int, int], dtype: mx.Dtype) -> bool:
    """Print one line per (T, gating, mask): max |kernel - ops| for y and all states."""
    B, Hk, Hv, Dk, Dv = shape
    ok = True
    for T in (1, 2, 5, 9, 17):
        for vectorized in (False, True):
            for masked in (False, True):
                inputs = make_inputs(B, T, Hk, Hv, Dk, Dv, dtype, vectorized, masked, seed=T)
                label = (
                    f"{name:<9} B{B} Hk{Hk} Hv{Hv} Dk{Dk} Dv{Dv} T{T:<2} "
                    f"{'vector' if vectorized else 'scalar'} {'mask' if masked else 'nomask'}"
                )
                y, states = gd.gated_delta_steps(**inputs)
                ref_y, ref_states = gd.gated_delta_steps(**inputs, use_kernel=False)
                dy, tol_y = _diff(y, ref_y)
                ds, tol_s = _diff(states, ref_states)
                good = dy <= tol_y and ds <= tol_s
                ok &= good
                verdict = "PASS" if good else "FAIL"
                if backend() == "cpu: ops only":  # both sides are the ops path: a smoke test
                    verdict += " (cpu: ops only)"
                say(
                    f"{label}  y {dy:.2e} (tol {tol_y:.1e})  states {ds:.2e} "
                    f"(tol {tol_s:.1e})  {verdict}"
                )
    return ok


def _diff(actual: mx.array, expected: mx.array) -> tuple[float, float]:
    """(max |actual - expected|, tolerance rtol * max|expected|)."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    a = actual.astype(mx.float32)
    e = expected.astype(mx.float32)
    diff = mx.max(mx.abs(a - e)).item()
    scale = max(mx.max(mx.abs(e)).item(), 1e-6)
    return float(diff), rtol_for(expected.dtype) * float(scale)


def median_ms(fn: Callable[[], Any], warmup: int = 3, reps: int = 20) -> float:
    for _ in range(warmup):
        mx.eval(fn())
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def timings() -> None:
    B, Hk, Hv, Dk, Dv = 1, 16, 32, 128, 128
    say("")
    say(f"timings, B{B} Hk{Hk} Hv{Hv} Dk{Dk} Dv{Dv}, bf16 q/k/v, scalar gating, no mask (ms)")
    columns = ["T", "gated_delta_steps", "ops path, all states", "mlx-lm gated_delta_update"]
    say("| " + " | ".join(columns) + " |")
    say("|---" * len(columns) + "|")
    for T in (1, 5, 17):
        x = make_inputs(B, T, Hk, Hv, Dk, Dv, mx.bfloat16, vectorized=False, masked=False)
        rng = np.random.default_rng(T)
        a = mx.array(rng.standard_normal((B, T, Hv)).astype(np.float32)).astype(mx.bfloat16)
        b = mx.array(rng.standard_normal((B, T, Hv)).astype(np.float32)).astype(mx.bfloat16)
        A_log = mx.array(rng.uniform(0.0, 2.0, (Hv,)).astype(np.float32))
        dt_bias = mx.array(rng.standard_normal((Hv,)).astype(np.float32))
        # The same gates mlx-lm derives inside gated_delta_update, computed once, untimed.
        g, beta = compute_g(A_log, a, dt_bias), mx.sigmoid(b)
        mx.eval(g, beta)
        args = (x["q"], x["k"], x["v"], g, beta, x["state"])
        ops = median_ms(lambda args=args: gd.gated_delta_steps(*args, use_kernel=False))
        ours = (
            "cpu: ops only"
            if backend() == "cpu: ops only"
            else f"{median_ms(lambda args=args: gd.gated_delta_steps(*args)):.3f}"
        )
        mlx_lm = median_ms(
            lambda x=x, a=a, b=b, A_log=A_log, dt_bias=dt_bias: gated_delta_update(
                x["q"], x["k"], x["v"], a, b, A_log, dt_bias, x["state"]
            )
        )
        say(f"| {T} | {ours} | {ops:.3f} | {mlx_lm:.3f} |")


def main() -> int:
    say(f"mlx {mx.__version__}, default device {mx.default_device()}, backend: {backend()}")
    ok = True
    ok &= check("tiny", (2, 1, 2, 16, 16), mx.float32)
    ok &= check("tiny-bf16", (2, 1, 2, 16, 16), mx.bfloat16)
    ok &= check("odd", (2, 2, 4, 48, 24), mx.bfloat16)
    ok &= check("real", (1, 16, 32, 128, 128), mx.bfloat16)
    say(f"correctness: {'ALL PASS' if ok else 'SOME FAIL'}")
    timings()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
