"""Ways to compute the values product of one quantized-attention decode step (issue 9 item 2).

out = weights @ V, V an `mx.quantize` triple (1, 8 heads, 1025 positions, 128) at `bits`,
group 64, one query: kvstate's quantized attention does it with
`mx.quantized_matmul(transpose=False)`, which MLX 0.32's CPU kernel runs ~4x slower at 3 and
5 bits than at 4. The exact alternatives measured here, each checked against it first:

- dequantize: `weights @ mx.dequantize(V)`;
- unpack by ops: the codes unpacked with shifts and masks (`mx.compile`d), times scales plus
  biases, then a matmul;
- bit planes: the packed words read as a 1-bit matrix of bits * 128 columns (column
  bits * p + j is bit j of value p, MLX's packing order), one 1-bit quantized_matmul with
  the scales repeated and zero biases, the planes summed with weights 2^j, plus weights @ biases;
- two streams: the same kernel on heads 0-3 and on heads 4-7 in two streams of the device
  (on the CPU: two threads).

Interleaved: each rep runs every path once, in a rotated order; medians and IQR over reps.

    python benchmarks/probes/quantized_values_paths.py [--reps 15] [--bits 3,4,5]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable
from functools import partial

import mlx.core as mx
import numpy as np

HEADS, LENGTH, DIM, GROUP = 8, 1025, 128, 64
_BYTES_PER_PACK = {3: 3, 5: 5, 6: 3}


def codes(packed: mx.array, bits: int) -> mx.array:
    """uint32 (..., W) packed by mx.quantize -> float32 codes (..., W * 32 // bits)."""
    if bits in (2, 4, 8):
        shifts = mx.arange(32 // bits, dtype=mx.uint32) * bits
        c = (packed[..., None] >> shifts) & ((1 << bits) - 1)
    else:  # 3 / 5 / 6 bits: packs of `bytes_per_pack` little-endian bytes
        per_pack = _BYTES_PER_PACK[bits]
        wide = mx.uint64 if per_pack > 4 else mx.uint32
        by = packed.view(mx.uint8).reshape(*packed.shape[:-1], -1, per_pack).astype(wide)
        word = by[..., 0:1]
        for j in range(1, per_pack):
            word = word | (by[..., j : j + 1] << (8 * j))
        shifts = (mx.arange(per_pack * 8 // bits) * bits).astype(wide)
        c = (word >> shifts) & ((1 << bits) - 1)
    return c.reshape(*packed.shape[:-1], -1).astype(mx.float32)


def unpacked(q: tuple[mx.array, ...], bits: int) -> mx.array:
    c = codes(q[0], bits)
    grouped = c.reshape(*c.shape[:-1], -1, GROUP)
    return (grouped * q[1][..., None] + q[2][..., None]).reshape(c.shape)


def bit_planes(weights: mx.array, q: tuple[mx.array, ...], bits: int) -> mx.array:
    scales = mx.repeat(q[1], bits, axis=-1)
    planes = mx.quantized_matmul(
        weights, q[0], scales, mx.zeros_like(scales), transpose=False, group_size=GROUP, bits=1
    )
    planes = planes.reshape(*planes.shape[:-1], -1, bits)
    out = (planes * (2.0 ** mx.arange(bits))).sum(-1)
    return out + mx.repeat(weights @ q[2], GROUP, axis=-1)


def paths(weights: mx.array, q: tuple[mx.array, ...], bits: int) -> dict[str, Callable]:
    second = mx.new_stream(mx.default_device())
    unpack = mx.compile(partial(unpacked, bits=bits))
    half = HEADS // 2

    def qmm(w: mx.array, t: tuple[mx.array, ...], **kw: object) -> mx.array:
        return mx.quantized_matmul(w, *t, transpose=False, group_size=GROUP, bits=bits, **kw)

    def two_streams() -> mx.array:
        low = qmm(weights[:, :half], tuple(a[:, :half] for a in q))
        high = qmm(weights[:, half:], tuple(a[:, half:] for a in q), stream=second)
        return mx.concatenate([low, high], axis=1)

    return {
        "quantized_matmul": lambda: qmm(weights, q),
        "dequantize": lambda: weights @ mx.dequantize(*q, group_size=GROUP, bits=bits),
        "unpack by ops": lambda: weights @ unpack(q),
        "bit planes": lambda: bit_planes(weights, q, bits),
        "two streams": two_streams,
    }


def ms(fn: Callable, calls: int = 10) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        mx.eval(fn())
    return (time.perf_counter() - start) / calls * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--bits", default="3,4,5")
    args = parser.parse_args()
    print(f"mlx {mx.__version__}, {mx.default_device()}, {platform.machine()}")
    rng = np.random.default_rng(0)
    data = mx.array(rng.standard_normal((1, HEADS, LENGTH, DIM)).astype(np.float32))
    weights = mx.softmax(mx.array(rng.standard_normal((1, HEADS, 1, LENGTH)), mx.float32), -1)
    print("| bits | path | ms per call, median [IQR] | vs quantized_matmul (median ratio) |")
    print("|---|---|---|---|")
    for bits in (int(b) for b in args.bits.split(",")):
        q = mx.quantize(data, group_size=GROUP, bits=bits)
        mx.eval(q)
        fns = paths(weights, q, bits)
        expected = fns["quantized_matmul"]()
        for name, fn in fns.items():
            err = mx.abs(fn() - expected).max().item()
            assert err < 1e-5, f"{name} at {bits} bits differs by {err}"
            ms(fn, 2)  # warm up (compile, allocations)
        times: dict[str, list[float]] = {name: [] for name in fns}
        names = list(fns)
        for rep in range(args.reps):
            for name in names[rep % len(names) :] + names[: rep % len(names)]:
                times[name].append(ms(fns[name]))
        base = times["quantized_matmul"]
        for name in names:
            q1, _, q3 = statistics.quantiles(times[name], n=4)
            ratio = statistics.median(b / t for b, t in zip(base, times[name], strict=True))
            print(
                f"| {bits} | {name} | {statistics.median(times[name]):.2f} [{q1:.2f}, {q3:.2f}] "
                f"| {ratio:.2f}x |",
                flush=True,
            )
    print("(ratio > 1: faster than quantized_matmul; each rep runs every path, rotated order)")


if __name__ == "__main__":
    main()
