"""Batch bookkeeping: kvstate.merge / filter / extend / extract vs mlx-lm's own methods.

The same data on both sides: 8 sequences of different lengths (up to 4k tokens), 8 layers.
mlx-lm side: `KVCache.merge` (-> `BatchKVCache.merge`) per layer, and the batch cache's
`filter` / `extend` / `extract` methods. Those mutate their cache, so every repetition gets
fresh cache objects (a `copy.deepcopy` of an evaluated batch: MLX shares the buffers, and
the methods rebind rather than write into them), built outside the timed region.
kvstate side: the same caches converted once with `kvstate.adapters.from_mlx_lm`.
Every timed call ends with an eval of every array of its result.

Also, where their kvstate kinds are registered: sliding-window layers (RotatingKVCache ->
BatchRotatingKVCache) and recurrent layers (ArraysCache), with the same operations.

Run: .venv/bin/python benchmarks/batch_ops.py [--quick]
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from _fixtures import HEAD_DIM, HEADS, cache_arrays, filled_kvcache
from _harness import Contender, fmt_ratio, fmt_time, interleave, main_for, table, verdict
from mlx_lm.models.cache import ArraysCache, RotatingKVCache

import kvstate
from kvstate.adapters import from_mlx_lm

LAYERS = 8
LENGTHS = (4096, 3500, 3000, 2500, 2048, 1500, 1024, 4000)  # batch 8, up to 4k tokens
KEEP = (1, 2, 3, 4, 5, 6)  # filter drops the two longest rows: the rest share left padding
EXTRACT_ROW = 3
TARGET = 1.0
WINDOW = 1024


@dataclass
class Kind:
    """One kind of layer cache: how to make a row's caches, and how to eval mlx-lm caches."""

    name: str
    make_row: Callable[[int, int], list[Any]]  # (row, length) -> one cache per layer
    arrays: Callable[[list[Any]], list[mx.array]]


def dense_row(row: int, length: int) -> list[Any]:
    return [filled_kvcache(length, seed=row * 100 + layer) for layer in range(LAYERS)]


def rotating_row(row: int, length: int) -> list[Any]:
    """A window of WINDOW tokens after a prefill of `length` and one decoded token (so rows
    longer than the window have wrapped their ring)."""
    out = []
    for layer in range(LAYERS):
        c = RotatingKVCache(max_size=WINDOW)
        k1, k2 = mx.random.split(mx.random.key(row * 100 + layer))
        shape = (1, HEADS, length, HEAD_DIM)
        c.update_and_fetch(
            mx.random.normal(shape, key=k1).astype(mx.float16),
            mx.random.normal(shape, key=k2).astype(mx.float16),
        )
        one = mx.ones((1, HEADS, 1, HEAD_DIM), mx.float16)
        c.update_and_fetch(one, one)
        mx.eval(c.keys, c.values)
        out.append(c)
    return out


def recurrent_row(row: int, length: int) -> list[Any]:
    """A Mamba2-like layer state: conv window (1, 3, 1024) and SSM state (1, 16, 64, 64)."""
    del length  # a recurrent state's size does not depend on the context
    out = []
    for layer in range(LAYERS):
        k1, k2 = mx.random.split(mx.random.key(row * 100 + layer))
        c = ArraysCache(2)
        c[0] = mx.random.normal((1, 3, 1024), key=k1).astype(mx.float16)
        c[1] = mx.random.normal((1, 16, 64, 64), key=k2)
        mx.eval(c[0], c[1])
        out.append(c)
    return out


def arrays_cache_arrays(caches: list[Any]) -> list[mx.array]:
    out: list[mx.array] = []
    for c in caches:
        out += [a for a in c.cache if a is not None]
        out += [a for a in (c.left_padding, c.lengths) if a is not None]
    return out


KINDS = [
    Kind("dense (KVCache / BatchKVCache)", dense_row, cache_arrays),
    Kind("sliding window (RotatingKVCache / BatchRotatingKVCache)", rotating_row, cache_arrays),
    Kind("recurrent (ArraysCache)", recurrent_row, arrays_cache_arrays),
]


def mlx_merge(rows: list[list[Any]]) -> list[Any]:
    """mlx-lm's batching of per-sequence prompt caches (as in its BatchGenerator)."""
    return [type(rows[0][layer]).merge([r[layer] for r in rows]) for layer in range(LAYERS)]


def measure(kind: Kind, reps: int) -> list[list[str]]:
    rows = [kind.make_row(i, n) for i, n in enumerate(LENGTHS)]
    try:
        states = [from_mlx_lm(r) for r in rows]
        merged = kvstate.eval(kvstate.merge(states))
    except (kvstate.StateError, NotImplementedError, TypeError) as e:
        return [[kind.name, "(not measured)", f"kvstate kind not available: {e}", "", "", "", ""]]

    ev = kind.arrays
    base = mlx_merge(rows)  # mlx-lm's batched caches, same data as `merged`
    mx.eval(ev(base))
    half = len(LENGTHS) // 2
    base_a, base_b = mlx_merge(rows[:half]), mlx_merge(rows[half:])
    mx.eval(ev(base_a), ev(base_b))
    state_a = kvstate.eval(kvstate.merge(states[:half]))
    state_b = kvstate.eval(kvstate.merge(states[half:]))
    keep = list(KEEP)

    def mlx_filter(caches: list[Any]) -> list[Any]:
        for c in caches:
            c.filter(keep)
        mx.eval(ev(caches))
        return caches

    def mlx_extend(pair: tuple[list[Any], list[Any]]) -> list[Any]:
        a, b = pair
        for ca, cb in zip(a, b, strict=True):
            ca.extend(cb)
        mx.eval(ev(a))
        return a

    def mlx_extract(caches: list[Any]) -> list[Any]:
        out = [c.extract(EXTRACT_ROW) for c in caches]
        mx.eval(ev(out))
        return out

    def mlx_merge_eval(_: Any) -> list[Any]:
        out = mlx_merge(rows)
        mx.eval(ev(out))
        return out

    ops: list[tuple[str, Contender, Contender]] = [
        (
            "merge 8 rows",
            Contender("kvstate", lambda _: kvstate.eval(kvstate.merge(states))),
            Contender("mlx-lm", mlx_merge_eval),
        ),
        (
            f"filter to rows {keep}",
            Contender("kvstate", lambda _: kvstate.eval(kvstate.filter(merged, keep))),
            Contender("mlx-lm", mlx_filter, setup=lambda: copy.deepcopy(base)),
        ),
        (
            f"extend {half} rows + {len(LENGTHS) - half} rows",
            Contender("kvstate", lambda _: kvstate.eval(kvstate.extend(state_a, state_b))),
            Contender(
                "mlx-lm", mlx_extend, setup=lambda: (copy.deepcopy(base_a), copy.deepcopy(base_b))
            ),
        ),
        (
            f"extract row {EXTRACT_ROW}",
            Contender("kvstate", lambda _: kvstate.eval(kvstate.extract(merged, EXTRACT_ROW))),
            Contender("mlx-lm", mlx_extract, setup=lambda: copy.deepcopy(base)),
        ),
    ]
    out = []
    for label, ours, theirs in ops:
        try:
            samples = interleave([ours, theirs], reps=reps, warmup=2)
        except Exception as e:  # a kind still in progress: report, do not hide
            out.append([kind.name, label, f"failed: {type(e).__name__}: {e}", "", "", "", ""])
            continue
        ratio = samples.paired_ratio("kvstate", "mlx-lm")
        out.append(
            [
                kind.name,
                label,
                fmt_time(samples.median("kvstate")),
                fmt_time(samples.median("mlx-lm")),
                fmt_ratio(ratio),
                verdict(ratio[0] <= TARGET),
                "",
            ]
        )
    return out


def run(quick: bool) -> str:
    reps = 7 if quick else 60
    rows: list[list[str]] = []
    for kind in KINDS:
        rows += measure(kind, reps)
    return "\n".join(
        [
            "## merge / filter / extend / extract: kvstate vs mlx-lm batch caches",
            "",
            f"Batch 8, lengths {list(LENGTHS)} tokens, {LAYERS} layers, H={HEADS}, "
            f"D={HEAD_DIM}, fp16 (sliding window: {WINDOW}-token window; recurrent: conv "
            "(3, 1024) fp16 + SSM (16, 64, 64) fp32 per row and layer). "
            f"{reps} interleaved repetitions; ratio = median of per-repetition "
            "time(kvstate) / time(mlx-lm) [25th, 75th percentile]; both include the eval of "
            "every array of the result.",
            "",
            table(
                [
                    "layers",
                    "operation",
                    "kvstate",
                    "mlx-lm",
                    "kvstate / mlx-lm",
                    f"target <= {TARGET}",
                    "note",
                ],
                rows,
            ),
        ]
    )


if __name__ == "__main__":
    main_for("kvstate benchmark: batch operations", run, __doc__ or "")
