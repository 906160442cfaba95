"""Decode throughput through `adapters.wrap` vs the same model on raw mlx-lm caches.

One random-init llama (adapters.tiny_models, enlarged: hidden 512, 8 layers, 8 query heads,
4 KV heads of 64, fp32) gets two contexts of the same length (random keys/values written
through mlx-lm's KVCache.update_and_fetch): one kept as mlx-lm caches, one converted to a
kvstate state. Each repetition then runs one 1-token decode step of each,
back to back, in rotating order:
- raw:  logits = model(y, cache=caches); mx.eval(logits, cache arrays)
- wrap: logits, state = wrapped(y, state); mx.eval(logits, state leaves)
Both contexts grow by one token per repetition, so every pair sees the same length.
Wrap's bookkeeping alone (state -> caches -> state, stamping `appended`, the eval walk) is
also timed on a null model that only writes one token per layer, to say how much of a step
it is wherever a step is short (a GPU, a small model).

The memory table runs single steps and reads mx.get_active_memory (the delta that survives
the step) and mx.get_peak_memory (above the active memory at the step's start):
- rebind: `logits, state = wrapped(y, state)` drops the old state, so MLX donates the KV
  buffers and writes the new token in place (delta ~ 0, not a context copy);
- keep old: the caller still holds the previous state, so MLX copies each buffer on write
  (delta ~ the context's bytes), and the old state stays intact.

Run: .venv/bin/python benchmarks/decode.py [--quick]
"""

from __future__ import annotations

import statistics
from functools import partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from _fixtures import cache_arrays, filled_kvcache
from _harness import (
    Contender,
    active_delta,
    fmt_bytes,
    fmt_ratio,
    fmt_time,
    interleave,
    main_for,
    table,
    verdict,
)
from mlx_lm.models.cache import make_prompt_cache

import kvstate
from adapters import from_mlx_lm, to_mlx_lm, wrap
from adapters.tiny_models import tiny_model

TARGET = 0.97
MODEL = {
    "hidden_size": 512,
    "num_hidden_layers": 8,
    "intermediate_size": 1024,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "max_position_embeddings": 8192,
}


def build_model() -> nn.Module:
    return tiny_model("llama", scale=1.0, dtype=mx.float32, **MODEL)


def prefill(model: nn.Module, context: int) -> list[Any]:
    """Caches holding `context` tokens of random keys/values. (A real prefill through the
    model costs ~20 s per 1k tokens on a 2-core CPU; a decode step's cost depends on the
    context's length, not on its values.)"""
    caches = make_prompt_cache(model)
    layers = len(caches)
    filled = [
        filled_kvcache(
            context,
            heads=MODEL["num_key_value_heads"],
            dim=MODEL["head_dim"],
            dtype=mx.float32,
            seed=context * 100 + i,
        )
        for i in range(layers)
    ]
    assert all(type(c) is type(f) for c, f in zip(caches, filled, strict=True))
    return filled


def roundtrip_state(state: Any, _arg: Any = None) -> Any:
    """wrap's bookkeeping around the model call: state -> mlx-lm caches -> state."""
    return from_mlx_lm(to_mlx_lm(state))


class NullModel:
    """A stand-in model that only writes one token of K/V into every layer's cache: the
    difference between wrap and raw on it is wrap's bookkeeping alone, without the math."""

    def __init__(self) -> None:
        self.layers = [None] * MODEL["num_hidden_layers"]
        self.kv = mx.ones((1, MODEL["num_key_value_heads"], 1, MODEL["head_dim"]), mx.float32)
        self.logits = mx.zeros((1, 1, 256), mx.float32)

    def __call__(self, tokens: mx.array, cache: list[Any]) -> mx.array:
        for c in cache:
            c.update_and_fetch(self.kv, self.kv)
        return self.logits


class Raw:
    def __init__(self, model: nn.Module, context: int) -> None:
        self.model, self.caches = model, prefill(model, context)

    def step(self, y: mx.array, _arg: Any = None) -> mx.array:
        logits = self.model(y, cache=self.caches)
        mx.eval(logits, cache_arrays(self.caches))
        return logits


class Wrapped:
    def __init__(self, model: nn.Module, context: int) -> None:
        self.m = wrap(model)
        self.state = kvstate.eval(from_mlx_lm(prefill(model, context)))

    def step(self, y: mx.array, _arg: Any = None) -> mx.array:
        logits, self.state = self.m(y, self.state)
        mx.eval(logits, kvstate.tree_flatten(self.state)[0])
        return logits

    def step_keeping_old(self, y: mx.array) -> Any:
        old = self.state
        logits, self.state = self.m(y, self.state)
        mx.eval(logits, kvstate.tree_flatten(self.state)[0])
        return old


def memory_rows(model: nn.Module, context: int, y: mx.array, steps: int) -> list[list[str]]:
    """Median per-step (surviving delta, peak above start) for raw / rebind / keep-old."""
    raw, wrapped = Raw(model, context), Wrapped(model, context)
    # One step first, so the buffers are grown past the prompt's exact size (both sides).
    raw.step(y)
    wrapped.step(y)
    kv_bytes = kvstate.nbytes(wrapped.state)  # capacity included
    results: dict[str, list[tuple[int, int]]] = {"raw": [], "rebind": [], "keep": []}
    kept: list[Any] = []
    for _ in range(steps):
        d, p, _ = active_delta(lambda: raw.step(y))
        results["raw"].append((d, p))
        d, p, _ = active_delta(lambda: wrapped.step(y))
        results["rebind"].append((d, p))
        d, p, old = active_delta(lambda: wrapped.step_keeping_old(y))
        kept.append(old)  # the caller keeps every old state alive
        results["keep"].append((d, p))
        kept.clear()  # then lets it go before the next rebind measurement
    labels = {
        "raw": "raw mlx-lm caches (`model(y, cache=caches)`)",
        "rebind": "`logits, state = wrapped(y, state)` (old state dropped)",
        "keep": "`wrapped(y, state)` while the caller keeps the old state",
    }
    rows = []
    for name, label in labels.items():
        delta = statistics.median(d for d, _ in results[name])
        peak = statistics.median(p for _, p in results[name])
        rows.append(
            [
                label,
                fmt_bytes(delta),
                fmt_bytes(peak),
                fmt_bytes(kv_bytes),
                f"{delta / kv_bytes:.3f}",
            ]
        )
    return rows


def run(quick: bool) -> str:
    reps = 20 if quick else 80
    contexts = (1024,) if quick else (1024, 4096)
    model = build_model()
    y = mx.array([[7]], mx.int32)
    rows, mem_sections, ok = [], [], True
    for ctx in contexts:
        raw, wrapped = Raw(model, ctx), Wrapped(model, ctx)
        samples = interleave(
            [
                Contender("raw", partial(raw.step, y)),
                Contender("wrap", partial(wrapped.step, y)),
            ],
            reps=reps,
            warmup=3,
        )
        # tokens/s ratio wrap / raw == time ratio raw / wrap.
        ratio = samples.paired_ratio("raw", "wrap")
        ok = ok and ratio[0] >= TARGET
        rows.append(
            [
                ctx,
                f"{1 / samples.median('raw'):.1f}",
                f"{1 / samples.median('wrap'):.1f}",
                fmt_time(samples.median("wrap") - samples.median("raw")),
                fmt_ratio(ratio),
                verdict(ratio[0] >= TARGET),
            ]
        )
        # The part of wrap's overhead that is pure bookkeeping, without the model.
        roundtrip = interleave(
            [Contender("rt", partial(roundtrip_state, wrapped.state), inner=200)],
            reps=reps,
        ).median("rt")
        rows[-1].insert(4, fmt_time(roundtrip))
        del raw, wrapped
        null = NullModel()
        raw_null = Raw(null, ctx)  # type: ignore[arg-type]
        wrapped_null = Wrapped(null, ctx)  # type: ignore[arg-type]
        bare = interleave(
            [
                Contender("raw", partial(raw_null.step, y), inner=20),
                Contender("wrap", partial(wrapped_null.step, y), inner=20),
            ],
            reps=reps,
        )
        rows[-1].insert(4, fmt_time(bare.median("wrap") - bare.median("raw")))
        del raw_null, wrapped_null
        mem = memory_rows(model, ctx, y, steps=4 if quick else 8)
        mem_sections.append(
            f"Context {ctx} (+ a few decoded tokens):\n\n"
            + table(
                [
                    "decode step",
                    "active memory kept per step",
                    "peak above start",
                    "KV bytes (context)",
                    "kept / context",
                ],
                mem,
            )
        )
    cfg = ", ".join(f"{k}={v}" for k, v in MODEL.items())
    return "\n".join(
        [
            "## decode: `adapters.wrap` vs raw mlx-lm caches",
            "",
            f"Model: tiny_model('llama', {cfg}), fp32, batch 1. {reps} interleaved "
            "repetitions of one 1-token decode step each; ratio = median of per-repetition "
            "time(raw) / time(wrap) = tokens/s(wrap) / tokens/s(raw) [25th, 75th percentile].",
            "",
            table(
                [
                    "context",
                    "raw tokens/s",
                    "wrap tokens/s",
                    "wrap overhead / step (difference of medians)",
                    "wrap bookkeeping / step (null model, difference of medians)",
                    "of which `from_mlx_lm(to_mlx_lm(state))`",
                    "wrap / raw tokens/s",
                    f"target >= {TARGET}",
                ],
                rows,
            ),
            "",
            "### in-place update of the KV buffer (memory per decode step)",
            "",
            *[s + "\n" for s in mem_sections],
            "Rebinding the state keeps ~0 bytes per step (the KV buffers are donated and "
            "written in place, like raw mlx-lm); keeping the old state costs one copy of "
            "the context per step (copy-on-write), which is what keeps the old state valid.",
        ]
    )


if __name__ == "__main__":
    main_for("kvstate benchmark: decode", run, __doc__ or "")
