"""mlx-vlm's cache classes: round trips of every state hypothesis draws."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

pytest.importorskip("mlx_vlm")

import kvstate as ks
from kvstate import tree_flatten
from kvstate.adapters import from_mlx_lm, to_mlx_lm
from kvstate.adapters.vlm import from_mlx_vlm, to_mlx_vlm
from kvstate.testing import accepted_counts, dense_kv_states
from property_tests.test_properties import any_state, assert_identical, forgetful, in_mlx_lm


def _names(caches: Any) -> Any:
    if isinstance(caches, list):
        return [_names(c) for c in caches]
    inner = getattr(caches, "caches", None)
    # mlx-lm has no SimpleKVCache: the same state is its ConcatenateKVCache there
    name = {"SimpleKVCache": "ConcatenateKVCache"}.get(type(caches).__name__, type(caches).__name__)
    return (name, None if inner is None else _names(list(inner)))


@given(state=any_state())
def test_mlx_vlm_round_trip_is_identity_and_matches_mlx_lm(state):
    """from_mlx_vlm(to_mlx_vlm(s)) == s field for field (bitwise), shares no array object
    with s, and the mlx-vlm caches are mlx-lm's classes of the same names (the state is the
    same in both libraries)."""
    try:
        caches = to_mlx_vlm(state)
    except ks.StateError:
        # Quantized layouts mlx-vlm has no class for (per-side bits, rotations, padded
        # channels): refused with a StateError, never converted wrongly.
        assume(False)
    back = from_mlx_vlm(caches)
    assert_identical(back, forgetful(state))
    ids = {id(a) for a in tree_flatten(state)[0]}
    assert not ids & {id(a) for a in tree_flatten(back)[0]}
    lm_caches = to_mlx_lm(state)
    if "QuantizedKV" not in repr(state):  # mlx-lm has no batched quantized class
        assert _names(caches) == _names(lm_caches)
        assert_identical(in_mlx_lm(back), from_mlx_lm(lm_caches))


@given(
    state=dense_kv_states(padded=False, concatenate=True, simple=True, max_length=6),
    data=st.data(),
)
def test_simple_kv_round_trip_and_commit_prefix_match_mlx_vlm(state, data):
    """A DenseKV in the SimpleKVCache form comes back from mlx-vlm unchanged, and
    commit_prefix keeps what mlx-vlm's own SimpleKVCache holds when update_and_fetch is
    given the settled positions and then only the kept part of the last forward."""
    from mlx_vlm.models.cache import SimpleKVCache

    assume(state.simple)  # an empty state of several rows is drawn in the padded form
    cache = to_mlx_vlm(state)
    assert type(cache) is SimpleKVCache
    assert_identical(from_mlx_vlm(cache), forgetful(state))
    kept = data.draw(accepted_counts(state, ragged=False))
    committed = to_mlx_vlm(ks.commit_prefix(state, kept))
    expected = SimpleKVCache()
    if state.keys is not None and state.values is not None:
        settled = state.length - state.appended
        for start, stop in ((0, settled), (settled, settled + kept)):
            if stop > start:
                expected.update_and_fetch(
                    state.keys[..., start:stop, :], state.values[..., start:stop, :]
                )
    assert type(committed) is SimpleKVCache
    assert committed.cache_length == expected.cache_length
    for ours, theirs in zip(committed.state, expected.state, strict=True):
        assert (ours is None) == (theirs is None)
        if ours is not None:
            assert ours.dtype == theirs.dtype and (ours == theirs).all().item()
