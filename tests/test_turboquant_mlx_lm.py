"""TurboQuant states on mlx-lm's own models (not only mlx-vlm's language models).

mlx-lm's attention function takes any cache with `bits` for its QuantizedKVCache, so an mlx-lm
model on mlx-vlm's TurboQuant caches fails; a wrapped model routes those layers to mlx-vlm's
attention function instead (`instruments.routing`). The oracle: the same mlx-lm model run on
mlx-vlm's TurboQuantKVCache list with its module-level attention function replaced by
mlx-vlm's, which is what mlx-vlm does for its own models.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models import llama
from mlx_vlm import turboquant as tq
from mlx_vlm.models.base import scaled_dot_product_attention as vlm_attention

import kvstate as ks
from kvstate.adapters import wrap
from kvstate.adapters.tiny_models import tiny_model
from kvstate.speculative import NGramDrafter, generate


def _state(layers: int, bits: float) -> ks.ModelState:
    return ks.ModelState(tuple(ks.TurboQuantKV(key_bits=bits, value_bits=bits, seed=4)
                               for _ in range(layers)))  # fmt: skip


@pytest.mark.parametrize("bits", [3, 3.5])
def test_a_wrapped_mlx_lm_model_reads_turboquant_states_as_mlx_vlm_would(monkeypatch, bits):
    model = tiny_model("llama", head_dim=64, scale=3.0)
    m = wrap(model)
    layers = len(model.layers)
    state = _state(layers, bits)
    prompt = mx.array([[3, 17, 42, 8, 99, 5, 61, 2]])
    draft = mx.array([[11, 23, 7]])
    ours = []
    logits, state = m(prompt, state)
    ours.append(logits)
    logits, state = m(draft, state)
    ours.append(logits)
    state = ks.commit_prefix(state, 1)
    logits, state = m(mx.array([[9]]), state)
    ours.append(logits)

    caches = [
        tq.TurboQuantKVCache(3, seed=4, key_bits=bits, value_bits=bits) for _ in range(layers)
    ]
    monkeypatch.setattr(llama, "scaled_dot_product_attention", vlm_attention)
    theirs = [model(prompt, cache=caches), model(draft, cache=caches)]
    for cache in caches:
        cache.trim(2)
    theirs.append(model(mx.array([[9]]), cache=caches))
    for got, want in zip(ours, theirs, strict=True):
        assert mx.array_equal(got, want).item()


def test_speculation_on_turboquant_states_equals_their_own_greedy_decode():
    """n-gram drafts verified and rolled back on TurboQuant layers give the tokens of plain
    greedy decoding on the same states (the rollback is exact)."""
    model = tiny_model("llama", head_dim=64, scale=3.0)
    m = wrap(model)
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [1, 2, 3, 4, 1, 2, 3]]
    states = [_state(len(model.layers), 4) for _ in prompts]
    plain = _rows(generate(m, prompts, None, max_tokens=12, states=states), len(prompts))
    drafted = generate(
        m, prompts, NGramDrafter(min_n=1), k=3, max_tokens=12, states=states, adaptive=False
    )
    assert _rows(drafted, len(prompts)) == plain
    assert drafted.drafted > drafted.accepted > 0  # drafts kept and drafts rolled back


def _rows(generation, n: int) -> list[list[int]]:
    out: list[list[int]] = [[] for _ in range(n)]
    for tokens in generation:
        for t in tokens:
            out[t.row].append(t.token)
    return out
