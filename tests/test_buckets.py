"""Bucketed attention (on CUDA, multi-token forwards attend over the key buffer up to the next
multiple of 256, masked): the same logits and states as the exact key length. Forced on here."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

import kvstate as ks
from kvstate.adapters import wrap
from kvstate.adapters.instruments import buckets
from kvstate.adapters.kernels.verify_attention import MAX_QUERIES
from kvstate.adapters.tiny_models import tiny_model

PROMPTS = [[3, 17, 42, 99, 7, 250, 31, 8, 1, 2], [5, 6, 7], [9, 10, 11, 12, 13, 14]]


def run_both(name: str, steps, verify_kernel=None, **config) -> list[tuple[np.ndarray, np.ndarray]]:
    """`steps(m)` -> logits, with bucketing off and on."""
    out = []
    for force in (False, True):
        m = wrap(tiny_model(name, **config), buckets=force, verify_kernel=verify_kernel)
        out.append([np.array(x) for x in steps(m)])
    return list(zip(*out, strict=True))


@pytest.mark.parametrize("name", ["llama", "gemma3_text", "qwen3_next"])
def test_bucketed_forwards_give_the_exact_logits(name):
    def steps(m):
        state = ks.merge([m(mx.array([p]), m.init_state())[1] for p in PROMPTS])
        verify, after, checkpoints = m(mx.array([[1, 2, 3, 4, 5]] * 3), state, capture=True)
        state = ks.commit_prefix(after, [5, 2, 0], checkpoints)
        follow, state = m(mx.array([[6, 7, 8]] * 3), state)
        decode, _ = m(mx.array([[9]] * 3), state)
        return verify, follow, decode

    for exact, bucketed in run_both(name, steps):
        np.testing.assert_allclose(bucketed, exact, rtol=1e-4, atol=1e-4)


def test_buckets_cover_the_keys_and_the_classes_come_back(monkeypatch):
    model = tiny_model("llama", num_hidden_layers=1)
    seen = []
    attention = model.model.layers[0].self_attn
    original = type(attention).__call__

    def spy(self, x, mask=None, cache=None):
        array = not (isinstance(mask, str) or mask is None)
        seen.append((mask.shape if array else None, type(cache), mask.dtype if array else None))
        return original(self, x, mask, cache)

    monkeypatch.setattr(type(attention), "__call__", spy)
    m = wrap(model, buckets=True, verify_kernel=False)  # the spy is not on a routed class
    _, state = m(mx.array([PROMPTS[0]]), m.init_state())
    assert seen[-1][0] == (10, 256)  # 10 queries over a 256-key bucket
    # Keys exist now: the mask is additive, in their dtype (CUDA would convert a boolean one
    # in every layer).
    m(mx.array([[1, 2, 3]]), state)
    assert seen[-1][0] == (3, 256) and seen[-1][2] == mx.float32
    m(mx.array([[1]]), state)  # one token: exact length, mlx-lm's own mask
    assert seen[-1][0] is None
    assert all(type(c) in (KVCache, BatchKVCache) for c in make_prompt_cache(model))
    assert type(ks.adapters.to_mlx_lm(state)[0]) is KVCache


# -- the verify kernel route (`_verify_attention`; on the CPU it is MLX's own attention with
# mlx-lm's "causal" mask, so these check the routing; the kernel itself is checked against
# MLX's attention on CUDA below) ---------------------------------------------------------


def counting_kernel(monkeypatch, padded: list[bool] | None = None) -> list[tuple[int, ...]]:
    """The query shapes the verify attention is called with, from now on (and in `padded`
    whether each call was given the rows' left padding)."""
    calls: list[tuple[int, ...]] = []
    chosen = buckets.attention_for_device

    def spying():
        original = chosen()

        def spy(queries, keys, values, scale, first=None):
            calls.append(tuple(queries.shape))
            if padded is not None:
                padded.append(first is not None)
            return original(queries, keys, values, scale, first)

        return spy

    monkeypatch.setattr(buckets, "attention_for_device", spying)
    return calls


@pytest.mark.parametrize("name", ["llama", "qwen3_next", "gemma3_text"])
def test_verify_kernel_route_gives_the_exact_logits_and_checkpoints(monkeypatch, name):
    """Batch-1 verifies of 2..9 tokens through the routed attention equal the same forwards
    without any bucketing (mlx-lm's own attention at the exact length), and every attention
    layer of every verify went through the route; decode steps did not."""

    def steps(m):
        _, state = m(mx.array([PROMPTS[0]]), m.init_state())
        out = []
        for width in (2, 5, 9):
            logits, after, checkpoints = m(
                mx.array([list(range(3, 3 + width))]), state, capture=True
            )
            state = ks.commit_prefix(after, width - 1, checkpoints)
            step, state = m(mx.array([[7]]), state)
            out += [logits, step, *ks.tree_flatten(state)[0]]
        return out

    calls = counting_kernel(monkeypatch)
    for exact, routed in run_both(name, steps, verify_kernel=True, head_dim=32):
        np.testing.assert_allclose(routed, exact, rtol=1e-4, atol=1e-4)
    # Every KVCache layer (gemma3's global ones; its window layers keep their own mask).
    attention = sum(type(c) is KVCache for c in make_prompt_cache(tiny_model(name)))
    assert attention > 0
    # The prompt (10 tokens, an empty cache) is a prefill: bucketed, not routed.
    assert [c[2] for c in calls] == [2] * attention + [5] * attention + [9] * attention


def test_verify_kernel_route_is_for_one_forward_and_declines_what_it_cannot_take(monkeypatch):
    calls = counting_kernel(monkeypatch)
    model = tiny_model("llama", head_dim=32)
    attention_class = type(model.model.layers[0].self_attn)
    m = wrap(model, buckets=True, verify_kernel=True)
    _, state = m(mx.array([PROMPTS[0]]), m.init_state())
    _, state = m(mx.array([[1, 2, 3]]), state)
    assert len(calls) == model.args.num_hidden_layers
    assert type(model.model.layers[0].self_attn) is attention_class  # routed for one forward
    # Longer than MAX_QUERIES: MLX's attention over the buckets.
    m(mx.array([list(range(MAX_QUERIES + 1))]), state)
    # A tree (its own mask) keeps the buckets.
    m.tree_forward(mx.array([[1, 2, 3]]), state, [-1, 0, 0])
    # A sliding window (gemma3_text's local layers ask for window_size): buckets for those.
    gemma = wrap(tiny_model("gemma3_text", head_dim=32), buckets=True, verify_kernel=True)
    _, g = gemma(mx.array([PROMPTS[0]]), gemma.init_state())
    gemma(mx.array([[1, 2, 3]]), g)
    assert len(calls) == model.args.num_hidden_layers + sum(
        type(c) is KVCache for c in make_prompt_cache(gemma.model)
    )


@pytest.mark.parametrize("name", ["llama", "qwen3_next", "gemma3_text"])
def test_a_ragged_batchs_verifies_take_the_kernel_with_each_rows_padding(monkeypatch, name):
    """A ragged batch (rows of 10, 3 and 6 tokens: left padding) verifying 2..9 tokens, its
    ragged commits between them, through the routed attention: the logits and states of the
    same forwards without any bucketing (mlx-lm's attention and array masks); every attention
    layer of every verify went to the kernel with the rows' padding."""

    def steps(m):
        state = ks.merge([m(mx.array([p]), m.init_state())[1] for p in PROMPTS])
        out = []
        for width, kept in ((2, [2, 1, 2]), (5, [1, 5, 3]), (9, [9, 4, 1])):
            logits, after, checkpoints = m(
                mx.array([list(range(3 + b, 3 + b + width)) for b in range(3)]), state,
                capture=True,
            )  # fmt: skip
            state = ks.commit_prefix(after, kept, checkpoints)
            step, state = m(mx.array([[7], [8], [9]]), state)
            out += [logits, step, *ks.tree_flatten(state)[0]]
        return out

    padded: list[bool] = []
    calls = counting_kernel(monkeypatch, padded)
    for exact, routed in run_both(name, steps, verify_kernel=True, head_dim=32):
        np.testing.assert_allclose(routed, exact, rtol=1e-4, atol=1e-4)
    attention = sum(type(c) is KVCache for c in make_prompt_cache(tiny_model(name)))
    assert attention > 0
    assert [c[2] for c in calls] == [2] * attention + [5] * attention + [9] * attention
    assert all(c[0] == 3 for c in calls) and all(padded)


def test_a_batch_verify_the_kernel_cannot_take_gets_the_padded_mask():
    """The batch cache's "causal" mask never reaches mlx-lm's attention (which would read it
    as a plain causal mask, over the padding): a call the kernel does not take (attention
    sinks here) runs MLX's attention with the rows' padded causal mask."""
    rng = np.random.default_rng(0)
    q = mx.array(rng.standard_normal((2, 4, 3, 32)), mx.float32)
    k, v = (mx.array(rng.standard_normal((2, 2, 9, 32)), mx.float32) for _ in range(2))
    sinks = mx.array(rng.standard_normal(4), mx.float32)
    first = mx.array([0, 4], mx.int32)

    class Cache:
        left_padding = first
        _kvstate_bucket = buckets.Bucket()

    kernel_calls = []
    Cache._kvstate_bucket.kernel = lambda *a: kernel_calls.append(a)
    got = buckets.ROUTES[buckets._BucketedBatchKV](q, k, v, Cache(), 0.5, "causal", sinks)
    mask = mx.array(
        np.tril(np.ones((3, 9), bool), 6)[None, None] & (np.arange(9) >= [[0], [4]])[:, None, None]
    )
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.5, mask=mask, sinks=sinks)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5)
    assert kernel_calls == []
    assert buckets.ROUTES[buckets._BucketedBatchKV](q, k, v, Cache(), 0.5, mask, None) is None


@pytest.mark.skipif(not mx.cuda.is_available(), reason="the verify kernel runs on CUDA")
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("tokens, keys", [(2, 40), (5, 300), (9, 1029)])
def test_verify_kernel_with_left_padding_equals_mlx_attention(dtype, tokens, keys):
    from kvstate.adapters.kernels.verify_attention import causal_attention, verify_attention

    rng = np.random.default_rng(tokens)
    q = mx.array(rng.standard_normal((4, 8, tokens, 64)), dtype)
    k = mx.array(rng.standard_normal((4, 2, keys + 40, 64)), dtype)[..., :keys, :]
    v = mx.array(rng.standard_normal((4, 2, keys + 40, 64)), dtype)[..., :keys, :]
    first = mx.array([0, 1, keys // 2, keys - tokens], mx.int32)
    got = verify_attention(q, k, v, 0.125, first).astype(mx.float32)
    want = causal_attention(q, k, v, 0.125, first).astype(mx.float32)
    tol = 2e-5 if dtype == mx.float32 else 2e-2
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=tol, atol=tol)


@pytest.mark.skipif(not mx.cuda.is_available(), reason="the verify kernel runs on CUDA")
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize(
    "batch, heads, kv_heads, tokens, keys, dim",
    [(1, 16, 8, 5, 1029, 128), (1, 4, 4, 1, 300, 64), (2, 8, 2, 9, 17, 256), (3, 6, 3, 32, 40, 96),
     (1, 8, 1, 17, 2100, 128)],
)  # fmt: skip
def test_verify_kernel_equals_mlx_attention(dtype, batch, heads, kv_heads, tokens, keys, dim):
    from kvstate.adapters.kernels.verify_attention import verify_attention

    rng = np.random.default_rng(tokens + keys)
    q = mx.array(rng.standard_normal((batch, heads, tokens, dim)), dtype)
    # Keys and values as a cache's fetch gives them: a slice of a longer buffer.
    k = mx.array(rng.standard_normal((batch, kv_heads, keys + 40, dim)), dtype)[..., :keys, :]
    v = mx.array(rng.standard_normal((batch, kv_heads, keys + 40, dim)), dtype)[..., :keys, :]
    got = verify_attention(q, k, v, dim**-0.5).astype(mx.float32)
    want = mx.fast.scaled_dot_product_attention(
        q, k, v, scale=dim**-0.5, mask="causal" if tokens > 1 else None
    ).astype(mx.float32)
    tol = 2e-5 if dtype == mx.float32 else 2e-2
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=tol, atol=tol)


def test_routed_attention_passes_its_arguments_through(monkeypatch):
    """The routed function hands a route (scale, mask, sinks) however the model passed them,
    and calls mlx-lm's function with exactly the caller's arguments when the route declines."""
    from kvstate.adapters.instruments import routing

    class Cache:
        pass

    seen = []
    monkeypatch.setitem(routing.ROUTES, Cache, lambda q, k, v, c, *rest: seen.append(rest))
    calls = []
    routed = routing.routed_function(lambda *args, **kw: calls.append((args, kw)) or "mlx-lm")
    cache = Cache()
    assert routed(1, 2, 3, cache, 0.5, "causal") == "mlx-lm"
    assert routed(1, 2, 3, cache=cache, scale=0.25, mask=None, sinks=7) == "mlx-lm"
    assert seen == [(0.5, "causal", None), (0.25, None, 7)]
    assert calls == [
        ((1, 2, 3, cache, 0.5, "causal"), {}),
        ((1, 2, 3), {"cache": cache, "scale": 0.25, "mask": None, "sinks": 7}),
    ]
