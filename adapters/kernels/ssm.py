"""The Mamba2 SSM update over L tokens, returning the state after every token.

mlx-lm's `ssm_update` returns only the final state; a capturing verify forward needs the
state after each of its L tokens (the checkpoints `commit_prefix` picks from). This module
runs the per-token recurrence of mlx-lm's Metal `ssm_kernel` once over all L tokens and
writes every intermediate state:

    dt_t    = clip(softplus(dt_t + dt_bias), *time_step_limit)    (mlx-lm's `compute_dt`)
    state_t = exp(m_t * A * dt_t) * state_{t-1} + m_t * dt_t * x_t B_t^T
    y_t     = state_t . C_t + D * x_t

with A = -exp(A_log) and m_t the mask (1 where there is no mask). `ssm_attn`, the chunked
form `ssm_update` runs for L > 1, multiplies dtA by the mask and gives a masked token's
dt * x * B zero weight, so with a left-padded mask (the only kind mlx-lm's Mamba2 models
pass) a padding token leaves the state unchanged and still reads y from it: the same values.

Backends, chosen at call time: a CUDA kernel (`mx.fast.cuda_kernel`), a Metal kernel
(`mx.fast.metal_kernel`, the same structure), and MLX ops everywhere else (the CPU).
Kernels are built on first use, so importing this module works on any machine.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, cast

import mlx.core as mx
from mlx_lm.models.ssm import compute_dt

from kvstate import ShapeError

_Kernel = Callable[..., Sequence[mx.array]]


def ssm_steps(
    x: mx.array,
    A_log: mx.array,
    B: mx.array,
    C: mx.array,
    D: mx.array,
    dt: mx.array,
    dt_bias: mx.array,
    state: mx.array | None,
    time_step_limit: tuple[float, float],
    mask: mx.array | None = None,
    *,
    use_kernel: bool = True,
) -> tuple[mx.array, mx.array]:
    """Run the Mamba2 SSM over L tokens, keeping the state after each.

    Arguments are those mlx-lm's Mamba2 mixers pass to `ssm_update` (without `lengths`:
    right-padded prompts are not supported).

    Args:
        x: (B, L, H, Dh).
        A_log, D, dt_bias: (H,).
        B, C: (B, L, G, Ds), H a multiple of G (head h reads group h // (H // G)).
        dt: (B, L, H), before `dt_bias`, softplus and the clip to `time_step_limit`.
        state: (B, H, Dh, Ds), the state before token 0; None means zeros.
        time_step_limit: (min, max) for dt.
        mask: None, or (B, L) bool with each row's False entries first (left padding).
        use_kernel: False runs the ops path on any device (the benchmarks compare them).

    Returns:
        y: (B, L, H, Dh) in x.dtype.
        states: (B, L, H, Dh, Ds) float32; states[:, t] is the state after token t, so
        states[:, -1] is the state `ssm_update` would return.
    """
    dt, dt_a, state = _prepared(x, A_log, B, C, D, dt, dt_bias, state, time_step_limit, mask)
    kernel = gpu_kernel() if use_kernel else None
    if kernel is None or x.shape[1] == 0:
        return _ops_steps(x, B, C, D, dt, dt_a, state)
    return _run_kernel(kernel, x, B, C, D, dt, dt_a, state)


def _prepared(
    x: mx.array,
    A_log: mx.array,
    B: mx.array,
    C: mx.array,
    D: mx.array,
    dt: mx.array,
    dt_bias: mx.array,
    state: mx.array | None,
    time_step_limit: tuple[float, float],
    mask: mx.array | None,
) -> tuple[mx.array, mx.array, mx.array]:
    """Check the shapes; return (dt * m, dt * A * m) from `_discretized` and the state
    before token 0 as float32 (zeros for None, which is how ssm_attn reads None)."""
    _check_shapes(x, A_log, B, C, D, dt, dt_bias, state, mask)
    dt, dt_a = _discretized(dt, dt_bias, A_log, time_step_limit, mask)
    if state is None:
        b, _, h, dh = x.shape
        return dt, dt_a, mx.zeros((b, h, dh, B.shape[-1]), mx.float32)
    return dt, dt_a, state.astype(mx.float32)


def gpu_kernel() -> _Kernel | None:
    """The kernel for the default device, or None where the ops path runs (the CPU)."""
    if mx.default_device() != mx.gpu:
        return None
    if mx.cuda.is_available():
        return _cuda_kernel()
    if mx.metal.is_available():
        return _metal_kernel()
    return None


def _discretized(
    dt: mx.array,
    dt_bias: mx.array,
    A_log: mx.array,
    time_step_limit: tuple[float, float],
    mask: mx.array | None,
) -> tuple[mx.array, mx.array]:
    """(dt * m, dt * A * m), both (B, L, H) float32: the two per-token scalars of a head.

    Computed as `ssm_attn` computes them (same dt, same A, dtA times the mask), so the only
    difference from mlx-lm is the order of the later sums. Masking dt too is what gives a
    padding token's dt * x * B zero weight, as ssm_attn's decay matrix does."""
    dt = compute_dt(dt, dt_bias, time_step_limit)
    dt_a = dt * (-mx.exp(A_log).astype(dt.dtype))
    if mask is not None:
        keep = mask[..., None]
        dt, dt_a = dt * keep, dt_a * keep
    return dt, dt_a


def _check_shapes(
    x: mx.array,
    A_log: mx.array,
    B: mx.array,
    C: mx.array,
    D: mx.array,
    dt: mx.array,
    dt_bias: mx.array,
    state: mx.array | None,
    mask: mx.array | None,
) -> None:
    """Raise ShapeError listing every input that does not fit x's (B, L, H, Dh) and B's G, Ds.

    The kernels index raw pointers from these shapes, so a mismatch would read out of bounds
    instead of failing."""
    if x.ndim != 4 or B.ndim != 4:
        raise ShapeError(
            f"ssm_steps: x and B must be 4-D (B, L, H, D); got x {x.shape}, B {B.shape}"
        )
    b, seq, h, dh = x.shape
    g, ds = B.shape[2:]
    expected = {"B": (b, seq, g, ds), "C": (b, seq, g, ds), "dt": (b, seq, h)}
    expected |= {"A_log": (h,), "D": (h,), "dt_bias": (h,)}
    arrays = {"B": B, "C": C, "dt": dt, "A_log": A_log, "D": D, "dt_bias": dt_bias}
    if state is not None:
        expected["state"] = (b, h, dh, ds)
        arrays["state"] = state
    if mask is not None:
        expected["mask"] = (b, seq)
        arrays["mask"] = mask
    problems = [
        f"{name} {tuple(arrays[name].shape)} (expected {shape})"
        for name, shape in expected.items()
        if tuple(arrays[name].shape) != shape
    ]
    if g == 0 or h % g:
        problems.append(f"H={h} is not a multiple of G={g}")
    if problems:
        raise ShapeError(
            f"ssm_steps: inputs do not fit x (B, L, H, Dh) = {x.shape} and B's (G, Ds) = "
            f"{(g, ds)}: " + "; ".join(problems) + ". "
            "Pass the tensors a Mamba2 mixer feeds mlx-lm's ssm_update."
        )


# ---------------------------------------------------------------------------------------
# Ops: the recurrence token by token.
#
# Measured on this project's Linux CPU (2 cores, B=1, medians of 20, noisy) against a
# one-pass matmul form of the SSD recurrence (states = decay (L x L) @ dt x B^T, all tokens
# at once): at H=64, Dh=64, Ds=128 the loop takes 3 / 14 / 28 / 80 ms for L = 1 / 5 / 9 / 17,
# the matmul form 3.5 / 18 / 56 / 210+ ms (MLX's CPU matmul is slow on these small batched
# shapes, and its result needs a transposed copy). At the test models' tiny shapes (H=4,
# Dh=8, Ds=16) the matmul form leads from L=5 (0.4-0.8 ms against 0.4-2.3 ms), a far
# smaller difference. So: the loop.
# ---------------------------------------------------------------------------------------


def _ops_steps(
    x: mx.array,
    B: mx.array,
    C: mx.array,
    D: mx.array,
    dt: mx.array,
    dt_a: mx.array,
    state: mx.array,
) -> tuple[mx.array, mx.array]:
    """The recurrence in float32 ops. dt, dt_a: (B, L, H) from `_discretized`; state:
    (B, H, Dh, Ds) float32."""
    if x.shape[1] == 0:
        return mx.zeros_like(x), mx.zeros((*x.shape, B.shape[-1]), mx.float32)
    heads_per_group = x.shape[2] // B.shape[2]
    decay = mx.exp(dt_a)[..., None, None]  # (B, L, H, 1, 1)
    dt_x = (dt[..., None] * x)[..., None]  # (B, L, H, Dh, 1), float32
    B = mx.repeat(B.astype(mx.float32), heads_per_group, axis=2)[..., None, :]
    current = state
    states = []
    for t in range(x.shape[1]):
        current = decay[:, t] * current + dt_x[:, t] * B[:, t]
        states.append(current)
    stacked = mx.stack(states, axis=1)  # (B, L, H, Dh, Ds)
    C = mx.repeat(C.astype(mx.float32), heads_per_group, axis=2)[..., None]
    y = (stacked @ C).squeeze(-1) + x.astype(mx.float32) * D.astype(mx.float32)[:, None]
    return y.astype(x.dtype), stacked


# ---------------------------------------------------------------------------------------
# Kernels: one warp (SIMD group) per (batch * head, state row d of Dh).
#
# Lane i of the warp holds the elements i, i + 32, i + 64, ... of its state row in
# registers (ceil(Ds / 32) of them, mlx-lm's `n_per_t` rounded up; lanes past Ds hold
# nothing and add zeros), so any Ds works (tiny test models have Ds = 16) and each step of
# the 32 lanes reads B and C and writes the states as one contiguous run, where mlx-lm's
# kernel gives each lane a contiguous block. Per token: decay the row, add dt x B, write
# it out, and warp-sum row . C for y. Arithmetic is float32 whatever the input dtypes, as
# in ssm_attn (a bf16 B times float32 dt * x is float32 there too). The mask is already in
# dt and dt_a, so the kernels know nothing of it.
# ---------------------------------------------------------------------------------------

_ROWS_PER_BLOCK = 8  # warps (state rows) per threadgroup, as mlx-lm's ssm_kernel


def _run_kernel(
    kernel: _Kernel,
    x: mx.array,
    B: mx.array,
    C: mx.array,
    D: mx.array,
    dt: mx.array,
    dt_a: mx.array,
    state: mx.array,
) -> tuple[mx.array, mx.array]:
    b, seq, h, dh = x.shape
    g, ds = B.shape[2:]
    y, states = kernel(
        inputs=[x, dt, dt_a, B, C, D, state],
        # L is read from x_shape at run time: one compiled kernel serves every verify length.
        template=[("T", x.dtype), ("Dh", dh), ("Ds", ds), ("H", h), ("G", h // g)],
        # Grid in threads (both backends): x one warp per batch * head (x, not z as in
        # mlx-lm, because CUDA caps a grid's z at 65535 blocks), y the state rows.
        grid=(32 * b * h, dh, 1),
        threadgroup=(32, _ROWS_PER_BLOCK, 1),
        output_shapes=[(b, seq, h, dh), (b, seq, h, dh, ds)],
        output_dtypes=[x.dtype, mx.float32],
    )
    return y, states


_INPUT_NAMES = ["x", "dt", "dt_a", "b_in", "c_in", "d_in", "state_in"]
_OUTPUT_NAMES = ["y", "states"]

# The CUDA source is the body of a `__global__` function whose parameters MLX generates:
# `const X* name` per input (plus `const __grid_constant__ Shape x_shape`, since the body
# names it), `X* name` per output, and `constexpr int` / `using` lines for the template
# arguments. The grid counts threads: MLX launches ceil(grid / threadgroup) blocks of
# `threadgroup` threads, so the last block along y can overshoot Dh.
_CUDA_HEADER = """
__device__ __forceinline__ float kvstate_ssm_warp_sum(float v) {
  // Butterfly over the 32 lanes; every lane of the warp is active (see the early return).
  for (int offset = 16; offset > 0; offset /= 2) {
    v += __shfl_xor_sync(0xffffffffu, v, offset);
  }
  return v;
}
"""

# One source for both backends: MLX generates the kernel signature (inputs, outputs, the
# template parameters, and on Metal the thread attributes the body names); only the thread
# indices, the exponential and the warp sum differ. The Metal kernel cannot run on the Linux
# machines this project is developed on (no Metal there): it is checked by reading, against
# this CUDA one (run on an H200) and mlx-lm's ssm_kernel.
_SOURCE = """
  constexpr int n_per_t = (Ds + 31) / 32;
  const int lane = {lane};
  const int d_idx = {row};
  if (d_idx >= Dh) {{
    return;  // a whole warp (one state row) leaves, so the warp sum keeps 32 lanes
  }}
  const int n = {block};  // batch * H + head
  const int b_idx = n / H;
  const int h_idx = n % H;
  const int g_idx = h_idx / G;
  const int L = x_shape[1];
  const float d_skip = static_cast<float>(d_in[h_idx]);

  // x, y: [B, L, H, Dh]; dt, dt_a: [B, L, H]; b_in, c_in: [B, L, H / G, Ds]
  const size_t bh = (size_t)b_idx * L * H + h_idx;
  auto x_ = x + bh * Dh + d_idx;
  auto y_ = y + bh * Dh + d_idx;
  auto dt_ = dt + bh;
  auto dt_a_ = dt_a + bh;
  auto b_ = b_in + ((size_t)b_idx * L * (H / G) + g_idx) * Ds;
  auto c_ = c_in + ((size_t)b_idx * L * (H / G) + g_idx) * Ds;
  // state_in: [B, H, Dh, Ds]; states: [B, L, H, Dh, Ds]
  auto i_state = state_in + ((size_t)n * Dh + d_idx) * Ds;
  auto o_state = states + (bh * Dh + d_idx) * Ds;

  float state[n_per_t];
  for (int i = 0; i < n_per_t; ++i) {{
    const int s = lane + 32 * i;
    state[i] = s < Ds ? i_state[s] : 0.0f;
  }}

  for (int t = 0; t < L; ++t) {{
    const float decay = {exp}(dt_a_[0]);
    const float x_t = static_cast<float>(x_[0]);
    const float dt_x = dt_[0] * x_t;
    float acc = 0.0f;
    for (int i = 0; i < n_per_t; ++i) {{
      const int s = lane + 32 * i;
      if (s < Ds) {{
        state[i] = decay * state[i] + dt_x * static_cast<float>(b_[s]);
        o_state[s] = state[i];
        acc += state[i] * static_cast<float>(c_[s]);
      }}
    }}
    acc = {warp_sum}(acc);
    if (lane == 0) {{
      y_[0] = static_cast<T>(acc + x_t * d_skip);
    }}

    x_ += H * Dh;
    y_ += H * Dh;
    dt_ += H;
    dt_a_ += H;
    b_ += (H / G) * Ds;
    c_ += (H / G) * Ds;
    o_state += (size_t)H * Dh * Ds;
  }}
"""

_CUDA = {
    "lane": "threadIdx.x",
    "row": "blockIdx.y * blockDim.y + threadIdx.y",
    "block": "blockIdx.x",
    "exp": "expf",
    "warp_sum": "kvstate_ssm_warp_sum",
}
_METAL = {
    "lane": "thread_position_in_threadgroup.x",
    "row": "thread_position_in_grid.y",
    "block": "threadgroup_position_in_grid.x",
    "exp": "metal::precise::exp",
    "warp_sum": "simd_sum",
}


@functools.cache
def _cuda_kernel() -> _Kernel:
    kernel: Any = mx.fast.cuda_kernel(
        name="kvstate_ssm_steps",
        input_names=_INPUT_NAMES,
        output_names=_OUTPUT_NAMES,
        source=_SOURCE.format(**_CUDA),
        header=_CUDA_HEADER,
    )
    return cast(_Kernel, kernel)


@functools.cache
def _metal_kernel() -> _Kernel:
    kernel: Any = mx.fast.metal_kernel(
        name="kvstate_ssm_steps",
        input_names=_INPUT_NAMES,
        output_names=_OUTPUT_NAMES,
        source=_SOURCE.format(**_METAL),
    )
    return cast(_Kernel, kernel)
