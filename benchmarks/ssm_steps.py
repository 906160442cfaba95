"""`ssm_steps` (the Mamba2 SSM keeping the state after every token): check and time its
backend on this device against its ops path and mlx-lm's `ssm_update`.

1. Correctness, for a tiny shape (the test models': H 8, Dh 16, Ds 16, G 2, float32), an odd
   one (Dh 12, Ds 40: a block overhangs Dh and lanes overhang Ds) and a realistic one
   (nemotron_h-class: B 1, H 64, Dh 64, Ds 128, G 8, bf16 x / B / C / dt / D), L in
   1, 2, 5, 9, 17, without and with a left-padded mask: max |difference| of the backend
   `ssm_steps` picks here (the CUDA kernel on an NVIDIA GPU) against
     - its ops path on the same device (`ssm_steps(..., use_kernel=False)`): y and every state;
     - mlx-lm: y and the final state of `ssm_update` on all L tokens, and every
       states[:, t] against the final state of `ssm_update` on tokens 0..t.
   PASS when every element is within its bound (`worst` is the largest |difference| /
   bound over the row; <= 1 passes). Bounds are relative to the element's magnitude, the
   sum of the absolute values of the terms both sides add (the recurrence in float64 NumPy on
   |x|, |B|, |C|, |D|, |state|): rtol * magnitude with
     - states against the ops path: 64 * eps(float32) (both are float32 elementwise
       recurrences; they differ by FMA contraction and exp);
     - states against mlx-lm: 64 * eps(float32) (sums of <= 17 tokens, exp of sums against
       products of exps), or 4 * 2^-10 where MLX runs float32 matmuls in TF32 (MLX CUDA
       does unless MLX_ENABLE_TF32=0, and mlx-lm's chunked form is matmuls);
     - y: the bound of a matmul result (the ops path's y is one too), or 4 * eps(dtype) for
       bf16 / f16 activations (mlx-lm rounds C.B, y_ssm, x * D and their sum to the
       activation dtype, we round once: five roundings of eps / 2).
2. Timings for the realistic shape, L in 1, 5, 17: median of 20 calls after 3 warmup calls,
   each ending in mx.eval of everything it returns, in ms: our kernel, our ops path, mlx-lm's
   ssm_update (which returns y and the final state only).

On a CPU the kernel rows say "cpu: ops only" (the ops path is then what ssm_steps runs).
Every line is printed as soon as it is computed.

    python benchmarks/ssm_steps.py                         # from the repository root
    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/ssm_steps.py   # the H200, as the other scripts
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

import mlx.core as mx
import numpy as np
from mlx_lm.models.ssm import ssm_update

ROOT = Path(__file__).resolve().parents[1]


def _load_ssm() -> ModuleType:
    """This checkout's adapters/kernels/ssm.py, whether or not (and wherever) kvstate is installed:
    the GPU machine runs from a bare copy of the working tree."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))  # `from kvstate import ShapeError` inside it
    spec = importlib.util.spec_from_file_location(
        "kvstate_ssm_steps", ROOT / "adapters/kernels/ssm.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ssm = _load_ssm()


class Shape(NamedTuple):
    name: str
    b: int
    h: int
    dh: int
    ds: int
    g: int
    dtype: Any  # x, B, C, dt
    d_dtype: Any  # D
    time_step_limit: tuple[float, float]


TINY = Shape("tiny", 2, 8, 16, 16, 2, mx.float32, mx.float32, (0.0, float("inf")))
ODD = Shape("odd", 3, 6, 12, 40, 3, mx.bfloat16, mx.float32, (0.001, 100.0))
REAL = Shape("real", 1, 64, 64, 128, 8, mx.bfloat16, mx.bfloat16, (0.0, float("inf")))
LENGTHS = (1, 2, 5, 9, 17)
TIMED_LENGTHS = (1, 5, 17)
EPS = {mx.bfloat16: 2.0**-7, mx.float16: 2.0**-10}
TF32 = mx.cuda.is_available() and os.environ.get("MLX_ENABLE_TF32", "1") != "0"
F32_RTOL = 64 * float(np.finfo(np.float32).eps)
MATMUL_RTOL = 4 * 2.0**-10 if TF32 else F32_RTOL


def say(*parts: object) -> None:
    print(*parts, flush=True)


def make_inputs(shape: Shape, seq: int, masked: bool, seed: int = 0) -> list[Any]:
    """The arguments of `ssm_update` / `ssm_steps` (x, A_log, B, C, D, dt, dt_bias, state,
    time_step_limit, mask), with a left-padded mask (row r pads (r + 1) * L // 3 tokens)."""
    rng = np.random.default_rng(seed)
    b, h, dh, ds, g = shape.b, shape.h, shape.dh, shape.ds, shape.g

    def normal(*dims: int, dtype: Any = shape.dtype, scale: float = 1.0) -> mx.array:
        return mx.array((scale * rng.standard_normal(dims)).astype(np.float32)).astype(dtype)

    mask = None
    if masked:
        pads = np.array([(r + 1) * seq // 3 for r in range(b)])
        mask = mx.array(np.arange(seq)[None, :] >= pads[:, None])
    return [
        normal(b, seq, h, dh),
        mx.array(np.log(np.arange(1, h + 1, dtype=np.float32))),  # mlx-lm's A_log init
        normal(b, seq, g, ds),
        normal(b, seq, g, ds),
        normal(h, dtype=shape.d_dtype),
        normal(b, seq, h),
        mx.array(rng.uniform(-2.0, 1.0, h).astype(np.float32)),
        normal(b, h, dh, ds, dtype=mx.float32),
        shape.time_step_limit,
        mask,
    ]


def _np(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32), dtype=np.float64)


def magnitudes(args: list[Any]) -> tuple[np.ndarray, np.ndarray]:
    """(y, states) of the recurrence on absolute values, in float64 NumPy: per element the
    sum of the absolute values of the terms both implementations add."""
    x, A_log, B, C, D, dt, dt_bias, state, limit, mask = args
    x, B, C = np.abs(_np(x)), np.abs(_np(B)), np.abs(_np(C))
    _, seq, h, _ = x.shape
    dt = np.clip(np.logaddexp(0.0, _np(dt) + _np(dt_bias)), *limit)
    if mask is not None:
        dt = dt * np.array(mask, dtype=np.float64)[..., None]
    decay = np.exp(dt * -np.exp(_np(A_log)))
    B, C = np.repeat(B, h // B.shape[2], axis=2), np.repeat(C, h // C.shape[2], axis=2)
    current = np.abs(_np(state))
    states = np.empty((*x.shape, B.shape[-1]))
    for t in range(seq):
        inject = (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, :, None, :]
        current = decay[:, t, :, None, None] * current + inject
        states[:, t] = current
    y = np.einsum("blhdn,blhn->blhd", states, C) + x * np.abs(_np(D))[:, None]
    return y, states


class Diff(NamedTuple):
    max_abs: float
    worst: float  # max |difference| / bound


def diff(got: mx.array, want: mx.array, magnitude: np.ndarray, rtol: float) -> Diff:
    error = np.abs(_np(got) - _np(want))
    return Diff(float(error.max()), float((error / (rtol * magnitude + 1e-30)).max()))


def backend_name() -> str:
    if ssm.gpu_kernel() is None:
        return "ops"
    return "cuda kernel" if mx.cuda.is_available() else "metal kernel"


def check(shape: Shape, seq: int, masked: bool) -> bool:
    args = make_inputs(shape, seq, masked)
    mag_y, mag_states = magnitudes(args)
    y_rtol = max(MATMUL_RTOL, 4 * EPS.get(shape.dtype, 0.0))
    ours_y, ours_states = ssm.ssm_steps(*args)
    ref_y, ref_state = ssm_update(*args)
    per_token = [ssm_update(*prefix(args, t + 1))[1] for t in range(seq)]
    vs_mlx = [
        diff(ours_y, ref_y, mag_y, y_rtol),
        diff(ours_states[:, -1], ref_state, mag_states[:, -1], MATMUL_RTOL),
        diff(ours_states, mx.stack(per_token, axis=1), mag_states, MATMUL_RTOL),
    ]
    cells = []
    if backend_name() == "ops":
        cells.append(f"{'cpu: ops only':>27}")
        diffs = vs_mlx
    else:
        ops_y, ops_states = ssm.ssm_steps(*args, use_kernel=False)
        vs_ops = [
            diff(ours_y, ops_y, mag_y, y_rtol),
            diff(ours_states, ops_states, mag_states, F32_RTOL),
        ]
        cells.append(" ".join(f"{d.max_abs:>13.3e}" for d in vs_ops))
        diffs = vs_ops + vs_mlx
    cells.append(" ".join(f"{d.max_abs:>13.3e}" for d in vs_mlx))
    worst = max(d.worst for d in diffs)
    ok = worst <= 1.0
    label = f"{shape.name:<5} {seq:>3} {'left-pad' if masked else 'none':<8}"
    say(f"{label} | {cells[0]} | {cells[1]} | {worst:6.3f} {'PASS' if ok else 'FAIL'}")
    return ok


def prefix(args: list[Any], n: int) -> list[Any]:
    x, A_log, B, C, D, dt, dt_bias, state, limit, mask = args
    mask = None if mask is None else mask[:, :n]
    return [x[:, :n], A_log, B[:, :n], C[:, :n], D, dt[:, :n], dt_bias, state, limit, mask]


def median_ms(fn: Callable[[], Any], repeats: int = 20, warmup: int = 3) -> float:
    for _ in range(warmup):
        mx.eval(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> int:
    say(
        f"mlx {getattr(mx, '__version__', '?')}, device {mx.default_device()}, backend: {backend_name()}, "
        f"TF32 matmuls: {TF32}; rtol float32 {F32_RTOL:.3g}, matmul {MATMUL_RTOL:.3g}"
    )
    say()
    say("1. max |difference| (worst = largest |difference| / bound; <= 1 passes)")
    say(
        f"{'shape':<5} {'L':>3} {'mask':<8} | {'vs ops: y':>13} {'states':>13} | "
        f"{'vs mlx-lm: y':>13} {'final state':>13} {'every state':>13} | worst"
    )
    ok = True
    for shape in (TINY, ODD, REAL):
        for seq in LENGTHS:
            for masked in (False, True):
                ok &= check(shape, seq, masked)
    say("all PASS" if ok else "some FAIL")
    say()
    say(f"2. ms per call, {REAL.name} shape (median of 20 after warmup)")
    say(f"{'L':>3} | {'kernel':>13} | {'ops':>9} | {'mlx-lm':>9}")
    for seq in TIMED_LENGTHS:
        args = make_inputs(REAL, seq, masked=False)
        mx.eval([a for a in args if isinstance(a, mx.array)])
        ops = median_ms(partial(ssm.ssm_steps, *args, use_kernel=False))
        mlx_lm = median_ms(partial(ssm_update, *args))
        if backend_name() == "ops":
            kernel = f"{'cpu: ops only':>13}"
        else:
            kernel = f"{median_ms(partial(ssm.ssm_steps, *args)):>13.3f}"
        say(f"{seq:>3} | {kernel} | {ops:>9.3f} | {mlx_lm:>9.3f}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
