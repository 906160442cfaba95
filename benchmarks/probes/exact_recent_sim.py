"""Would exact sink / recent positions take K4/V3 within 5% of fp32 perplexity (issue 22)?

A simulation, not kvstate's QuantizedKV: the model runs with its ordinary unquantized caches
and every attention is replaced by one that reads each key and value either exactly or
fake-quantized through kvstate's own Codec (mx.quantize at the given bits, group 64, the
Hadamard rotation), the choice made per (query, key) pair: query t_q reads t_k exactly iff
t_k < SINK or t_k > t_q - RECENT. That rule depends on positions only, so a verify would read
what a sequential decode reads: the form a QuantizedKV with an exact tail would take. The
text is read teacher-forced in chunks as `benchmarks/real_quality.py` reads it (its helpers).

    .venv/bin/python benchmarks/probes/exact_recent_sim.py smollm2-135m 256 128 1 english \
        16,16,0,0 4,3,0,0 4,3,0,32
    (model, tokens, chunk, score-every, text, then options KEY_BITS,VALUE_BITS,SINK,RECENT;
    16 bits = unquantized). Buffer index is read as token position, so a model's sliding
    window must not wrap (Gemma: fewer tokens than its 512-token window; checked).

Rows are printed as they are measured. Needs the model's package (`load_model`).
"""

from __future__ import annotations

import math
import sys
from typing import Any

import _on_path  # noqa: F401  (benchmarks/ on the path, for real_quality)
import mlx.core as mx
import mlx_lm.models.gemma3_text as gemma3_text
import mlx_lm.models.llama as llama
import numpy as np
from mlx_lm.models.cache import make_prompt_cache
from real_quality import load, read_text, score_every, text_ids, through_caches

from kvstate._quant_codec import Codec

OPTION: dict[str, int] = {}  # key_bits, value_bits, sink, recent of the option being read


def fake_quantized(x: mx.array, bits: int) -> mx.array:
    if bits >= 16:
        return x
    codec = Codec(bits, 64, 0, "hadamard", 0)
    return codec.decode(codec.encode(x)).astype(x.dtype)


def mixed_attention(
    queries: mx.array, keys: mx.array, values: mx.array, cache: Any, scale: float, mask: Any,
    sinks: Any = None,
) -> mx.array:  # fmt: skip
    """mlx-lm's scaled_dot_product_attention, each (query, key) pair read exactly or
    fake-quantized by the OPTION's rule."""
    L, T = queries.shape[2], keys.shape[2]
    if cache is not None and cache.offset != T:
        # The rule reads buffer index t_k as token t_k: false once a window has wrapped.
        raise SystemExit(
            f"exact_recent_sim: a cache holds {T} of {cache.offset} positions (a sliding "
            "window wrapped); read fewer tokens than the window"
        )
    repeats = queries.shape[1] // keys.shape[1]

    def heads(x: mx.array) -> mx.array:
        return mx.repeat(x, repeats, 1)

    k, v = heads(keys), heads(values)
    k_q = heads(fake_quantized(keys, OPTION["key_bits"]))
    v_q = heads(fake_quantized(values, OPTION["value_bits"]))
    t_q = mx.arange(T - L, T)[:, None]
    t_k = mx.arange(T)[None]
    exact = (t_k < OPTION["sink"]) | (t_k > t_q - OPTION["recent"])
    q = queries * scale
    scores = mx.where(exact, q @ k.swapaxes(-1, -2), q @ k_q.swapaxes(-1, -2))
    if isinstance(mask, mx.array):  # a window's mask (Gemma's sliding layers)
        scores = mx.where(mask, scores, -1e30) if mask.dtype == mx.bool_ else scores + mask
    else:
        scores = mx.where(t_k <= t_q, scores, -1e30)
    weights = mx.softmax(scores.astype(mx.float32), axis=-1)
    exact_weights = weights * exact
    return exact_weights @ v + (weights - exact_weights) @ v_q


def main() -> None:
    name, tokens, chunk, every, text = sys.argv[1:6]
    llama.scaled_dot_product_attention = mixed_attention
    gemma3_text.scaled_dot_product_attention = mixed_attention
    _, model, tokenizer = load(name, mx.float32)
    score_every(model, int(every))
    ids = text_ids(tokenizer, text, int(tokens))
    for spec in sys.argv[6:]:
        key_bits, value_bits, sink, recent = map(int, spec.split(","))
        OPTION.update(key_bits=key_bits, value_bits=value_bits, sink=sink, recent=recent)
        forward = through_caches(model, make_prompt_cache(model))
        nll, _ = read_text(forward, ids, int(chunk), int(every))
        mean = float(np.mean(nll))
        label = (
            "unquantized"
            if min(key_bits, value_bits) >= 16
            else f"K{key_bits}/V{value_bits} hadamard sink{sink} recent{recent}"
        )
        print(
            f"{label}: mean NLL {mean:.4f}, perplexity {math.exp(mean):.3f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
