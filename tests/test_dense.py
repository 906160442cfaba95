"""DenseKV through wrap and the transforms, against mlx-lm's KVCache / BatchKVCache."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import _right_pad_prompts
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

import kvstate as ks
from kvstate.adapters import from_mlx_lm, to_mlx_lm, wrap
from kvstate.adapters.tiny_models import tiny_model
from kvstate.testing import assert_states_equal, frozen_copy
from tests.helpers import (
    assert_teacher_forced_logits_match,
    decode_side_by_side,
    greedy_reference,
    mlx_lm_batch_prefill,
    raw_logits,
)

PROMPT = [3, 17, 42, 99, 7, 250, 31, 8]
PROMPTS = [[5, 9, 200, 14, 77], [1, 2, 3, 4, 5, 6, 7, 8, 9], [66, 12, 130]]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model(request):
    return tiny_model(request.param)


def greedy_through_wrap(model, prompt: list[int], n: int) -> list[int]:
    m = wrap(model)
    logits, state = m(mx.array([prompt]), m.init_state())
    tokens = []
    for _ in range(n):
        y = logits[:, -1].argmax(-1)
        tokens.append(int(y.item()))
        logits, state = m(y[:, None], state)
    return tokens


def test_greedy_tokens_equal_generate_step(model):
    expected = greedy_reference(model, PROMPT, 40)
    assert len(set(expected)) > 5, "the oracle decode is degenerate; the test would be weak"
    assert greedy_through_wrap(model, PROMPT, 40) == expected


def test_logits_equal_mlx_lm_under_teacher_forcing(model):
    tokens = PROMPT + greedy_reference(model, PROMPT, 24)
    chunks = [len(PROMPT)] + [1] * 10 + [3, 2, 1, 4] + [1] * 4
    assert_teacher_forced_logits_match(model, wrap(model), tokens, chunks)


@pytest.mark.parametrize("accepted", [0, 1, 3, 4])
def test_commit_prefix_equals_decoding_only_the_accepted_prefix(model, accepted):
    m = wrap(model)
    draft = [11, 12, 13, 14]
    _, state = m(mx.array([PROMPT]), m.init_state())
    _, verified = m(mx.array([draft]), state)
    committed = ks.commit_prefix(verified, accepted)
    follow = [5, 6, 7]
    logits, _ = m(mx.array([follow]), committed)
    (expected,) = raw_logits(model, PROMPT + draft[:accepted] + follow, [8 + accepted + 3])[-1:]
    np.testing.assert_allclose(np.array(logits), expected[:, -3:], rtol=1e-4, atol=1e-4)


def test_ragged_commit_equals_per_row_decode(model):
    """Rows of a batch keep different prefixes of one verify; each row then decodes like a
    batch-1 mlx-lm decode of exactly its accepted tokens."""
    m = wrap(model)
    singles = [m(mx.array([p]), m.init_state())[1] for p in PROMPTS]
    state = ks.merge(singles)
    drafts = [[20, 21, 22, 23, 24], [30, 31, 32, 33, 34], [40, 41, 42, 43, 44]]
    _, verified = m(mx.array(drafts), state)
    accepted = [5, 1, 3]
    committed = ks.commit_prefix(verified, accepted)
    follow = [[7, 8], [9, 10], [11, 12]]
    logits = None
    for step in range(2):
        logits, committed = m(mx.array([[f[step]] for f in follow]), committed)
        for row in range(3):
            tokens = PROMPTS[row] + drafts[row][: accepted[row]] + follow[row][: step + 1]
            (expected,) = raw_logits(model, tokens, [len(tokens)])
            np.testing.assert_allclose(
                np.array(logits[row, -1]), expected[0, -1], rtol=1e-4, atol=1e-4
            )


def assert_batch_cache_equal(state: ks.DenseKV, cache: BatchKVCache) -> None:
    n = cache._idx
    assert state.length == n
    np.testing.assert_array_equal(np.array(state.left_padding), np.array(cache.left_padding))
    np.testing.assert_array_equal(
        np.array(state.length - state.left_padding), np.array(cache.offset)
    )
    np.testing.assert_array_equal(
        np.array(state.keys[..., :n, :]), np.array(cache.keys[..., :n, :])
    )
    np.testing.assert_array_equal(
        np.array(state.values[..., :n, :]), np.array(cache.values[..., :n, :])
    )


def test_batched_prompts_decode_like_mlx_lm_batch_generation(model):
    m = wrap(model)
    prefix = [p[:-1] for p in PROMPTS]
    ref_logits, caches = mlx_lm_batch_prefill(model, prefix)
    logits, state = m(_right_pad_prompts(prefix), m.init_state(3), lengths=[len(p) for p in prefix])
    np.testing.assert_allclose(np.array(logits), np.array(ref_logits), rtol=1e-5, atol=1e-5)
    y = mx.array([[p[-1]] for p in PROMPTS])
    distinct = decode_side_by_side(model, m, caches, state, y, 12, assert_batch_cache_equal)
    assert len(distinct) > 5, "the oracle decode is degenerate; the test would be weak"


def prefilled(model, prompts):
    """Per-prompt batch-1 mlx-lm caches and the same as states."""
    caches = []
    for p in prompts:
        c = make_prompt_cache(model)
        model(mx.array([p]), cache=c)
        caches.append(c)
    return caches, [from_mlx_lm(c) for c in caches]


def test_merge_filter_extend_extract_match_batch_kv_cache(model):
    caches, states = prefilled(model, PROMPTS)
    merged = ks.merge(states)
    batch = [KVCache.merge([c[i] for c in caches]) for i in range(len(caches[0]))]
    for layer, cache in zip(merged.layers, batch, strict=True):
        assert_batch_cache_equal(layer, cache)

    extra_caches, extra_states = prefilled(model, [[9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9]])
    extended = ks.extend(merged, ks.merge(extra_states))
    for c, e in zip(batch, extra_caches[0], strict=True):
        c.extend(BatchKVCache.merge([e]))
    for layer, cache in zip(extended.layers, batch, strict=True):
        assert_batch_cache_equal(layer, cache)

    kept = ks.filter(extended, [0, 2])
    for c in batch:
        c.filter([0, 2])
    for layer, cache in zip(kept.layers, batch, strict=True):
        assert_batch_cache_equal(layer, cache)

    one = ks.extract(kept, 1)
    for layer, cache in zip(one.layers, batch, strict=True):
        ref = cache.extract(1)
        assert layer.left_padding is None and layer.length == ref.offset
        np.testing.assert_array_equal(np.array(layer.keys), np.array(ref.keys))
        np.testing.assert_array_equal(np.array(layer.values), np.array(ref.values))


def test_tile_and_row_select_repeat_rows(model):
    _, states = prefilled(model, PROMPTS)
    merged = ks.merge(states)
    tiled = ks.tile(merged, 2)
    assert ks.batch_size(tiled) == 6
    for i in range(3):
        row = ks.row_select(tiled, 2 * i + 1)
        for a, b in zip(row.layers, merged.layers, strict=True):
            np.testing.assert_array_equal(np.array(a.keys[0]), np.array(b.keys[i]))
            assert a.left_padding.item() == b.left_padding[i].item()


def test_round_trip_through_mlx_lm_is_identity_and_never_shares_arrays(model):
    _, states = prefilled(model, PROMPTS)
    merged = ks.merge(states)
    for state in (states[0], merged):
        back = to_mlx_lm(state)
        again = from_mlx_lm(back)
        before = frozen_copy(state)
        assert_states_equal(again, before)
        for layer, cache in zip(state.layers, back, strict=True):
            assert layer.keys is not cache.keys and layer.values is not cache.values


def test_no_transform_and_no_forward_changes_its_input(model):
    m = wrap(model)
    _, states = prefilled(model, PROMPTS)
    merged = ks.merge(states)
    _, verified = m(mx.array([[1, 2, 3]] * 3), merged)
    before = frozen_copy(verified)
    results = [
        m(mx.array([[4]] * 3), verified)[1],
        ks.commit_prefix(verified, 1),
        ks.commit_prefix(verified, [3, 0, 2]),
        ks.tile(verified, 2),
        ks.row_select(verified, [2, 0]),
        ks.filter(verified, [1]),
        ks.extend(verified, verified),
        ks.extract(verified, 2),
        ks.snapshot(verified),
    ]
    ks.eval(results)
    assert_states_equal(verified, before)


def test_kept_state_is_copied_on_write_and_rebound_state_is_updated_in_place():
    """Keeping the old state costs a copy of the context when the model writes (copy on
    write); rebinding lets MLX donate the buffer, so the step allocates far less."""
    model = tiny_model("llama", num_hidden_layers=2)
    m = wrap(model)
    _, state = m(mx.array([list(range(200)) * 10]), m.init_state())  # 2000 tokens
    state = ks.eval(state)
    context = sum(layer.keys.nbytes + layer.values.nbytes for layer in state.layers)
    y = mx.array([[1]])

    def peak_of_step(keep_old: bool) -> int:
        nonlocal state
        mx.eval(y)
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        old = state
        _, state = m(y, state)
        if not keep_old:
            del old
        ks.eval(state)
        return mx.get_peak_memory() - base

    peak_of_step(keep_old=False)  # warm up
    rebound = peak_of_step(keep_old=False)
    kept = peak_of_step(keep_old=True)
    assert kept >= 0.9 * context, (kept, context)
    assert rebound < 0.5 * context, (rebound, context)


# --- errors -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def verified():
    model = tiny_model("llama", num_hidden_layers=1)
    m = wrap(model)
    _, states = prefilled(model, PROMPTS)
    return m(mx.array([[1, 2, 3]] * 3), ks.merge(states))[1]


@pytest.mark.parametrize(
    ("accepted", "match"),
    [
        (4, "exceeds the 3 tokens"),
        (-1, ">= 0"),
        (1.5, "must be an int"),
        ([1, 2], "2 counts for a state of 3 rows"),
        ([1, 2, 9], "exceeds"),
        (mx.array([1, -2, 0]), ">= 0"),
    ],
)
def test_bad_accepted_counts_raise_commit_error(verified, accepted, match):
    before = frozen_copy(verified)
    with pytest.raises(ks.CommitError, match=match):
        ks.commit_prefix(verified, accepted)
    assert_states_equal(verified, before)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda s: ks.row_select(s, 3), "out of range"),
        (lambda s: ks.filter(s, [0, 7]), r"rows \[7\] out of range"),
        (lambda s: ks.extract(s, -4), "out of range"),
        (lambda s: ks.filter(s, []), "no rows"),
        (lambda s: ks.tile(s, 0), "n must be an int >= 1"),
        (lambda s: ks.row_select(s, "a"), "rows must be an int or a list of ints"),
    ],
)
def test_bad_rows_raise_row_error(verified, call, match):
    with pytest.raises(ks.RowError, match=match):
        call(verified)


def test_merging_mismatched_configs_raises():
    a = ks.DenseKV(mx.zeros((1, 2, 4, 16)), mx.zeros((1, 2, 4, 16)), length=4)
    for other, what in [
        (
            ks.DenseKV(mx.zeros((1, 2, 4, 32)), mx.zeros((1, 2, 4, 16)), length=4),
            "key_dim: 16 != 32",
        ),
        (
            ks.DenseKV(mx.zeros((1, 2, 4, 16), mx.float16), mx.zeros((1, 2, 4, 16)), length=4),
            "dtype: 'mlx.core.float32' != 'mlx.core.float16'",
        ),
        (
            ks.DenseKV(mx.zeros((1, 4, 4, 16)), mx.zeros((1, 4, 4, 16)), length=4),
            "kv_heads: 2 != 4",
        ),
    ]:
        with pytest.raises(ks.ConfigMismatchError, match=what):
            ks.merge([a, other])
    with pytest.raises(ks.StateError, match="expected a kvstate state"):
        ks.merge([a, KVCache()])


def test_tokens_of_the_wrong_shape_raise_token_error(verified):
    m = wrap(tiny_model("llama", num_hidden_layers=1))
    with pytest.raises(ks.TokenError, match="tokens have 2 rows but the state has 3"):
        m(mx.array([[1, 2]] * 2), verified)


def test_wrap_rejects_bad_lengths_states_and_batch_sizes(verified):
    m = wrap(tiny_model("llama", num_hidden_layers=1))
    tokens = mx.array([[1, 2, 0]] * 3)
    with pytest.raises(ks.ShapeError, match=r"one int in 1..3 .* got \[3, 4, 1\]"):
        m(tokens, verified, lengths=[3, 4, 1])
    with pytest.raises(ks.ShapeError, match="per row of the 3-row batch"):
        m(tokens, verified, lengths=[3, 2])
    with pytest.raises(ks.StateError, match="capture=True with lengths="):
        m(tokens, verified, lengths=[3, 2, 1], capture=True)
    with pytest.raises(ks.StateError, match=r"must be a kvstate\.ModelState"):
        m(tokens, [KVCache()])
    with pytest.raises(ks.ShapeError, match="batch_size must be an int >= 1"):
        m.init_state(0)
