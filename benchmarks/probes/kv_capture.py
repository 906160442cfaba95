"""Capture each attention layer's (q, k, v) of one fp32 forward over the first N tokens."""

import sys
import time

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
import real_quality as rq
from mlx_lm.models.cache import make_prompt_cache

name, n, text = sys.argv[1], int(sys.argv[2]), sys.argv[3]
model, tok = rq.load(name, mx.float32)[1:]
ids = rq.text_ids(tok, text, n)
modname = {"gemma3-270m": "gemma3_text", "smollm2-135m": "llama"}[name]
mod = __import__(f"mlx_lm.models.{modname}", fromlist=["x"])
orig = mod.scaled_dot_product_attention
got = []


def rec(queries, keys, values, cache, scale, mask, **kw):
    got.append((queries, keys, values, scale))
    return orig(queries, keys, values, cache=cache, scale=scale, mask=mask, **kw)


mod.scaled_dot_product_attention = rec
t = time.perf_counter()
h = model.model(mx.array([ids]), cache=make_prompt_cache(model))
mx.eval(h, [g[:3] for g in got])
print("forward", time.perf_counter() - t, len(got))
out = {}
for i, (q, k, v, s) in enumerate(got):
    out[f"q{i}"], out[f"k{i}"], out[f"v{i}"] = np.array(q), np.array(k), np.array(v)
    out[f"s{i}"] = np.array(s)
np.savez(f"/tmp/{name}-{text}-{n}.npz", **out)
