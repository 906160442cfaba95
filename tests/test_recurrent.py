"""RecurrentState and ListState against mlx-lm's ArraysCache / CacheList: batch transforms,
batched decoding through wrap, round trips, and inputs that never change."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import _merge_caches, _right_pad_prompts
from mlx_lm.models.cache import ArraysCache, BatchKVCache, CacheList, KVCache, make_prompt_cache

import kvstate as ks
from kvstate.adapters import from_mlx_lm, to_mlx_lm, wrap
from kvstate.adapters.tiny_models import tiny_model
from kvstate.testing import assert_states_equal, frozen_copy
from tests.helpers import decode_side_by_side, mlx_lm_batch_prefill

PROMPTS = [[5, 9, 200, 14, 77], [1, 2, 3, 4, 5, 6, 7, 8, 9], [66, 12, 130]]


@pytest.fixture(scope="module", params=["mamba2", "qwen3_next"])
def model(request):
    return tiny_model(request.param)


def assert_optional_equal(a: mx.array | None, b: mx.array | None, what: str) -> None:
    assert (a is None) == (b is None), f"{what}: {a} vs {b}"
    if a is not None:
        assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} vs {b.dtype}"
        np.testing.assert_array_equal(np.array(a), np.array(b), err_msg=what)


def assert_matches(state, cache) -> None:
    """A layer state holds exactly what an mlx-lm cache object holds (bitwise)."""
    if isinstance(cache, ArraysCache):
        assert isinstance(state, ks.RecurrentState)
        assert len(state.arrays) == len(cache.cache)
        for i, (a, c) in enumerate(zip(state.arrays, cache.cache, strict=True)):
            assert_optional_equal(a, c, f"array {i}")
        assert_optional_equal(state.left_padding, cache.left_padding, "left_padding")
        assert_optional_equal(state.lengths, cache.lengths, "lengths")
    elif isinstance(cache, CacheList):
        assert isinstance(state, ks.ListState)
        for s, c in zip(state.states, cache.caches, strict=True):
            assert_matches(s, c)
    elif isinstance(cache, BatchKVCache):
        n = cache._idx
        assert state.length == n
        assert_optional_equal(state.left_padding, cache.left_padding, "left_padding")
        assert_optional_equal(state.keys[..., :n, :], cache.keys[..., :n, :], "keys")
        assert_optional_equal(state.values[..., :n, :], cache.values[..., :n, :], "values")
    else:
        assert isinstance(cache, KVCache)
        n = cache.offset
        assert state.length == n
        assert_optional_equal(state.keys[..., :n, :], cache.keys[..., :n, :], "keys")
        assert_optional_equal(state.values[..., :n, :], cache.values[..., :n, :], "values")


def arrays_cache(arrays, left_padding=None, lengths=None) -> ArraysCache:
    cache = ArraysCache(len(arrays))
    cache.cache = list(arrays)
    cache.left_padding = None if left_padding is None else mx.array(left_padding)
    cache.lengths = None if lengths is None else mx.array(lengths)
    return cache


def rand(*shape):
    return mx.random.normal(shape)


# ---------------------------------------------------------------------------------------
# Batch transforms, array for array against ArraysCache.
# ---------------------------------------------------------------------------------------


def test_merge_matches_arrays_cache_merge_with_zeros_for_missing_arrays():
    mx.random.seed(1)
    caches = [
        arrays_cache([rand(1, 3, 8), rand(1, 2, 4, 4)]),
        arrays_cache([None, rand(1, 2, 4, 4)]),
        arrays_cache([rand(1, 3, 8), None]),
        arrays_cache([None, None]),
    ]
    states = [from_mlx_lm(c) for c in caches]
    before = frozen_copy(states)
    merged = ks.merge(states)
    assert_matches(merged, ArraysCache.merge(caches))
    assert_states_equal(states, before)
    # ArraysCache.merge takes batch-1 caches; merging batched states stacks their rows.
    halves = ks.merge([ks.merge(states[:2]), ks.merge(states[2:])])
    assert_matches(halves, ArraysCache.merge(caches))


def test_merge_of_empty_states_keeps_only_the_rows():
    caches = [ArraysCache(2) for _ in range(3)]
    merged = ks.merge([from_mlx_lm(c) for c in caches])
    assert_matches(merged, ArraysCache.merge(caches))
    assert ks.batch_size(merged) == 3
    assert ks.batch_size(ks.filter(merged, [0, 2])) == 2


def test_filter_extend_extract_match_arrays_cache():
    mx.random.seed(2)
    a = arrays_cache([rand(3, 3, 8), rand(3, 2, 4, 4)], left_padding=[2, 0, 1], lengths=[4, 5, 6])
    b = arrays_cache([rand(2, 3, 8), None])
    sa, sb = from_mlx_lm(a), from_mlx_lm(b)
    before = frozen_copy((sa, sb))

    extended = ks.extend(sa, sb)
    a.extend(b)
    assert_matches(extended, a)
    reverse = ks.extend(sb, sa)
    b2, a2 = to_mlx_lm(sb), to_mlx_lm(sa)
    b2.extend(a2)
    assert_matches(reverse, b2)

    kept = ks.filter(extended, [4, 0, 2])
    a.filter([4, 0, 2])
    assert_matches(kept, a)

    for row in range(3):
        assert_matches(ks.extract(kept, row), a.extract(row))
    assert_states_equal((sa, sb), before)


def test_filter_extend_extract_match_after_a_batched_prompt(model):
    m = wrap(model)
    lengths = [len(p) for p in PROMPTS]
    _, state = m(_right_pad_prompts(PROMPTS), m.init_state(3), lengths=lengths)
    recurrent = [(i, s) for i, s in enumerate(state.layers) if isinstance(s, ks.RecurrentState)]
    assert recurrent
    for _, s in recurrent:
        cache = to_mlx_lm(s)
        other = to_mlx_lm(s)
        cache.extend(other)
        assert_matches(ks.extend(s, s), cache)
        cache.filter([5, 1])
        assert_matches(ks.filter(ks.extend(s, s), [5, 1]), cache)
        assert_matches(ks.extract(s, 2), to_mlx_lm(s).extract(2))


def test_row_select_and_tile_gather_rows():
    mx.random.seed(3)
    state = from_mlx_lm(arrays_cache([rand(2, 3, 8), rand(2, 2, 4, 4)], left_padding=[1, 0]))
    tiled = ks.tile(state, 3)
    assert ks.batch_size(tiled) == 6
    for i in range(6):
        row = ks.row_select(tiled, i)
        for a, b in zip(row.arrays, state.arrays, strict=True):
            np.testing.assert_array_equal(np.array(a[0]), np.array(b[i // 3]))
        assert row.left_padding.item() == [1, 0][i // 3]


def test_merging_mismatched_recurrent_configs_raises():
    a = ks.RecurrentState((mx.zeros((1, 3, 8)), mx.zeros((1, 2, 4, 4))))
    for other, what in [
        (ks.RecurrentState((mx.zeros((1, 3, 16)), mx.zeros((1, 2, 4, 4)))), "8 != 16"),
        (
            ks.RecurrentState((mx.zeros((1, 3, 8), mx.float16), mx.zeros((1, 2, 4, 4)))),
            "float16",
        ),
        (ks.RecurrentState((mx.zeros((1, 3, 8)),)), "2 != 1"),
        (ks.DenseKV(mx.zeros((1, 2, 4, 16)), mx.zeros((1, 2, 4, 16)), length=4), "DenseKV"),
    ]:
        with pytest.raises(ks.ConfigMismatchError, match=what):
            ks.merge([a, other])
    # An array not written yet matches any.
    ks.merge([a, ks.RecurrentState((None, None))])


# ---------------------------------------------------------------------------------------
# Batched decoding against mlx-lm's batch machinery.
# ---------------------------------------------------------------------------------------


def test_batched_prompts_decode_like_mlx_lm_batch_generation(model):
    m = wrap(model)
    prefix = [p[:-1] for p in PROMPTS]
    ref_logits, caches = mlx_lm_batch_prefill(model, prefix)
    empty = m.init_state(3)
    before = frozen_copy(empty)
    logits, state = m(_right_pad_prompts(prefix), empty, lengths=[len(p) for p in prefix])
    assert_states_equal(empty, before)  # ArraysCache.advance's `-=` never reaches a state
    np.testing.assert_allclose(np.array(logits), np.array(ref_logits), rtol=1e-5, atol=1e-5)
    for layer, cache in zip(state.layers, caches, strict=True):
        assert_matches(layer, cache)
    y = mx.array([[p[-1]] for p in PROMPTS])
    distinct = decode_side_by_side(model, m, caches, state, y, 32, assert_matches)
    assert len(distinct) > 10, "the oracle decode is degenerate; the test would be weak"


# ---------------------------------------------------------------------------------------
# Round trips and purity.
# ---------------------------------------------------------------------------------------


def test_round_trip_through_mlx_lm_is_identity_and_never_shares_arrays(model):
    # States read from mlx-lm caches (`appended`, which mlx-lm does not track, is 0).
    batched = from_mlx_lm(mlx_lm_batch_prefill(model, PROMPTS)[1])
    caches = make_prompt_cache(model)
    model(mx.array([PROMPTS[0]]), cache=caches)
    single = from_mlx_lm(caches)
    empty = from_mlx_lm(_merge_caches([make_prompt_cache(model) for _ in range(3)]))
    with_bookkeeping = from_mlx_lm(
        arrays_cache([rand(2, 3, 8), None], left_padding=[1, 0], lengths=[3, 4])
    )
    for state in (batched, single, empty, with_bookkeeping):
        before = frozen_copy(state)
        back = to_mlx_lm(state)
        assert_states_equal(from_mlx_lm(back), before)
        layers = state.layers if isinstance(state, ks.ModelState) else (state,)
        caches = back if isinstance(back, list) else [back]
        for layer, cache in zip(layers, caches, strict=True):
            if isinstance(layer, ks.RecurrentState):
                assert_matches(layer, cache)
                for a, c in zip(layer.arrays, cache.cache, strict=True):
                    assert a is None or a is not c
                for a, c in [
                    (layer.left_padding, cache.left_padding),
                    (layer.lengths, cache.lengths),
                ]:
                    assert a is None or a is not c


def test_cache_list_round_trip_keeps_its_parts():
    model = tiny_model("falcon_h1", num_hidden_layers=1)
    caches = make_prompt_cache(model)
    model(mx.array([PROMPTS[1]]), cache=caches)
    state = from_mlx_lm(caches)
    (layer,) = state.layers
    assert isinstance(layer, ks.ListState)
    assert [type(s) for s in layer.states] == [ks.RecurrentState, ks.DenseKV]
    for s, c in zip(layer.states, caches[0].caches, strict=True):
        assert_matches(s, c)
    back = to_mlx_lm(state)
    assert isinstance(back[0], CacheList)
    assert [type(c) for c in back[0].caches] == [ArraysCache, KVCache]
    assert_states_equal(from_mlx_lm(back), frozen_copy(state))


def test_mlx_lm_writes_into_a_converted_cache_never_reach_the_state():
    mx.random.seed(4)
    state = from_mlx_lm(
        arrays_cache([rand(2, 3, 8), rand(2, 4)], left_padding=[1, 0], lengths=[3, 2])
    )
    before = frozen_copy(state)
    cache = to_mlx_lm(state)
    cache.advance(5)  # `self.lengths -= 5`, `self.left_padding -= 5`: in place
    cache[0][0:1] = mx.ones((1, 3, 8))
    cache.filter([1])
    assert_states_equal(state, before)


def test_no_transform_and_no_capturing_forward_changes_its_input(model):
    m = wrap(model)
    singles = [m(mx.array([p]), m.init_state())[1] for p in PROMPTS]
    merged = ks.merge(singles)
    before = frozen_copy(merged)
    _, verified, checkpoints = m(mx.array([[1, 2, 3]] * 3), merged, capture=True)
    assert_states_equal(merged, before)
    snap = frozen_copy((verified, checkpoints))
    ks.commit_prefix(verified, [0, 3, 1], checkpoints)
    ks.commit_prefix(verified, 3)
    ks.filter(verified, [2, 0])
    ks.extend(verified, verified)
    ks.extract(verified, 1)
    ks.tile(verified, 2)
    ks.merge([verified, verified])
    assert_states_equal((verified, checkpoints), snap)


# ---------------------------------------------------------------------------------------
# commit_prefix on a RecurrentState alone (NumPy reference for the checkpoint choice).
# ---------------------------------------------------------------------------------------


def test_ragged_commit_picks_each_rows_checkpoint_and_restores_bookkeeping():
    rng = np.random.default_rng(5)
    conv = rng.normal(size=(3, 5, 2, 4)).astype(np.float32)  # (B, K+1, ...)
    ssm = rng.normal(size=(3, 5, 6)).astype(np.float32)
    state = ks.RecurrentState(
        (mx.array(conv[:, -1]), mx.array(ssm[:, -1]), None),
        left_padding=mx.array([-4, -2, 0]),  # advanced by K = 4
        appended=4,
    )
    checkpoints = (mx.array(conv), mx.array(ssm), None)
    counts = [0, 3, 2]
    out = ks.commit_prefix(state, counts, checkpoints)
    np.testing.assert_array_equal(np.array(out.arrays[0]), conv[np.arange(3), counts])
    np.testing.assert_array_equal(np.array(out.arrays[1]), ssm[np.arange(3), counts])
    assert out.arrays[2] is None and out.lengths is None and out.appended == 0
    np.testing.assert_array_equal(np.array(out.left_padding), [0, -1, 2])
    with pytest.raises(ks.CheckpointRequiredError, match="capture=True"):
        ks.commit_prefix(state, [4, 4, 3])
    assert ks.commit_prefix(state, 4).appended == 0
    with pytest.raises(ks.ShapeError, match=r"\[1\]: expected shape \(3, 5, 6\).*\[2\]: the state"):
        ks.commit_prefix(state, 1, (mx.array(conv), mx.array(ssm[:, :4]), mx.zeros((3, 5))))
    with pytest.raises(ks.ShapeError, match=r"\[0\]: expected shape \(3, 5, 2, 4\) dtype"):
        ks.commit_prefix(state, 1, (mx.array(conv).astype(mx.float16), mx.array(ssm), None))


# ---------------------------------------------------------------------------------------
# Checkpoints entry by entry, against mlx-lm run on each prefix of the verify.
# ---------------------------------------------------------------------------------------


def left_padded_caches(model, left_padding: list[int]) -> list:
    """mlx-lm caches for left-padded prompts: ArraysCache and BatchKVCache with padding."""
    caches = []
    for c in make_prompt_cache(model):
        if isinstance(c, ArraysCache):
            caches.append(ArraysCache(len(c.cache), left_padding=left_padding))
        else:
            caches.append(BatchKVCache(left_padding))
    return caches


def recurrent_layers(caches_or_state):
    layers = (
        caches_or_state.layers if isinstance(caches_or_state, ks.ModelState) else caches_or_state
    )
    return [i for i, c in enumerate(layers) if isinstance(c, (ArraysCache, ks.RecurrentState))]


@pytest.mark.parametrize("capture_path", ["fast", "replay"])
def test_checkpoint_entry_t_is_mlx_lm_after_t_tokens_of_a_left_padded_batch(model, capture_path):
    """Rows padded on the left (so the recurrent layers see a mask with False entries):
    entry t of every checkpoint is the array mlx-lm holds after the first t tokens."""
    padding = [2, 0, 3]
    tokens = mx.array([[0] * p + PROMPTS[1][: 7 - p] for p in padding])
    m = wrap(model, record_mixers=capture_path != "replay")
    state = from_mlx_lm(left_padded_caches(model, padding))
    logits, after, checkpoints = m(tokens, state, capture=True)
    ref_logits = model(tokens, cache=left_padded_caches(model, padding))
    for row, p in enumerate(padding):  # a padding position's logits mean nothing
        got, want = np.array(logits[row, p:]), np.array(ref_logits[row, p:])
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    layers = recurrent_layers(after)
    assert layers
    for t in range(1, 8):
        caches = left_padded_caches(model, padding)
        model(tokens[:, :t], cache=caches)
        for i in layers:
            for a, c in zip(checkpoints[i], caches[i].cache, strict=True):
                at_t = np.array(ks.checkpoint_at(a, t))
                np.testing.assert_allclose(at_t, np.array(c), rtol=1e-4, atol=1e-4)
    for i in layers:  # entry 0: before the verify, None written as zeros
        for a in checkpoints[i]:
            assert not np.array(ks.checkpoint_at(a, 0)).any()
