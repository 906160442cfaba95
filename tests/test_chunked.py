"""ChunkedKV through wrap, the adapters and the transforms, against mlx-lm's ChunkedKVCache
(driven directly, and inside a tiny random-init llama4 with generate_step)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import llama4
from mlx_lm.models.cache import ChunkedKVCache, make_prompt_cache

import kvstate as ks
from kvstate.adapters import from_mlx_lm, to_mlx_lm, wrap
from kvstate.kinds import record_forward
from kvstate.testing import assert_states_equal, frozen_copy
from tests.helpers import greedy_reference, raw_logits

CHUNK = 8
PROMPT = [3, 17, 42, 99, 7, 250, 31, 8, 1, 2, 3, 4]  # longer than a chunk
DRAFT = [11, 12, 13, 14]
FOLLOW = [5, 6, 7]


@pytest.fixture(scope="module")
def model():
    """A tiny llama4: layers 0-2 chunked (ChunkedKVCache), layer 3 global (KVCache)."""
    text = {
        "model_type": "llama4_text",
        "attention_bias": False,
        "attention_chunk_size": CHUNK,
        "head_dim": 16,
        "hidden_size": 64,
        "interleave_moe_layer_step": 2,
        "intermediate_size": 64,
        "intermediate_size_mlp": 128,
        "max_position_embeddings": 4096,
        "num_attention_heads": 4,
        "num_experts_per_tok": 1,
        "num_hidden_layers": 4,
        "num_key_value_heads": 2,
        "num_local_experts": 2,
        "rms_norm_eps": 1e-5,
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "use_qk_norm": True,
        "vocab_size": 256,
    }
    mx.random.seed(0)
    m = llama4.Model(llama4.ModelArgs.from_dict({"model_type": "llama4", "text_config": text}))
    # Scale weights up, as kvstate.adapters.tiny_models does, so greedy decoding does not repeat.
    params = tree_flatten(m.parameters())
    m.update(
        tree_unflatten([(k, v * 4 if v.ndim >= 2 and "norm" not in k else v) for k, v in params])
    )
    mx.eval(m.parameters())
    return m


def np_(a: mx.array) -> np.ndarray:
    return np.array(a)


def assert_matches_cache(state: ks.ChunkedKV, cache: ChunkedKVCache) -> None:
    """Same positions, same entries in use (bitwise)."""
    assert (state.offset, state.start_position, state.chunk_size) == (
        cache.offset,
        cache.start_position,
        cache.chunk_size,
    )
    n = cache.offset - cache.start_position
    if cache.keys is None:
        assert state.keys is None
        return
    np.testing.assert_array_equal(np_(state.keys[..., :n, :]), np_(cache.keys[..., :n, :]))
    np.testing.assert_array_equal(np_(state.values[..., :n, :]), np_(cache.values[..., :n, :]))


# --- inside llama4, against generate_step and mlx-lm's own caches ------------------------


def test_greedy_tokens_equal_generate_step(model):
    expected = greedy_reference(model, PROMPT, 30)
    assert len(set(expected)) > 5, "the oracle decode is degenerate"
    m = wrap(model)
    logits, state = m(mx.array([PROMPT]), m.init_state())
    tokens = []
    for _ in range(30):
        y = logits[:, -1].argmax(-1)
        tokens.append(int(y.item()))
        logits, state = m(y[:, None], state)
    assert tokens == expected
    chunked = state.layers[0]
    assert isinstance(chunked, ks.ChunkedKV) and chunked.start_position > 0


def test_logits_equal_mlx_lm_under_teacher_forcing(model):
    tokens = PROMPT + list(range(60, 90))
    chunks = [len(PROMPT)] + [1] * 6 + [3, 2, 5, 1] + [1] * 3
    expected = raw_logits(model, tokens, chunks)
    m, state, at = wrap(model), wrap(model).init_state(), 0
    for size, ref in zip(chunks, expected, strict=True):
        logits, state = m(mx.array([tokens[at : at + size]]), state)
        np.testing.assert_allclose(np.array(logits), ref, rtol=1e-5, atol=1e-5)
        at += size


@pytest.mark.parametrize("prompt_len", [12, 5])  # the verify trims the front / does not
@pytest.mark.parametrize("accepted", [0, 1, 3, 4])
def test_commit_prefix_is_exact(model, prompt_len, accepted):
    prompt = PROMPT[:prompt_len]
    m = wrap(model)
    _, state = m(mx.array([prompt]), m.init_state())
    before_verify = frozen_copy(state)
    _, verified = m(mx.array([DRAFT]), state)
    trimmed = verified.layers[0].start_position > state.layers[0].start_position
    assert trimmed == (prompt_len > CHUNK)
    after_verify = frozen_copy(verified)
    committed = ks.commit_prefix(verified, accepted)

    # Oracle: mlx-lm's caches that only ever saw the accepted prefix.
    caches = make_prompt_cache(model)
    model(mx.array([prompt]), cache=caches)
    if accepted:
        model(mx.array([DRAFT[:accepted]]), cache=caches)
    for layer, cache in zip(committed.layers[:3], caches[:3], strict=True):
        assert isinstance(layer, ks.ChunkedKV) and layer.previous is None
        assert layer.appended == 0
        assert_matches_cache(layer, cache)
    expected = np.array(model(mx.array([FOLLOW]), cache=caches))
    logits, _ = m(mx.array([FOLLOW]), committed)
    np.testing.assert_allclose(np.array(logits), expected, rtol=1e-5, atol=1e-5)

    assert_states_equal(state, before_verify)
    assert_states_equal(verified, after_verify)


def test_rejecting_a_single_token_forward_gives_the_same_future(model):
    """A one-token forward keeps no `previous` (that would copy the buffer every step); its
    rejection keeps the dropped front dropped, which every later forward would drop anyway."""
    m = wrap(model)
    _, state = m(mx.array([PROMPT]), m.init_state())
    _, one = m(mx.array([[DRAFT[0]]]), state)
    assert one.layers[0].previous is None
    rejected = ks.commit_prefix(one, 0)
    caches = make_prompt_cache(model)
    model(mx.array([PROMPT]), cache=caches)
    expected = np.array(model(mx.array([FOLLOW]), cache=caches))
    logits, after = m(mx.array([FOLLOW]), rejected)
    np.testing.assert_allclose(np.array(logits), expected, rtol=1e-5, atol=1e-5)
    for layer, cache in zip(after.layers[:3], caches[:3], strict=True):
        assert_matches_cache(layer, cache)


# --- driving ChunkedKVCache directly ---------------------------------------------------


def trimmed_front(x: ks.ChunkedKV | ChunkedKVCache) -> ChunkedKVCache:
    """A new cache as the next forward sees it, after maybe_trim_front."""
    cache = ChunkedKVCache(CHUNK)
    cache.state = x.state if isinstance(x, ChunkedKVCache) else to_mlx_lm(x).state
    cache.maybe_trim_front()
    return cache


def llama4_step(cache: ChunkedKVCache, keys: mx.array, values: mx.array) -> None:
    """What llama4 does to a chunked layer's cache in one forward."""
    cache.maybe_trim_front()
    cache.update_and_fetch(keys, values)


@pytest.mark.parametrize(
    "steps",
    [
        [(5, 5), (4, 2), (1, 1), (6, 0), (3, 3), (1, 0), (2, 1), (7, 7), (4, 0)],
        [(9, 9), (3, 1), (3, 0), (1, 1), (1, 1), (5, 4), (2, 0), (1, 0)],
    ],
)
def test_update_sequences_match_chunked_kv_cache(steps):
    """(n, accepted) per forward: the state runs n tokens through a cache object made by the
    adapter and commits `accepted`; the oracle cache only ever sees the accepted tokens."""
    mx.random.seed(1)
    oracle = ChunkedKVCache(CHUNK)
    state = ks.ChunkedKV(chunk_size=CHUNK)
    for n, accepted in steps:
        keys, values = mx.random.normal((1, 2, n, 16)), mx.random.normal((1, 2, n, 8))
        frozen = frozen_copy(state)
        cache = to_mlx_lm(state)
        llama4_step(cache, keys, values)
        verified = record_forward(from_mlx_lm(cache), state, n)
        assert_states_equal(state, frozen)
        assert verified.appended == n and (verified.previous is not None) == (n > 1)
        state = ks.commit_prefix(verified, accepted)
        if accepted:
            llama4_step(oracle, keys[..., :accepted, :], values[..., :accepted, :])
        if n == 1 and accepted == 0:
            # No `previous`: the front this forward dropped stays dropped. Equal once the
            # next forward's maybe_trim_front has run on both.
            assert_matches_cache(trimmed_front(state), trimmed_front(oracle))
        else:
            assert_matches_cache(state, oracle)


def test_round_trips_are_identities(model):
    caches = make_prompt_cache(model)
    model(mx.array([PROMPT]), cache=caches)
    model(mx.array([DRAFT]), cache=caches)  # trims the front
    layer = from_mlx_lm(caches[0])
    assert isinstance(layer, ks.ChunkedKV) and layer.start_position > 0
    assert layer.keys is not caches[0].keys
    assert_matches_cache(layer, caches[0])
    back = to_mlx_lm(layer)
    assert type(back) is ChunkedKVCache and back.keys is not layer.keys
    assert_matches_cache(layer, back)
    assert back.keys.shape == caches[0].keys.shape  # the capacity is kept too
    again = from_mlx_lm(back)
    assert ks.tree_flatten(again)[1] == ks.tree_flatten(layer)[1]
    empty = ks.ChunkedKV(chunk_size=CHUNK)
    assert ks.tree_flatten(from_mlx_lm(to_mlx_lm(empty)))[1] == ks.tree_flatten(empty)[1]


# --- batch transforms ------------------------------------------------------------------


def test_tile_keeps_previous(model):
    m = wrap(model)
    _, state = m(mx.array([PROMPT]), m.init_state())
    _, verified = m(mx.array([DRAFT]), state)
    tiled = ks.tile(verified, 2)
    restored = ks.commit_prefix(tiled, 0).layers[0]
    original = state.layers[0]
    assert restored.start_position == original.start_position == 0
    assert ks.batch_size(restored) == 2
    for row in range(2):
        np.testing.assert_array_equal(
            np_(ks.extract(restored, row).keys), np_(original.keys[..., : original.offset, :])
        )


def test_merge_batches_states_at_equal_positions():
    """Two sequences at one position, merged, then one more step: each row matches its own
    ChunkedKVCache. (llama4 itself runs batch 1 only: its global layers reject a BatchKVCache.)"""
    mx.random.seed(2)
    oracles, states = [], []
    for _ in range(2):
        oracle, state = ChunkedKVCache(CHUNK), ks.ChunkedKV(chunk_size=CHUNK)
        for n in (9, 4):  # the second step trims the front
            k, v = mx.random.normal((1, 2, n, 16)), mx.random.normal((1, 2, n, 8))
            llama4_step(oracle, k, v)
            cache = to_mlx_lm(state)
            llama4_step(cache, k, v)
            state = from_mlx_lm(cache)
        oracles.append(oracle)
        states.append(state)
    merged = ks.merge(states)
    assert ks.batch_size(merged) == 2 and merged.start_position == 1
    k, v = mx.random.normal((2, 2, 3, 16)), mx.random.normal((2, 2, 3, 8))
    cache = to_mlx_lm(merged)
    llama4_step(cache, k, v)
    after = from_mlx_lm(cache)
    for row, oracle in enumerate(oracles):
        llama4_step(oracle, k[row : row + 1], v[row : row + 1])
        assert_matches_cache(ks.extract(after, row), oracle)
        assert_matches_cache(ks.row_select(after, row), oracle)


def test_refusals_name_the_fix(model):
    m = wrap(model)
    _, a = m(mx.array([PROMPT]), m.init_state())
    _, b = m(mx.array([PROMPT[:5]]), m.init_state())
    with pytest.raises(ks.ConfigMismatchError, match="same position"):
        ks.merge([a.layers[0], b.layers[0]])
    _, verified = m(mx.array([DRAFT, DRAFT]), ks.tile(a, 2))
    with pytest.raises(ks.CommitError, match="one count for every row"):
        ks.commit_prefix(verified, [1, 2])
    with pytest.raises(ks.ConfigMismatchError, match=r"8 != 4|4 != 8"):
        ks.merge([ks.ChunkedKV(chunk_size=8), ks.ChunkedKV(chunk_size=4)])
    with pytest.raises(ks.StateError, match="no batch axis"):
        ks.tile(ks.ChunkedKV(chunk_size=8), 2)
