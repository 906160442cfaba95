"""Bucketed attention (on CUDA, multi-token forwards attend over the key buffer up to the next
multiple of 256, masked): the same logits and states as the exact key length. Forced on here."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

import kvstate as ks
from kvstate.adapters import _buckets as buckets
from kvstate.adapters import wrap
from kvstate.adapters.tiny_models import tiny_model

PROMPTS = [[3, 17, 42, 99, 7, 250, 31, 8, 1, 2], [5, 6, 7], [9, 10, 11, 12, 13, 14]]


def run_both(monkeypatch, name: str, steps) -> list[tuple[np.ndarray, np.ndarray]]:
    """`steps(m)` -> logits, with bucketing off and on."""
    out = []
    for force in (False, True):
        monkeypatch.setattr(buckets, "FORCE", force)
        out.append([np.array(x) for x in steps(wrap(tiny_model(name)))])
    return list(zip(*out, strict=True))


@pytest.mark.parametrize("name", ["llama", "gemma3_text", "qwen3_next"])
def test_bucketed_forwards_give_the_exact_logits(monkeypatch, name):
    def steps(m):
        state = ks.merge([m(mx.array([p]), m.init_state())[1] for p in PROMPTS])
        verify, after, checkpoints = m(mx.array([[1, 2, 3, 4, 5]] * 3), state, capture=True)
        state = ks.commit_prefix(after, [5, 2, 0], checkpoints)
        follow, state = m(mx.array([[6, 7, 8]] * 3), state)
        decode, _ = m(mx.array([[9]] * 3), state)
        return verify, follow, decode

    for exact, bucketed in run_both(monkeypatch, name, steps):
        np.testing.assert_allclose(bucketed, exact, rtol=1e-4, atol=1e-4)


def test_buckets_cover_the_keys_and_the_classes_come_back(monkeypatch):
    monkeypatch.setattr(buckets, "FORCE", True)
    model = tiny_model("llama", num_hidden_layers=1)
    seen = []
    attention = model.model.layers[0].self_attn
    original = type(attention).__call__

    def spy(self, x, mask=None, cache=None):
        array = not (isinstance(mask, str) or mask is None)
        seen.append((mask.shape if array else None, type(cache), mask.dtype if array else None))
        return original(self, x, mask, cache)

    monkeypatch.setattr(type(attention), "__call__", spy)
    m = wrap(model)
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
