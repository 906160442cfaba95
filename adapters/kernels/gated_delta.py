"""The gated delta recurrence of qwen3_next / qwen3_5, returning the state after every token.

mlx-lm's `gated_delta_update` returns only the final state; a capturing verify forward needs
the state after each of its K tokens (the checkpoints `commit_prefix` picks from). This
module runs the same recurrence once over all K tokens and writes every intermediate state:

    state_t = g_t * state_{t-1}                      (decay; g scalar per head, or per Dk)
    state_t += beta_t * (v_t - state_t k_t) k_t^T    (delta rule)
    y_t     = state_t q_t

with, for a masked-out token, y_t computed as above and the state then left unchanged: the
exact semantics of mlx-lm's `_gated_delta_step_ops`.

Backends, chosen at call time: a CUDA kernel (`mx.fast.cuda_kernel`), a Metal kernel
(`mx.fast.metal_kernel`, the same structure), and mlx-lm's own compiled step applied token by
token everywhere else (the CPU), which is bit-identical to mlx-lm there. Kernels are built on
first use, so importing this module works on any machine.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, cast

import mlx.core as mx
from mlx_lm.models.gated_delta import _gated_delta_step_ops

from kvstate import ShapeError

_Kernel = Callable[..., Sequence[mx.array]]


def gated_delta_steps(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array,
    mask: mx.array | None = None,
    *,
    use_kernel: bool = True,
) -> tuple[mx.array, mx.array]:
    """Run the gated delta recurrence over T tokens, keeping the state after each.

    Args:
        q, k: (B, T, Hk, Dk), normalized as mlx-lm's `normalize_qk` does.
        v: (B, T, Hv, Dv), Hv a multiple of Hk (value head h reads key head h // (Hv // Hk)).
        g: (B, T, Hv) scalar or (B, T, Hv, Dk) vector decay factors (float32).
        beta: (B, T, Hv).
        state: (B, Hv, Dv, Dk), the state before token 0 (usually float32).
        mask: None, or (B, T) bool: False leaves the state unchanged at that token.
        use_kernel: False runs the ops path on any device (the benchmarks compare them).

    Returns:
        y: (B, T, Hv, Dv) in q.dtype.
        states: (B, T, Hv, Dv, Dk) in state.dtype; states[:, t] is the state after token t,
        so states[:, -1] is the state `gated_delta_update` would return.
    """
    _check_shapes(q, k, v, g, beta, state, mask)
    B, T, _, Dk = k.shape
    Hv, Dv = v.shape[2:]
    if T == 0:
        return mx.zeros((B, 0, Hv, Dv), q.dtype), mx.zeros((B, 0, Hv, Dv, Dk), state.dtype)
    kernel = gpu_kernel(vectorized=g.ndim == 4, masked=mask is not None) if use_kernel else None
    if kernel is None:
        return _ops_steps(q, k, v, g, beta, state, mask)
    return _run_kernel(kernel, q, k, v, g, beta, state, mask)


def gpu_kernel(vectorized: bool, masked: bool) -> _Kernel | None:
    """The kernel for the default device, or None where the ops path runs (the CPU)."""
    if mx.default_device() != mx.gpu:
        return None
    if mx.cuda.is_available():
        return _cuda_kernel(vectorized, masked)
    if mx.metal.is_available():
        return _metal_kernel(vectorized, masked)
    return None


def _check_shapes(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array,
    mask: mx.array | None,
) -> None:
    """Raise ShapeError listing every input that does not fit q's (B, T, Hk, Dk) and v's Hv, Dv.

    The kernels index raw pointers from these shapes, so a mismatch would read out of bounds
    instead of failing."""
    if q.ndim != 4 or v.ndim != 4:
        raise ShapeError(
            f"gated_delta_steps: q and v must be 4-D (B, T, H, D); got q {q.shape}, v {v.shape}"
        )
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[2:]
    expected: dict[str, tuple[tuple[int, ...], ...]] = {
        "k": ((B, T, Hk, Dk),),
        "v": ((B, T, Hv, Dv),),
        "g": ((B, T, Hv), (B, T, Hv, Dk)),
        "beta": ((B, T, Hv),),
        "state": ((B, Hv, Dv, Dk),),
    }
    arrays = {"k": k, "v": v, "g": g, "beta": beta, "state": state}
    if mask is not None:
        expected["mask"] = ((B, T),)
        arrays["mask"] = mask
    problems = [
        f"{name} {tuple(arrays[name].shape)} (expected {' or '.join(map(str, shapes))})"
        for name, shapes in expected.items()
        if tuple(arrays[name].shape) not in shapes
    ]
    if Hk == 0 or Hv % Hk:
        problems.append(f"Hv={Hv} is not a multiple of Hk={Hk}")
    if problems:
        raise ShapeError(
            "gated_delta_steps: inputs do not fit q (B, T, Hk, Dk) = "
            f"{q.shape} and v's (Hv, Dv) = {(Hv, Dv)}: " + "; ".join(problems) + ". "
            "Pass the tensors a gated delta layer feeds mlx-lm's gated_delta_update."
        )


# ---------------------------------------------------------------------------------------
# Ops: mlx-lm's own step, token by token.
# ---------------------------------------------------------------------------------------


def _ops_steps(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array,
    mask: mx.array | None,
) -> tuple[mx.array, mx.array]:
    """mlx-lm's `gated_delta_ops` loop, keeping every state (bit-identical to it)."""
    if (repeat := v.shape[2] // k.shape[2]) > 1:  # GQA, exactly as gated_delta_ops does it
        q = mx.repeat(q, repeat, -2)
        k = mx.repeat(k, repeat, -2)
    ys, states = [], []
    current = state  # carried as mlx-lm carries it (a float32 g promotes a bf16 state)
    for t in range(q.shape[1]):
        y, current = _gated_delta_step_ops(
            q[:, t],
            k[:, t],
            v[:, t],
            g[:, t],
            beta[:, t],
            current,
            None if mask is None else mask[:, t],
        )
        ys.append(y)
        states.append(current)
    stacked = mx.stack(states, axis=1)
    if stacked.dtype != state.dtype:
        stacked = stacked.astype(state.dtype)
    return mx.stack(ys, axis=1), stacked


# ---------------------------------------------------------------------------------------
# Kernels: one warp (SIMD group) per (batch, value head, value row).
#
# Lane l of the warp holds the elements l, l + 32, l + 64, ... of its state row in
# registers (ceil(Dk / 32) of them; lanes past Dk hold nothing and add zeros), so any Dk
# works and the per-token state writes are coalesced. Each token takes two warp sums:
# state . k for the delta, then state . q for y. Arithmetic is float32 whatever the input
# dtypes, as in mlx-lm's ops (a bf16 k times a float32 state is float32 there too).
# ---------------------------------------------------------------------------------------

_THREADGROUP = (32, 4, 1)  # 32 lanes over Dk, 4 value rows (warps) per block


def _run_kernel(
    kernel: _Kernel,
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array,
    mask: mx.array | None,
) -> tuple[mx.array, mx.array]:
    B, T, Hk, Dk = k.shape
    Hv, Dv = v.shape[2:]
    inputs = [q, k, v, g, beta, state] + ([] if mask is None else [mask])
    y, states = kernel(
        inputs=inputs,
        template=[
            ("InT", q.dtype),
            ("StT", state.dtype),
            ("Dk", Dk),
            ("Dv", Dv),
            ("Hk", Hk),
            ("Hv", Hv),
        ],
        # Grid in threads (both backends): x the lanes, y the value rows, z batch * head.
        grid=(32, Dv, B * Hv),
        threadgroup=_THREADGROUP,
        output_shapes=[(B, T, Hv, Dv), (B, T, Hv, Dv, Dk)],
        output_dtypes=[q.dtype, state.dtype],
    )
    return y, states


def _input_names(masked: bool) -> list[str]:
    return ["q", "k", "v", "g", "beta", "state_in"] + (["mask"] if masked else [])


def _gating(vectorized: bool) -> dict[str, str]:
    """Source fragments for g: (B, T, Hv, Dk) per-key-element decay, or (B, T, Hv) scalar."""
    if vectorized:
        return {
            "g_setup": "auto g_ = g + (size_t)(b_idx * T * Hv + hv_idx) * Dk;",
            "g_token": "// g_[d] per key element, below",
            "g_at": "static_cast<float>(g_[d])",
            "g_step": "Hv * Dk",
        }
    return {
        "g_setup": "auto g_ = g + (size_t)b_idx * T * Hv;",
        "g_token": "const float gt = static_cast<float>(g_[hv_idx]);",
        "g_at": "gt",
        "g_step": "Hv",
    }


# One kernel body for both backends; only the thread indexing and the warp sum differ.
#
# CUDA: the body of a `__global__` function whose parameters MLX generates: `const X* name`
# per input (plus `const __grid_constant__ Shape q_shape`, since the body names it), `X* name`
# per output, and `constexpr int` / `using` lines for the template arguments. The grid counts
# threads: MLX launches ceil(grid / threadgroup) blocks of `threadgroup` threads, so the last
# block along y can overshoot Dv.
# Metal: MLX generates the `[[kernel]]` signature the same way (`const constant int* q_shape`,
# template parameters, and the thread attributes the body names) and dispatches exactly
# `grid` threads. The Metal kernel cannot run on the Linux machines this project is developed
# and tested on (no Metal there); it is checked by reading against the CUDA one and mlx-lm's.
_CUDA_INDEXING = """
  const int lane = threadIdx.x;
  const int dv_idx = blockIdx.y * blockDim.y + threadIdx.y;
  const int n = blockIdx.z * blockDim.z + threadIdx.z;"""

_METAL_INDEXING = """
  const int lane = thread_position_in_threadgroup.x;
  const int dv_idx = thread_position_in_grid.y;
  const int n = thread_position_in_grid.z;"""

_CUDA_HEADER = """
__device__ __forceinline__ float kvstate_warp_sum(float x) {
  // Butterfly over the 32 lanes; every lane of the warp takes part (see the early return).
  for (int offset = 16; offset > 0; offset /= 2) {
    x += __shfl_xor_sync(0xffffffffu, x, offset);
  }
  return x;
}
"""

_SOURCE = """
  constexpr int n_per_t = (Dk + 31) / 32;
  {indexing}
  if (dv_idx >= Dv) {{
    return;  // a whole warp (one value row) leaves, so the warp sums below keep 32 lanes
  }}
  const int b_idx = n / Hv;
  const int hv_idx = n % Hv;
  const int hk_idx = hv_idx / (Hv / Hk);
  const int T = q_shape[1];

  // q, k: [B, T, Hk, Dk]
  auto q_ = q + (size_t)(b_idx * T * Hk + hk_idx) * Dk;
  auto k_ = k + (size_t)(b_idx * T * Hk + hk_idx) * Dk;
  // v, y: [B, T, Hv, Dv]
  auto v_ = v + (size_t)(b_idx * T * Hv + hv_idx) * Dv;
  auto y_ = y + (size_t)(b_idx * T * Hv + hv_idx) * Dv;
  // g: [B, T, Hv] or [B, T, Hv, Dk]; beta: [B, T, Hv]
  {g_setup}
  auto beta_ = beta + (size_t)b_idx * T * Hv;
  // state_in: [B, Hv, Dv, Dk]; states: [B, T, Hv, Dv, Dk]
  auto i_state = state_in + ((size_t)n * Dv + dv_idx) * Dk;
  auto o_state = states + ((size_t)(b_idx * T * Hv + hv_idx) * Dv + dv_idx) * Dk;

  float state[n_per_t];
  for (int i = 0; i < n_per_t; ++i) {{
    const int d = lane + 32 * i;
    state[i] = d < Dk ? static_cast<float>(i_state[d]) : 0.0f;
  }}

  for (int t = 0; t < T; ++t) {{
    {g_token}
    float next[n_per_t] = {{}};  // lanes past Dk keep zeros
    float kv_mem = 0.0f;
    for (int i = 0; i < n_per_t; ++i) {{
      const int d = lane + 32 * i;
      if (d < Dk) {{
        next[i] = state[i] * {g_at};
        kv_mem += next[i] * static_cast<float>(k_[d]);
      }}
    }}
    kv_mem = {warp_sum}(kv_mem);

    const float delta =
        (static_cast<float>(v_[dv_idx]) - kv_mem) * static_cast<float>(beta_[hv_idx]);

    float out = 0.0f;
    for (int i = 0; i < n_per_t; ++i) {{
      const int d = lane + 32 * i;
      if (d < Dk) {{
        next[i] = next[i] + static_cast<float>(k_[d]) * delta;
        out += next[i] * static_cast<float>(q_[d]);
      }}
    }}
    out = {warp_sum}(out);
    if (lane == 0) {{
      y_[dv_idx] = static_cast<InT>(out);
    }}

    // A masked-out token still produced y from the updated state, then keeps the old one.
    if ({keep}) {{
      for (int i = 0; i < n_per_t; ++i) {{
        state[i] = next[i];
      }}
    }}
    for (int i = 0; i < n_per_t; ++i) {{
      const int d = lane + 32 * i;
      if (d < Dk) {{
        o_state[d] = static_cast<StT>(state[i]);
      }}
    }}

    q_ += Hk * Dk;
    k_ += Hk * Dk;
    v_ += Hv * Dv;
    y_ += Hv * Dv;
    g_ += {g_step};
    beta_ += Hv;
    o_state += (size_t)Hv * Dv * Dk;
  }}
"""


def _source(cuda: bool, vectorized: bool, masked: bool) -> str:
    return _SOURCE.format(
        indexing=(_CUDA_INDEXING if cuda else _METAL_INDEXING).strip(),
        warp_sum="kvstate_warp_sum" if cuda else "simd_sum",
        keep="mask[b_idx * T + t]" if masked else "true",
        **_gating(vectorized),
    )


def _name(vectorized: bool, masked: bool) -> str:
    return "kvstate_gated_delta_steps" + "_vec" * vectorized + "_mask" * masked


@functools.cache
def _cuda_kernel(vectorized: bool, masked: bool) -> _Kernel:
    kernel: Any = mx.fast.cuda_kernel(
        name=_name(vectorized, masked),
        input_names=_input_names(masked),
        output_names=["y", "states"],
        source=_source(True, vectorized, masked),
        header=_CUDA_HEADER,
    )
    return cast(_Kernel, kernel)


@functools.cache
def _metal_kernel(vectorized: bool, masked: bool) -> _Kernel:
    kernel: Any = mx.fast.metal_kernel(
        name=_name(vectorized, masked),
        input_names=_input_names(masked),
        output_names=["y", "states"],
        source=_source(False, vectorized, masked),
    )
    return cast(_Kernel, kernel)
