"""Decode throughput through `kvstate.adapters.wrap` vs the same model on raw mlx-lm caches.

Models: random-init llamas from kvstate.adapters.tiny_models. The small one (hidden 512, 8 layers,
8 query / 4 KV heads of 64, fp32) always runs; the large one (hidden 2048, 16 layers,
16 query / 8 KV heads of 128, 32k vocabulary, bf16, ~1.1B parameters) runs on a GPU, or on
any device with --large. Contexts are random keys/values written through mlx-lm's
KVCache.update_and_fetch: one copy kept as mlx-lm caches, one converted to a kvstate state.

Two loop shapes, each the same for both contenders, interleaved in rotating order:
- synchronous: one 1-token step, then eval of the logits and every cache / state array;
    raw:  logits = model(y, cache=caches);  wrap: logits, state = wrapped(y, state)
- pipelined, as mlx-lm's generate_step: a block of BLOCK tokens where step i+1's graph is
  built and mx.async_eval-ed before waiting on token i (y.item()), greedy sampling on a
  dedicated stream, so Python bookkeeping overlaps device work as in real use.
Both contexts grow by the same number of tokens per repetition.
Wrap's bookkeeping alone (state -> caches -> state, stamping `appended`, the eval walk) is
also timed on a null model that only writes one token per layer.

The memory table (small model) runs single steps and reads mx.get_active_memory (the delta
that survives the step) and mx.get_peak_memory (above the active memory at the start):
- rebind: `logits, state = wrapped(y, state)` drops the old state, so MLX donates the KV
  buffers and writes the new token in place (delta ~ 0, not a context copy);
- keep old: the caller still holds the previous state, so MLX copies each buffer on write
  (delta ~ the context's bytes), and the old state stays intact.

Run: .venv/bin/python benchmarks/decode.py [--quick] [--large]
"""

from __future__ import annotations

import argparse
import gc
import statistics
from dataclasses import dataclass
from functools import partial
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from _fixtures import cache_arrays, filled_kvcache
from _harness import (
    Contender,
    active_delta,
    environment,
    fmt_bytes,
    fmt_ratio,
    fmt_time,
    interleave,
    table,
    verdict,
)
from mlx_lm.models.cache import make_prompt_cache

import kvstate
from kvstate.adapters import from_mlx_lm, to_mlx_lm, wrap
from kvstate.adapters.tiny_models import tiny_model

TARGET = 0.97
BLOCK = 16  # tokens per timed block of the pipelined loop


@dataclass(frozen=True)
class Spec:
    """A llama built by kvstate.adapters.tiny_models (random init) and the contexts it decodes at."""

    name: str
    config: dict[str, int]
    dtype: mx.Dtype
    dtype_name: str

    def build(self) -> nn.Module:
        return tiny_model("llama", scale=1.0, dtype=self.dtype, **self.config)

    def describe(self) -> str:
        cfg = ", ".join(f"{k}={v}" for k, v in self.config.items())
        return f"tiny_model('llama', {cfg}), {self.dtype_name}, batch 1"


SMALL = Spec(
    "small",
    {
        "hidden_size": 512,
        "num_hidden_layers": 8,
        "intermediate_size": 1024,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "max_position_embeddings": 8192,
    },
    mx.float32,
    "fp32",
)
# About 1.1B parameters: the shape of a small real model (Llama-3.2-1B-like width and
# depth, 16 query / 8 KV heads of 128, a 32k vocabulary). Run on a GPU, or with --large.
LARGE = Spec(
    "large",
    {
        "vocab_size": 32000,
        "hidden_size": 2048,
        "num_hidden_layers": 16,
        "intermediate_size": 8192,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 8192,
    },
    mx.bfloat16,
    "bf16",
)


def prefill(model: nn.Module, spec: Spec, context: int) -> list[Any]:
    """Caches holding `context` tokens of random keys/values. (A real prefill through the
    model costs ~20 s per 1k tokens on a 2-core CPU; a decode step's cost depends on the
    context's length, not on its values.)"""
    caches = make_prompt_cache(model)
    filled = [
        filled_kvcache(
            context,
            heads=spec.config["num_key_value_heads"],
            dim=spec.config["head_dim"],
            dtype=spec.dtype,
            seed=context * 100 + i,
        )
        for i in range(len(caches))
    ]
    assert all(type(c) is type(f) for c, f in zip(caches, filled, strict=True))
    return filled


def roundtrip_state(state: Any, _arg: Any = None) -> Any:
    """wrap's bookkeeping around the model call: state -> mlx-lm caches -> state."""
    return from_mlx_lm(to_mlx_lm(state))


class NullModel:
    """A stand-in model that only writes one token of K/V into every layer's cache: the
    difference between wrap and raw on it is wrap's bookkeeping alone, without the math."""

    def __init__(self, spec: Spec) -> None:
        cfg = spec.config
        self.layers = [None] * cfg["num_hidden_layers"]
        self.kv = mx.ones((1, cfg["num_key_value_heads"], 1, cfg["head_dim"]), spec.dtype)
        self.logits = mx.zeros((1, 1, 256), spec.dtype)

    def __call__(self, tokens: mx.array, cache: list[Any]) -> mx.array:
        for c in cache:
            c.update_and_fetch(self.kv, self.kv)
        return self.logits


class Raw:
    def __init__(self, model: nn.Module, spec: Spec, context: int) -> None:
        self.model, self.caches = model, prefill(model, spec, context)
        self.y = mx.array([7], mx.int32)  # the pipelined loop's last token

    def step(self, y: mx.array, _arg: Any = None) -> mx.array:
        logits = self.model(y, cache=self.caches)
        mx.eval(logits, cache_arrays(self.caches))
        return logits

    def forward(self, y: mx.array) -> tuple[mx.array, mx.array]:
        """generate_step's `_step` (lazy): model call on a (1,) token, greedy sample."""
        return sample(self.model(y[None], cache=self.caches))


class Wrapped:
    def __init__(self, model: nn.Module, spec: Spec, context: int) -> None:
        self.m = wrap(model)
        self.state = kvstate.eval(from_mlx_lm(prefill(model, spec, context)))
        self.y = mx.array([7], mx.int32)

    def step(self, y: mx.array, _arg: Any = None) -> mx.array:
        logits, self.state = self.m(y, self.state)
        mx.eval(logits, kvstate.tree_flatten(self.state)[0])
        return logits

    def step_keeping_old(self, y: mx.array) -> Any:
        old = self.state
        logits, self.state = self.m(y, self.state)
        mx.eval(logits, kvstate.tree_flatten(self.state)[0])
        return old

    def forward(self, y: mx.array) -> tuple[mx.array, mx.array]:
        logits, self.state = self.m(y[None], self.state)
        return sample(logits)


def sample(logits: mx.array) -> tuple[mx.array, mx.array]:
    """The tail of mlx-lm's generate_step `_step` with its default (greedy) sampler."""
    logits = logits[:, -1, :]
    logprobs = logits - mx.logsumexp(logits, keepdims=True)
    return mx.argmax(logprobs, axis=-1), logprobs.squeeze(0)


def decode_pipelined(side: Raw | Wrapped, n: int, stream: mx.Stream) -> int:
    """`n` tokens the way mlx-lm's generate_step drives decoding: step i+1's graph is built
    and `mx.async_eval`-ed before waiting on token i (`y.item()`), so the Python work of
    one step overlaps the device work of the previous one. The cache / state writes are
    part of each token's graph, so the last `item()` leaves nothing pending."""
    with mx.stream(stream):
        y, logprobs = side.forward(side.y)
        mx.async_eval(y, logprobs)
        token = -1
        for i in range(n):
            if i + 1 < n:
                next_y, next_logprobs = side.forward(y)
                mx.async_eval(next_y, next_logprobs)
            token = cast(int, y.item())
            if i + 1 < n:
                y, logprobs = next_y, next_logprobs
    side.y = y
    return token


def memory_rows(
    model: nn.Module, spec: Spec, context: int, y: mx.array, steps: int
) -> list[list[str]]:
    """Median per-step (surviving delta, peak above start) for raw / rebind / keep-old."""
    raw, wrapped = Raw(model, spec, context), Wrapped(model, spec, context)
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


def sync_row(model: nn.Module, spec: Spec, ctx: int, reps: int) -> tuple[list[Any], bool]:
    """One synchronous step per contender per repetition (eval, then the next step)."""
    y = mx.array([[7]], mx.int32)
    raw, wrapped = Raw(model, spec, ctx), Wrapped(model, spec, ctx)
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
    # The part of wrap's overhead that is pure bookkeeping, without the model.
    roundtrip = interleave(
        [Contender("rt", partial(roundtrip_state, wrapped.state), inner=200)], reps=reps
    ).median("rt")
    del raw, wrapped
    null = NullModel(spec)
    raw_null = Raw(null, spec, ctx)  # type: ignore[arg-type]
    wrapped_null = Wrapped(null, spec, ctx)  # type: ignore[arg-type]
    bare = interleave(
        [
            Contender("raw", partial(raw_null.step, y), inner=20),
            Contender("wrap", partial(wrapped_null.step, y), inner=20),
        ],
        reps=reps,
    )
    row = [
        ctx,
        f"{1 / samples.median('raw'):.1f}",
        f"{1 / samples.median('wrap'):.1f}",
        fmt_time(samples.median("wrap") - samples.median("raw")),
        fmt_time(bare.median("wrap") - bare.median("raw")),
        fmt_time(roundtrip),
        fmt_ratio(ratio),
        verdict(ratio[0] >= TARGET),
    ]
    return row, ratio[0] >= TARGET


def pipelined_row(model: nn.Module, spec: Spec, ctx: int, reps: int) -> tuple[list[Any], bool]:
    """BLOCK tokens of generate_step's pipelined loop per contender per repetition."""
    stream = mx.new_stream(mx.default_device())  # as generate_step's generation_stream
    raw, wrapped = Raw(model, spec, ctx), Wrapped(model, spec, ctx)
    warmup = 2
    samples = interleave(
        [
            Contender("raw", lambda _: decode_pipelined(raw, BLOCK, stream)),
            Contender("wrap", lambda _: decode_pipelined(wrapped, BLOCK, stream)),
        ],
        reps=reps,
        warmup=warmup,
        keep_gc=True,  # wrap allocates more Python objects per step; it pays their collections
    )
    ratio = samples.paired_ratio("raw", "wrap")
    end = ctx + (warmup + reps) * BLOCK
    assert raw.caches[0].offset == end == wrapped.state.layers[0].length, "contexts diverged"
    row = [
        f"{ctx} -> {end}",
        f"{BLOCK / samples.median('raw'):.1f}",
        f"{BLOCK / samples.median('wrap'):.1f}",
        fmt_time((samples.median("wrap") - samples.median("raw")) / BLOCK),
        fmt_ratio(ratio),
        verdict(ratio[0] >= TARGET),
    ]
    return row, ratio[0] >= TARGET


def section(spec: Spec, quick: bool, memory: bool) -> tuple[str, list[str]]:
    reps = 20 if quick else 80
    pipe_reps = 6 if quick else 24
    contexts = (1024,) if quick else (1024, 4096)
    model = spec.build()
    sync_rows, pipe_rows, mem_sections, verdicts = [], [], [], []
    for ctx in contexts:
        row, ok = sync_row(model, spec, ctx, reps)
        sync_rows.append(row)
        verdicts.append(f"{spec.name} model, {ctx} context, synchronous: {verdict(ok)}")
        row, ok = pipelined_row(model, spec, ctx, pipe_reps)
        pipe_rows.append(row)
        verdicts.append(f"{spec.name} model, {ctx} context, pipelined: {verdict(ok)}")
        if memory:
            mem = memory_rows(model, spec, ctx, mx.array([[7]], mx.int32), 4 if quick else 8)
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
    parts = [
        f"### {spec.name} model: {spec.describe()}",
        "",
        f"**Synchronous steps**: {reps} interleaved repetitions of one 1-token decode step "
        "each, evaluated before the next (`mx.eval(logits, cache/state arrays)`); ratio = "
        "median of per-repetition time(raw) / time(wrap) = tokens/s(wrap) / tokens/s(raw) "
        "[25th, 75th percentile].",
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
            sync_rows,
        ),
        "",
        f"**Pipelined, as mlx-lm's generate_step**: {pipe_reps} interleaved repetitions of "
        f"{BLOCK} tokens per contender (step i+1 built and `mx.async_eval`-ed before "
        "`y.item()` of token i, greedy sampling, a dedicated stream, garbage collector on); "
        "each block starts from an idle device and ends on its last token; both contexts "
        f"grow by {BLOCK} tokens per block; ratio as above, per block.",
        "",
        table(
            [
                "context (start -> end)",
                "raw tokens/s",
                "wrap tokens/s",
                "wrap overhead / token (difference of medians)",
                "wrap / raw tokens/s",
                f"target >= {TARGET}",
            ],
            pipe_rows,
        ),
    ]
    if memory:
        parts += [
            "",
            "#### in-place update of the KV buffer (memory per synchronous decode step)",
            "",
            *[s + "\n" for s in mem_sections],
            "Rebinding the state keeps ~0 bytes per step (the KV buffers are donated and "
            "written in place, like raw mlx-lm); keeping the old state costs one copy of "
            "the context per step (copy-on-write), which is what keeps the old state valid.",
        ]
    del model
    gc.collect()
    mx.clear_cache()
    return "\n".join(parts), verdicts


def on_gpu() -> bool:
    return mx.default_device().type == mx.DeviceType.gpu


def run(quick: bool, large: bool | None = None) -> str:
    """The small model always; the large one on a GPU (default) or when `large` is True."""
    specs = [SMALL] + ([LARGE] if (on_gpu() if large is None else large) else [])
    sections, verdicts = [], []
    for spec in specs:
        text, v = section(spec, quick, memory=spec is SMALL)
        sections.append(text)
        verdicts += v
    return "\n".join(
        [
            "## decode: `kvstate.adapters.wrap` vs raw mlx-lm caches",
            "",
            "Contexts of random keys/values written through mlx-lm's "
            "`KVCache.update_and_fetch`; both contenders decode the same model from the "
            "same context length, interleaved, in rotating order.",
            "",
            "\n\n".join(sections),
            "",
            f"- target wrap / raw tokens/s >= {TARGET}: " + "; ".join(verdicts) + ".",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (smoke run)")
    parser.add_argument(
        "--large", action="store_true", help="also the ~1.1B bf16 model (default on a GPU)"
    )
    args = parser.parse_args()
    print(f"# kvstate benchmark: decode\n\n{environment(args.quick)}\n")
    print(run(args.quick, large=True if args.large else None))


if __name__ == "__main__":
    main()
