"""Causal attention of a few query tokens over a KV cache, as one CUDA kernel.

A verify forward attends T = K + 1 new tokens (K drafts) over the cache. On MLX CUDA the
library's attention for T > 3 goes to cuDNN (bfloat16 / float16) or to unfused ops (float32),
and either one costs the host more per layer than the one kernel a decode step launches: a
speculative round on a host-bound GPU pays that in every attention layer. This kernel does
the whole attention of a verify in one launch per layer, reading the cache's buffers in place
(any strides: the keys may be a slice of a longer buffer) at their exact length, so no key
length is ever new to it (cuDNN builds a graph per length: see `instruments.buckets`).

One thread block per (row, query head, query token); its warps take keys in turn, each with
an online softmax over its keys, then the block combines the warps. Query token t of T of
row b sees keys first[b] .. L - T + t (mlx-lm's bottom-right causal mask; `first` a batch's
left padding, mlx-lm's `BatchKVCache.left_padding`: a ragged batch's verify takes the same
kernel, where its mask as an array would go to cuDNN, which builds a graph per shape).
float32 accumulation.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask

# Warps per block, each taking every WARPS-th key (MLX's own vector kernel's shape). Must be
# 32: in the combine, warp w writes elements w * E .. w * E + E - 1 of the D = 32 * E outputs.
WARPS = 32

_HEADER = """
__device__ __forceinline__ float kvstate_attn_warp_sum(float x) {
  #pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    x += __shfl_xor_sync(0xffffffffu, x, offset);
  }
  return x;
}

__device__ __forceinline__ float kvstate_attn_warp_max(float x) {
  #pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  }
  return x;
}
"""

# MLX generates the signature: `const InT* q` (+ q_shape, q_strides, as the body names them)
# per input, `InT* out`, and the template constants InT, D, W. Grid: x the query heads, y
# the query tokens, z the rows; W warps per block (block.x = 32 * W).
_SOURCE = """
  constexpr int E = D / 32;  // head elements per lane, contiguous
  const int T = q_shape[2];
  const int Hq = q_shape[1];
  const int L = k_shape[2];
  const int h = blockIdx.x;
  const int t = blockIdx.y;
  const int b = blockIdx.z;
  const int kh = h / (Hq / k_shape[1]);
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int last = L - T + t;  // the last key this query sees (bottom-right causal)
  const int start = first[b];  // the first (the row's left padding)

  // exp2 of log2(e)-scaled scores: one multiply fewer per key
  const float sc = scale[0] * 1.4426950408889634f;
  const InT* qp = q + b * q_strides[0] + h * q_strides[1] + t * q_strides[2];
  const int64_t qs = q_strides[3], ks = k_strides[3], vs = v_strides[3];
  float qv[E], acc[E];
  #pragma unroll
  for (int i = 0; i < E; ++i) {
    qv[i] = static_cast<float>(qp[(lane * E + i) * qs]) * sc;
    acc[i] = 0.0f;
  }
  const InT* kp = k + b * k_strides[0] + kh * k_strides[1] + (start + warp) * k_strides[2];
  const InT* vp = v + b * v_strides[0] + kh * v_strides[1] + (start + warp) * v_strides[2];
  const int64_t k_step = W * k_strides[2], v_step = W * v_strides[2];

  float m = -1e30f;  // finite: exp2(m - new max) stays 0, never NaN
  float s = 0.0f;
  for (int j = start + warp; j <= last; j += W) {
    float kv[E];
    #pragma unroll
    for (int i = 0; i < E; ++i) {
      kv[i] = static_cast<float>(kp[(lane * E + i) * ks]);
    }
    float score = 0.0f;
    #pragma unroll
    for (int i = 0; i < E; ++i) {
      score += qv[i] * kv[i];
    }
    score = kvstate_attn_warp_sum(score);
    const float mn = fmaxf(m, score);
    const float factor = exp2f(m - mn);
    const float p = exp2f(score - mn);
    m = mn;
    s = s * factor + p;
    #pragma unroll
    for (int i = 0; i < E; ++i) {
      acc[i] = acc[i] * factor + p * static_cast<float>(vp[(lane * E + i) * vs]);
    }
    kp += k_step;
    vp += v_step;
  }

  // Combine the warps (MLX's scheme): lane w of every warp reads warp w's max and sum.
  __shared__ float warp_m[W];
  __shared__ float warp_s[W];
  __shared__ float outputs[W][33];
  if (lane == 0) {
    warp_m[warp] = m;
    warp_s[warp] = s;
  }
  __syncthreads();
  const float their_m = lane < W ? warp_m[lane] : -1e30f;
  const float M = kvstate_attn_warp_max(their_m);
  const float their_factor = exp2f(their_m - M);
  const float S = kvstate_attn_warp_sum(lane < W ? warp_s[lane] * their_factor : 0.0f);
  const float my_factor = exp2f(m - M);
  // Each of the E rounds transposes one element per lane through shared memory: warp w
  // then holds, in lane l, warp l's accumulator for element w * E + i ... summed by warp w.
  InT* op = out + (((size_t)b * Hq + h) * T + t) * D;
  #pragma unroll
  for (int i = 0; i < E; ++i) {
    outputs[warp][lane] = acc[i] * my_factor;
    __syncthreads();
    const float total = kvstate_attn_warp_sum(lane < W ? outputs[lane][warp] : 0.0f);
    if (lane == 0) {
      op[warp * E + i] = static_cast<InT>(total / S);
    }
    __syncthreads();
  }
"""


MAX_QUERIES = 32  # longer forwards (prefills) go to MLX's attention: this one has no tiling


_DTYPES = frozenset({mx.bfloat16, mx.float16, mx.float32})


def takes(tokens: int, dim: int) -> bool:
    """Whether the kernel takes `tokens` queries of head dim `dim`: at most MAX_QUERIES, a
    multiple of 32 up to 256."""
    return tokens <= MAX_QUERIES and dim % 32 == 0 and dim <= 256


def supported(queries: mx.array, keys: mx.array) -> bool:
    """Whether the kernel takes these: `takes` their sizes, query heads a multiple of the key
    heads, at least as many keys as queries, one floating dtype. (Every attention layer of a
    verify asks: kept cheap.)"""
    q, k = queries.shape, keys.shape
    dtype = queries.dtype
    return (
        takes(q[2], q[3])
        and k[3] == q[3]
        and q[1] % k[1] == 0
        and k[2] >= q[2]
        and dtype == keys.dtype
        and dtype in _DTYPES
    )


Attention = Callable[..., mx.array]
"""`attend(queries, keys, values, scale, first=None)`: `verify_attention`'s signature."""


def attention_for_device() -> Attention:
    """The verify attention for the default device: the kernel on CUDA; elsewhere MLX's own
    attention with mlx-lm's masks (the same function; tests route through it)."""
    if mx.default_device() == mx.gpu and mx.cuda.is_available():
        return verify_attention
    return causal_attention


def verify_attention(
    queries: mx.array, keys: mx.array, values: mx.array, scale: float, first: mx.array | None = None
) -> mx.array:
    """softmax(q k^T * scale, bottom-right causal) v for q (B, Hq, T, D), k and v
    (B, Hkv, L, D) with L >= T (see `supported`), row b's keys from `first[b]` on ((B,)
    int32, each <= L - T; None: all); (B, Hq, T, D) in q's dtype. CUDA only."""
    B, Hq, T, D = queries.shape
    dtype = queries.dtype
    (out,) = _kernel()(
        inputs=[queries, keys, values, _scale(scale), _zeros(B) if first is None else first],
        template=_template(dtype, D),
        grid=(32 * WARPS * Hq, T, B),
        threadgroup=_THREADGROUP,
        output_shapes=[(B, Hq, T, D)],
        output_dtypes=[dtype],
    )
    return out


def causal_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    scale: float,
    first: mx.array | None = None,
    sinks: mx.array | None = None,
) -> mx.array:
    """What `verify_attention` computes, by MLX's own attention (any device, any size), with
    `sinks` as mlx-lm passes them."""
    mask: Any = "causal"
    if first is not None:  # mlx-lm's BatchKVCache mask: causal, from each row's padding on
        T, L = queries.shape[2], keys.shape[2]
        mask = create_causal_mask(T, L - T, left_padding=first)
    return mx.fast.scaled_dot_product_attention(
        queries, keys, values, scale=scale, mask=mask, sinks=sinks
    )


_THREADGROUP = (32 * WARPS, 1, 1)


@functools.cache
def _template(dtype: mx.Dtype, dim: int) -> list[tuple[str, Any]]:
    return [("InT", dtype), ("D", dim), ("W", WARPS)]


@functools.cache
def _scale(value: float) -> mx.array:
    return mx.array([value], mx.float32)


@functools.cache
def _zeros(rows: int) -> mx.array:
    return mx.zeros((rows,), mx.int32)


@functools.cache
def _kernel() -> Any:
    return mx.fast.cuda_kernel(
        name="kvstate_verify_attention",
        input_names=["q", "k", "v", "scale", "first"],
        output_names=["out"],
        source=_SOURCE,
        header=_HEADER,
        ensure_row_contiguous=False,
    )
