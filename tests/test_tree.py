"""The pytree boundary: flatten/unflatten, tree_map, eval and mx.compile on states."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import kvstate as ks


def sample_state() -> ks.ModelState:
    k = mx.arange(2 * 2 * 6 * 4, dtype=mx.float32).reshape(2, 2, 6, 4)
    dense = ks.DenseKV(k, k + 1, mx.array([0, 2], mx.int32), length=5, appended=2)
    recurrent = ks.RecurrentState((mx.ones((2, 3, 8)), None, mx.zeros((2, 4))), appended=2)
    return ks.ModelState((dense, ks.ListState((recurrent, dense)), recurrent))


def test_flatten_unflatten_round_trip_keeps_structure_statics_and_arrays():
    state = sample_state()
    leaves, treedef = ks.tree_flatten(state)
    assert len(leaves) == 3 + 2 + 3 + 2  # None children are structure, not leaves
    hash(treedef)  # usable as a cache key at a compile boundary
    again = ks.tree_unflatten(treedef, leaves)
    assert ks.tree_flatten(again)[1] == treedef
    assert again.layers[0].length == 5 and again.layers[0].appended == 2
    assert again.layers[2].arrays[1] is None
    for a, b in zip(ks.tree_flatten(again)[0], leaves, strict=True):
        assert a is b


def test_unflatten_rejects_too_many_leaves():
    leaves, treedef = ks.tree_flatten(sample_state())
    with pytest.raises(ks.ShapeError, match="describes 10 arrays but 11 were given"):
        ks.tree_unflatten(treedef, [*leaves, mx.zeros(1)])


def test_tree_map_changes_arrays_only():
    state = sample_state()
    doubled = ks.tree_map(lambda a: a * 2, state)
    assert ks.tree_flatten(doubled)[1] == ks.tree_flatten(state)[1]
    np.testing.assert_array_equal(
        np.array(doubled.layers[0].keys), 2 * np.array(state.layers[0].keys)
    )
    lazy = ks.tree_map(lambda a: a + 1, state)
    assert ks.eval(lazy) is lazy


def test_nbytes_counts_every_array():
    state = sample_state()
    expected = sum(a.nbytes for a in ks.tree_flatten(state)[0])
    assert ks.nbytes(state) == expected > 0


def test_states_cross_an_mx_compile_boundary_as_leaves():
    state = sample_state()
    leaves, treedef = ks.tree_flatten(state)

    @mx.compile
    def step(*arrays):
        inner = ks.tree_unflatten(treedef, list(arrays))
        out = ks.tree_map(lambda a: a * 3, inner)
        return tuple(ks.tree_flatten(out)[0])

    result = ks.tree_unflatten(treedef, list(step(*leaves)))
    np.testing.assert_array_equal(
        np.array(result.layers[1].states[0].arrays[0]), 3 * np.ones((2, 3, 8))
    )


def test_states_are_frozen_and_compare_by_identity():
    state = sample_state()
    with pytest.raises(AttributeError):
        state.layers = ()  # type: ignore[misc]
    assert state == state and state != sample_state()
    assert len({state, state}) == 1  # hashable by identity
