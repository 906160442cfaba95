"""Which op of a many-row generation fails on MLX CUDA (diagnostic, H200).

tests/test_speculative.py's 300-row sampled test raised `cudaGraphAddKernelNode ... invalid
argument` on the H200. This runs the one-token step after a batched prefill op by op, raw
mlx-lm's step and its BatchGenerator, and kvstate's, for row counts around the failure, and
prints what fails (found on mlx 0.32.4: from 128 rows, `mx.fast.rope` with per-row offsets,
in mlx-lm as in kvstate; BENCHMARKS.md, Findings).

    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/probes/cuda_rows_probe.py
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx

from kvstate.adapters import wrap
from kvstate.adapters.tiny_models import tiny_model
from kvstate.adapters.wrapped.tokens import guarded, nan_where
from kvstate.speculative import ModelDrafter, Sampler, generate


def attempt(label: str, fn: Callable[[], Any]) -> None:
    try:
        mx.eval(fn())
        print(f"ok      {label}", flush=True)
    except Exception as e:  # a probe: print and go on
        print(f"FAILED  {label}: {e!r:.160}", flush=True)


def generation(model: Any, sampler: Sampler, rows: int) -> None:
    """The test's own path: generate without a drafter, then with the test's draft model."""
    target = wrap(model)
    prompts = [[5, 9, 13]] * rows

    def run(drafter: Any) -> Any:
        return [t for r in generate(target, prompts, drafter, k=3, max_tokens=2, sampler=sampler,
                                    seed=11) for t in r]  # fmt: skip

    attempt(f"{rows} rows: generate, no drafter", lambda: mx.array(0) if run(None) else None)
    draft = wrap(tiny_model("llama", num_hidden_layers=2, seed=4))
    attempt(
        f"{rows} rows: generate, ModelDrafter",
        lambda: mx.array(0) if run(ModelDrafter(draft, seed=1)) else None,
    )


def decode_step_ops(rows: int) -> None:
    """The one-token step over a batched (left-padded) KV cache, op by op: the prefill of
    `rows` rows ran in earlier probes, the first step after it failed."""
    from mlx_lm.models.base import scaled_dot_product_attention
    from mlx_lm.models.cache import BatchKVCache

    heads, kv_heads, dim, keys = 4, 2, 32, 4
    q = mx.random.normal((rows, heads, 1, dim))
    k = mx.random.normal((rows, kv_heads, keys, dim))
    offsets = mx.full((rows,), 3, mx.int32)
    mask = mx.ones((rows, 1, 1, keys), mx.bool_)
    attempt(f"{rows} rows: rope, per-row offsets",
            lambda: mx.fast.rope(q, dim, traditional=False, base=10000.0, scale=1.0,
                                 offset=offsets))  # fmt: skip
    attempt(f"{rows} rows: rope, one offset",
            lambda: mx.fast.rope(q, dim, traditional=False, base=10000.0, scale=1.0, offset=3))  # fmt: skip
    attempt(f"{rows} rows: sdpa, 1 query, bool mask",
            lambda: mx.fast.scaled_dot_product_attention(q, k, k, scale=0.1, mask=mask))  # fmt: skip
    attempt(f"{rows} rows: sdpa, 1 query, no mask",
            lambda: mx.fast.scaled_dot_product_attention(q, k, k, scale=0.1))  # fmt: skip
    attempt(f"{rows} rows: mlx-lm sdpa, 1 query, bool mask",
            lambda: scaled_dot_product_attention(q, k, k, None, scale=0.1, mask=mask))  # fmt: skip
    model = tiny_model("llama", num_hidden_layers=2, seed=3)
    caches = [BatchKVCache(left_padding=[0] * rows) for _ in model.layers]
    attempt(f"{rows} rows: raw mlx-lm BatchKVCache prefill",
            lambda: model(mx.array([[5, 9, 13]] * rows), cache=caches))  # fmt: skip
    attempt(f"{rows} rows: raw mlx-lm BatchKVCache one-token step",
            lambda: model(mx.array([[7]] * rows), cache=caches))  # fmt: skip
    ids = mx.full((rows, 1), 7, mx.uint32)
    attempt(f"{rows} rows: wrap's id guard (compiled)", lambda: guarded(ids, 256))
    attempt(f"{rows} rows: wrap's NaN poisoning (compiled)",
            lambda: nan_where(ids == 0, mx.zeros((rows, 1, 256))))  # fmt: skip
    m = wrap(model)
    _, state = m(mx.array([[5, 9, 13]] * rows), m.init_state(rows))
    attempt(f"{rows} rows: wrapped one-token step, ids from the host",
            lambda: m([[7]] * rows, state)[0])  # fmt: skip
    attempt(f"{rows} rows: wrapped one-token step, ids as an mx.array",
            lambda: m(ids, state)[0])  # fmt: skip


def step_by_op(rows: int) -> None:
    """The failing one-token step (raw mlx-lm, BatchKVCache) taken apart: each op of the first
    layer evaluated on its own, then matmuls of the step's shapes."""
    from mlx_lm.models.base import scaled_dot_product_attention
    from mlx_lm.models.cache import BatchKVCache

    model = tiny_model("llama", num_hidden_layers=2, seed=3)
    caches = [BatchKVCache(left_padding=[0] * rows) for _ in model.layers]
    mx.eval(model(mx.array([[5, 9, 13]] * rows), cache=caches))
    inner, cache = model.model, caches[0]
    layer = inner.layers[0]
    attn = layer.self_attn
    x = inner.embed_tokens(mx.array([[7]] * rows))
    attempt(f"{rows} rows, op: embedding", lambda: x)
    mask = cache.make_mask(1)
    attempt(f"{rows} rows, op: BatchKVCache.make_mask(1)", lambda: mask if mask is not None else x)
    h = layer.input_layernorm(x)
    attempt(f"{rows} rows, op: rms norm", lambda: h)
    q = attn.q_proj(h)
    attempt(f"{rows} rows, op: q projection (rows, 1, D) @ W", lambda: q)
    queries = q.reshape(rows, 1, attn.n_heads, -1).transpose(0, 2, 1, 3)
    keys = attn.k_proj(h).reshape(rows, 1, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    values = attn.v_proj(h).reshape(rows, 1, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    rq = attn.rope(queries, offset=cache.offset)
    attempt(f"{rows} rows, op: rope with per-row offsets", lambda: rq)
    rk = attn.rope(keys, offset=cache.offset)
    k_all, v_all = cache.update_and_fetch(rk, values)
    attempt(f"{rows} rows, op: BatchKVCache.update_and_fetch", lambda: (k_all, v_all))
    out = scaled_dot_product_attention(rq, k_all, v_all, cache=cache, scale=attn.scale, mask=mask)
    attempt(f"{rows} rows, op: attention over the cache", lambda: out)
    o = attn.o_proj(out.transpose(0, 2, 1, 3).reshape(rows, 1, -1))
    attempt(f"{rows} rows, op: o projection", lambda: o)
    attempt(f"{rows} rows, op: MLP", lambda: layer.mlp(layer.post_attention_layernorm(x + o)))
    attempt(f"{rows} rows, op: lm head", lambda: model.lm_head(x) if hasattr(model, "lm_head")
            else inner.embed_tokens.as_linear(x))  # fmt: skip
    w = mx.random.normal((192, x.shape[-1]))
    for width in (1, 3):
        a = mx.random.normal((rows, width, x.shape[-1]))
        attempt(f"{rows} rows, matmul ({rows}, {width}, D) @ W.T", lambda a=a: a @ w.T)


def mlx_lm_batch_generator(rows: int) -> None:
    """mlx-lm's own batch generation of `rows` prompts (the oracle for a batch scheduler)."""
    from mlx_lm.generate import BatchGenerator

    model = tiny_model("llama", num_hidden_layers=2, seed=3)

    def run() -> Any:
        gen = BatchGenerator(
            model, max_tokens=3, completion_batch_size=rows, prefill_batch_size=rows
        )
        gen.insert([[5, 9, 13]] * rows)
        done = 0
        while done < rows:
            responses = gen.next_generated()
            done += sum(r.finish_reason is not None for r in responses)
        gen.close()
        return mx.array(0)

    attempt(f"{rows} rows: mlx-lm BatchGenerator", run)


def main() -> None:
    for rows in (127, 128):
        step_by_op(rows)
    for rows in (64, 127, 128, 300):
        decode_step_ops(rows)
    for rows in (64, 128, 300):
        mlx_lm_batch_generator(rows)
    model = tiny_model("llama", num_hidden_layers=2, seed=3)
    sampler = Sampler(temperature=1.0, top_k=6)
    for rows in (127, 128):
        generation(model, sampler, rows)


if __name__ == "__main__":
    main()
