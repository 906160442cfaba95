"""Bad input raises a StateError naming the problem, whichever function gets it, and the
functions agree on what they accept (integers of every kind, pending forwards)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache

import kvstate as ks
from kvstate import kinds
from kvstate.adapters import from_mlx_lm, wrap
from kvstate.adapters.tiny_models import tiny_model

K = mx.random.normal((1, 2, 6, 4))


@pytest.fixture(scope="module")
def hybrid():
    return wrap(tiny_model("qwen3_next"))


def dense(length: int = 4, appended: int = 2) -> ks.DenseKV:
    return ks.DenseKV(K, K, length=length, appended=appended)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: ks.commit_prefix(dense(), 1, 5), ks.CommitError, "must be None"),
        (
            lambda: ks.commit_prefix(ks.ModelState((dense(),)), 1, 5),
            ks.CommitError,
            "checkpoints for a ModelState of 1 parts must be a tuple of 1 entries; got 5",
        ),
        (lambda: ks.commit_prefix(dense(), 1.0), ks.CommitError, "must be an int"),
        (lambda: ks.commit_prefix(dense(), [True]), ks.CommitError, "must hold only ints"),
        (lambda: ks.merge(dense()), ks.StateError, "expected a list of states; got a DenseKV"),
        (lambda: ks.merge("ab"), ks.StateError, "expected a list of states; got a str"),
        (lambda: ks.merge([]), ks.StateError, "got no states"),
        (lambda: ks.snapshot([KVCache()]), ks.StateError, "snapshot: .*from_mlx_lm"),
        (lambda: ks.snapshot(None), ks.StateError, "snapshot: expected a kvstate state"),
        (lambda: ks.extend(dense(), KVCache()), ks.StateError, "extend: b: expected a kvstate"),
        (lambda: ks.quantize(dense(), bits=4.0), ks.ConfigMismatchError, "bits=4.0"),
        (lambda: ks.quantize(dense(), bits=True), ks.ConfigMismatchError, "bits=True"),
        (lambda: ks.quantize(dense(), group_size="64"), ks.ConfigMismatchError, "group_size"),
        (lambda: ks.tile(dense(), 2.0), ks.RowError, "tile: n must be an integer"),
        (lambda: ks.tile(dense(), True), ks.RowError, "tile: n must be an integer"),
        (lambda: ks.extract(dense(), "0"), ks.RowError, "extract: row must be an integer"),
        (lambda: ks.row_select(dense(), mx.zeros((1, 1), mx.int32)), ks.RowError, "1-d integer"),
        (lambda: ks.row_select(dense(), mx.array([0.0])), ks.RowError, "1-d integer"),
        (lambda: ks.batch_size([K]), ks.StateError, "list is not a kvstate state"),
        (lambda: ks.nbytes(kinds.trusted(ks.DenseKV)(keys=3)), ks.StateError, None),  # type: ignore[arg-type]
        (lambda: ks.quantize("a state"), ks.StateError, "expected a DenseKV"),
    ],
)
def test_bad_arguments_raise_state_errors(call, error, match):
    with pytest.raises(error, match=match) as info:
        call()
    assert not isinstance(info.value, ks.NotSupportedError)  # a mistake, not a limitation


EMPTY_WINDOWS = [
    ks.ChunkedKV(chunk_size=8),
    ks.BufferedWindowKV(max_size=8),
    ks.StaticPrefixKV(max_size=8),
]


@pytest.mark.parametrize(
    ("call", "match"),
    [
        *[(lambda s=s: ks.tile(s, 2), "tile: an empty .* no batch axis") for s in EMPTY_WINDOWS],
        *[
            (lambda s=s: ks.merge([s, s]), "merge: an empty .* no batch axis")
            for s in EMPTY_WINDOWS
        ],
        (lambda: ks.quantize(ks.QuantizedKV()), "quantize: expected a DenseKV"),
        (lambda: ks.quantize(ks.RecurrentState()), "got a RecurrentState"),
    ],
)
def test_well_formed_requests_kvstate_cannot_do_raise_not_supported(call, match):
    """A caller can tell "kvstate does not do that" (and fall back) from a mistake."""
    with pytest.raises(ks.NotSupportedError, match=match):
        call()


def test_tree_unflatten_with_missing_extra_or_malformed_parts():
    leaves, treedef = ks.tree_flatten(ks.ModelState((dense(), dense())))
    with pytest.raises(ks.ShapeError, match="describes 4 arrays but 3 were given"):
        ks.tree_unflatten(treedef, leaves[:-1])
    with pytest.raises(ks.ShapeError, match="describes 4 arrays but 5 were given"):
        ks.tree_unflatten(treedef, [*leaves, K])
    with pytest.raises(ks.ShapeError, match=r"leaves \[1\] are not mx.array"):
        ks.tree_unflatten(treedef, [K, np.zeros(3), K, K])
    for bad in ("nonsense", (ks.DenseKV, (), ()), ("t", "a"), (dict, (), ()), 7):
        with pytest.raises(ks.StateError, match="not a kvstate TreeDef"):
            ks.tree_unflatten(bad, [])
    with pytest.raises(ks.StateError, match="leaves must be a list or tuple"):
        ks.tree_unflatten(treedef, iter(leaves))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "integer", [2, np.int64(2), np.int32(2), mx.array(2), np.array(2), mx.array(2, mx.uint8)]
)
def test_every_integer_is_accepted_everywhere(integer, hybrid):
    state = ks.merge([dense(), dense()])
    assert ks.batch_size(ks.tile(state, integer)) == 4
    assert ks.batch_size(ks.extract(ks.tile(state, 2), integer)) == 1
    assert ks.batch_size(ks.row_select(state, [integer % 2])) == 1
    assert ks.commit_prefix(state, integer).length == 4
    assert ks.batch_size(hybrid.init_state(integer)) == 2


def test_init_state_refuses_bools_and_non_integers(hybrid):
    for bad in (True, 2.0, "2", 0, -1):
        with pytest.raises(ks.ShapeError, match="batch_size must be an int"):
            hybrid.init_state(bad)


# ---------------------------------------------------------------------------------------
# A pending forward survives every row transform
# ---------------------------------------------------------------------------------------


def test_a_verify_can_be_merged_split_and_regrouped_before_its_commit(hybrid):
    """Two verified batch-1 states, merged, then committed with ragged counts, equal the two
    committed on their own and then merged. The checkpoints are concatenated the same way."""
    a = hybrid(mx.array([[1, 2, 3]]), hybrid.init_state())[1]
    b = hybrid(mx.array([[4, 5]]), hybrid.init_state())[1]
    _, va, ca = hybrid(mx.array([[7, 8, 9]]), a, capture=True)
    _, vb, cb = hybrid(mx.array([[6, 6, 6]]), b, capture=True)
    merged = ks.merge([va, vb])
    assert ks.kinds.appended_of(merged) == 3
    checkpoints = ks.tree_map(lambda x, y: mx.concatenate([x, y]), ca, cb)
    committed = ks.commit_prefix(merged, [1, 3], checkpoints)
    expected = ks.merge([ks.commit_prefix(va, 1, ca), ks.commit_prefix(vb, 3, cb)])
    probe = mx.array([[11], [12]])
    got, want = hybrid(probe, committed)[0], hybrid(probe, expected)[0]
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5)
    # Split again: each row keeps its pending forward, with its checkpoints' rows.
    row = ks.extract(merged, 1)
    assert ks.kinds.appended_of(row) == 3
    one = ks.commit_prefix(row, 3 - 1, ks.tree_map(lambda c: c[1:2], checkpoints))
    after_split = hybrid(mx.array([[5]]), one)[0]
    after_alone = hybrid(mx.array([[5]]), ks.commit_prefix(vb, 2, cb))[0]
    np.testing.assert_allclose(np.array(after_split), np.array(after_alone), rtol=1e-5, atol=1e-5)


def test_states_whose_pending_forwards_differ_merge_with_none_and_say_so():
    merged = ks.merge([dense(appended=1), dense(appended=2)])
    assert merged.appended == 0
    with pytest.raises(ks.CommitError, match=r"no pending forward.*merged / extended"):
        ks.commit_prefix(merged, 1)


# ---------------------------------------------------------------------------------------
# mlx-lm's batch phase
# ---------------------------------------------------------------------------------------


def test_a_batch_cache_between_prepare_and_finalize_is_refused_clearly():
    """Converting here used to drop `_right_padding`, so finalize() did nothing."""
    cache = BatchKVCache(left_padding=[0, 0])
    cache.prepare(lengths=[3, 1], right_padding=[0, 2])
    with pytest.raises(ks.StateError, match=r"between prepare\(\) and finalize\(\)"):
        from_mlx_lm([cache])
    cache.update_and_fetch(mx.zeros((2, 2, 3, 4)), mx.zeros((2, 2, 3, 4)))
    cache.finalize()
    state = from_mlx_lm([cache])
    assert np.array(state.layers[0].left_padding).tolist() == [0, 2]
