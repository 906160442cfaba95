"""Tiny random-init mlx-vlm models whose attention pools keys (PoolingCache) through
`wrap`, against mlx-vlm's own generation on its own caches: deepseek_v4 (sliding windows,
and compressed attention pooling every 4 or 128 tokens) and glm5_next (gated delta layers,
and sparse attention whose indexer pools every 4 keys next to a bool validity KVCache)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

pytest.importorskip("mlx_vlm")

import mlx.core as mx
from mlx_vlm.models import deepseek_v4, glm5_next
from mlx_vlm.models.cache import make_prompt_cache

import kvstate as ks
from kvstate.adapters.vlm import to_mlx_vlm, wrap
from tests.helpers import speculate_with_corrupted_oracle
from tests.vlm_helpers import _scaled, vlm_generate

VOCAB = 64
PROMPT = [3, 17, 42, 9, 60, 7, 1, 25, 33, 12]


def tiny_deepseek_v4() -> Any:
    config = deepseek_v4.ModelConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        q_lora_rank=32,
        qk_rope_head_dim=8,
        head_dim=32,
        compress_ratios=[0, 4, 128],  # local; sparse compressed (ratio 4); compressed
        hc_mult=2,
        hc_sinkhorn_iters=3,
        num_hash_layers=0,
        sliding_window=8,
        o_groups=2,
        o_lora_rank=32,
        index_n_heads=2,
        index_head_dim=16,
        index_topk=4,
        index_block=4,
        index_keep=2,
        num_nextn_predict_layers=0,
    )
    mx.random.seed(0)
    return _scaled(deepseek_v4.Model(config), 0, 2.0)


def tiny_glm5_next() -> Any:
    text = {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 64,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 4,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "kv_lora_rank": 16,
        "q_lora_rank": 32,
        "qk_rope_head_dim": 0,
        "v_head_dim": 16,
        "qk_nope_head_dim": 16,
        "index_topk": 8,
        "index_head_dim": 16,
        "index_n_heads": 2,
        "index_kpool": 4,
        "linear_head_dim": 16,
        "linear_num_heads": 2,
        "hc_mult": 2,
        "hc_sinkhorn_iters": 3,
        "first_k_dense_replace": 1,
        "layer_types": ["linear_attention"] * 3 + ["deepseek_sparse_attention"],
        "num_nextn_predict_layers": 0,
        "pad_token_id": 0,
    }
    vision = {
        "depth": 1,
        "hidden_size": 32,
        "num_heads": 2,
        "out_hidden_size": 64,
        "intermediate_size": 32,
        "projection_intermediate_size": 32,
    }
    config = glm5_next.ModelConfig.from_dict(
        {"model_type": "glm5_next", "text_config": text, "vision_config": vision}
    )
    mx.random.seed(0)
    return _scaled(glm5_next.Model(config), 0, 2.0)


@pytest.fixture(scope="module", params=[tiny_deepseek_v4, tiny_glm5_next], ids=lambda f: f.__name__)
def model(request):
    return request.param()


def test_init_state_holds_pooled_layers(model):
    state = wrap(model).init_state()
    kinds = [type(p).__name__ for layer in state.layers for p in getattr(layer, "states", [layer])]
    assert "PooledKV" in kinds


def test_greedy_equals_mlx_vlm_generate(model):
    ref, ref_logprobs = vlm_generate(model, PROMPT, 16)
    assert len(set(ref)) >= 4, "a degenerate oracle: the weights should make tokens vary"
    m = wrap(model)
    logits, state = m(mx.array([PROMPT]), m.init_state())
    got = []
    for theirs in ref_logprobs:
        step = logits[0, -1]
        np.testing.assert_allclose(
            np.array(step - mx.logsumexp(step)), np.array(theirs).reshape(-1), rtol=1e-4, atol=1e-4
        )
        got.append(int(step.argmax().item()))
        logits, state = m(mx.array([got[-1:]]), state)
    assert got == ref


def test_teacher_forced_logits_equal_mlx_vlm_on_its_caches(model):
    chunks = [PROMPT, [5], [9, 2, 40], [1], [8, 8, 3, 30, 2], [11], [4, 50]]
    caches = make_prompt_cache(model.language_model)
    m = wrap(model)
    state = m.init_state()
    for chunk in chunks:
        theirs = model.language_model(mx.array([chunk]), cache=caches).logits
        ours, state = m(mx.array([chunk]), state)
        np.testing.assert_allclose(np.array(ours), np.array(theirs), rtol=1e-4, atol=1e-4)


def test_speculative_decode_equals_greedy_and_refuses_only_pooled_rollbacks(model):
    """Draft-and-verify (capture=True, commit_prefix) equals mlx-vlm's greedy tokens. A
    commit the pooled layer cannot make (the kept window was pooled) raises CommitError;
    the decoder then re-runs the accepted tokens from the state before the verify."""
    n, k = 24, 4
    ref, _ = vlm_generate(model, PROMPT, n + k)
    m = wrap(model)
    outcomes = {"partial": 0, "refused": 0}

    def commit_or_rerun(state: Any, verified: Any, kept: list[int], checkpoints: Any) -> Any:
        try:
            committed = ks.commit_prefix(verified, len(kept), checkpoints)
        except ks.CommitError as err:
            assert "pooled" in str(err)
            outcomes["refused"] += 1
            return m(mx.array([kept]), state)[1]
        outcomes["partial"] += len(kept) < k
        return committed

    out, _ = speculate_with_corrupted_oracle(
        m, PROMPT, ref, n, k, VOCAB, keep=0.6, commit=commit_or_rerun
    )
    assert out == ref[:n]
    assert outcomes["partial"] >= 2 and outcomes["refused"] >= 1, outcomes


def test_merged_rows_of_different_lengths_decode_like_each_row_and_like_mlx_vlm_merge(model):
    """kvstate.merge of two conversations (left padding, BatchPoolingCache) then steps and a
    commit: each row's logits are its own conversation's, and the merged state's logits are
    those of mlx-vlm's own merge of the same caches. (glm5_next reads its bool validity
    KVCache at padding positions: the padding a ragged commit adds must read False.)"""
    check_merged_rows(model, ragged=False)
    check_merged_rows(model, ragged=True)


def check_merged_rows(model: Any, ragged: bool) -> None:
    m = wrap(model)
    _, a = m(mx.array([PROMPT[:7]]), m.init_state())
    _, b = m(mx.array([PROMPT[2:7]]), m.init_state())
    merged = ks.merge([a, b])
    columns = zip(to_mlx_vlm(a), to_mlx_vlm(a), to_mlx_vlm(b), strict=True)
    theirs = [type(c).merge([x, y]) for c, x, y in columns]
    step = mx.array([[11], [12]])
    np.testing.assert_allclose(
        np.array(m(step, merged)[0]),
        np.array(model.language_model(step, cache=theirs).logits),
        rtol=1e-4,
        atol=1e-4,
    )
    draft = mx.array([[4, 50, 9], [8, 3, 30]])
    logits, verified, checkpoints = m(draft, merged, capture=True)
    options = ([1, 3], [2, 1], [3, 2], [1, 2], [2, 3]) if ragged else ([2, 2], [1, 1], [3, 3])
    counts = next(c for c in options if _commits(verified, c, checkpoints))
    merged = ks.commit_prefix(verified, counts, checkpoints)
    rows = []
    for row, (state, count) in enumerate(zip((a, b), counts, strict=True)):
        row_logits, state = m(draft[row : row + 1, :count], state)
        np.testing.assert_allclose(
            np.array(logits[row, :count]), np.array(row_logits[0]), rtol=1e-4, atol=1e-4
        )
        rows.append(state)
    for t in ([[5], [6]], [[7], [1]]):
        got, merged = m(mx.array(t), merged)
        for row in range(2):
            want, rows[row] = m(mx.array([t[row]]), rows[row])
            np.testing.assert_allclose(np.array(got[row]), np.array(want[0]), rtol=1e-4, atol=1e-4)


def _commits(state: Any, counts: list[int], checkpoints: Any) -> bool:
    try:
        ks.commit_prefix(state, counts, checkpoints)
    except ks.CommitError:
        return False
    return True
