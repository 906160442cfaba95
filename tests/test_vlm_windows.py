"""mlx-vlm's BufferedRotatingKVCache <-> BufferedWindowKV and StaticPrefixKVCache <->
StaticPrefixKV, against mlx-vlm's own methods.

Oracles: the round-tripped cache holds the same fields and behaves like the original under
update_and_fetch / make_mask / decoder_state; commit_prefix equals mlx-vlm's trim; and after
a commit, attention through the cache (its own mask and keys) equals attention through a
cache that only ever saw the kept tokens.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("mlx_vlm")

from mlx_vlm.models import cache as V

import kvstate as ks
from kvstate import tree_flatten
from kvstate.adapters.vlm import from_mlx_vlm, to_mlx_vlm
from kvstate.kinds import record_forward
from kvstate.testing import (
    assert_states_equal,
    buffered_update,
    buffered_window_kv_states,
    static_prefix_kv_states,
)

H, D = 2, 4
SHAPES = {"heads": H, "k_dim": D, "v_dim": D, "dtype": mx.float32}


def kv(n: int, seed: int, batch: int = 1) -> tuple[mx.array, mx.array]:
    k = mx.random.normal((batch, H, n, D), key=mx.random.key(seed))
    return k, k * 2 - 1


def same(a: Any, b: Any, what: str) -> None:
    assert (a is None) == (b is None), what
    if a is not None:
        assert a.shape == b.shape and a.dtype == b.dtype, what
        np.testing.assert_array_equal(np.array(a), np.array(b), err_msg=what)


def same_fields(ours: Any, theirs: Any, names: tuple[str, ...]) -> None:
    assert type(ours) is type(theirs)
    same(ours.keys, theirs.keys, "keys")
    same(ours.values, theirs.values, "values")
    for name in names:
        assert getattr(ours, name) == getattr(theirs, name), name


def same_update(ours: Any, theirs: Any, n: int, seed: int, batch: int = 2) -> None:
    """The same update_and_fetch of n tokens on both caches returns the same keys and values."""
    for a, b in zip(
        ours.update_and_fetch(*kv(n, seed, batch)),
        theirs.update_and_fetch(*kv(n, seed, batch)),
        strict=True,
    ):
        same(a, b, "update_and_fetch")


def same_mask(a: Any, b: Any) -> None:
    if isinstance(a, mx.array) or isinstance(b, mx.array):
        same(a, b, "mask")
    else:
        assert a == b


def attend(cache: Any, n: int, seed: int, batch: int = 1) -> mx.array:
    """An attention layer's step: the cache's mask, then its keys, then attention."""
    q = mx.random.normal((batch, H, n, D), key=mx.random.key(seed + 1000))
    mask = cache.make_mask(n) if hasattr(cache, "make_mask") else None
    keys, values = cache.update_and_fetch(*kv(n, seed, batch))
    if mask is None and isinstance(cache, V.StaticPrefixKVCache) and n > 1:
        mask = "causal"
    return mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.5, mask=mask)


# ---------------------------------------------------------------------------------------
# BufferedRotatingKVCache
# ---------------------------------------------------------------------------------------

BUFFERED = ("offset", "_idx", "start_position", "max_size", "buffer_size", "step", "keep")


def buffered(sizes: list[int], max_size: int = 4, buffer_size: int = 2, batch: int = 1) -> Any:
    cache = V.BufferedRotatingKVCache(max_size, buffer_size=buffer_size)
    for i, n in enumerate(sizes):
        cache.update_and_fetch(*kv(n, i, batch))
    return cache


@pytest.mark.parametrize("sizes", [[], [1], [3], [9], [2, 1, 1, 1, 1, 1, 1, 1], [5, 3, 1, 4]])
def test_buffered_window_round_trips_and_behaves_the_same(sizes):
    cache = buffered(sizes, batch=2)
    state = from_mlx_vlm(cache)
    assert isinstance(state, ks.BufferedWindowKV)
    back = to_mlx_vlm(state)
    same_fields(back, cache, BUFFERED)
    assert not {id(a) for a in tree_flatten(state)[0]} & {id(cache.keys), id(back.keys)}
    for i, n in enumerate([1, 3, 1, 6, 1, 1]):
        for args in ((n,), (n, None, True)):
            same_mask(back.make_mask(*args), cache.make_mask(*args))
        same_update(back, cache, n, 50 + i)
        same_fields(back, cache, BUFFERED)
        back = to_mlx_vlm(from_mlx_vlm(back))  # through the state at every step
    same(back.state[0], cache.state[0], "state")


@given(
    sizes=st.lists(st.integers(1, 5), max_size=6),
    max_size=st.integers(2, 6),
    buffer_size=st.integers(0, 3),
)
def test_the_buffered_window_strategy_updates_as_mlx_vlm_does(sizes, max_size, buffer_size):
    cache = V.BufferedRotatingKVCache(max_size, buffer_size=buffer_size)
    state = ks.BufferedWindowKV(max_size=max_size, buffer_size=buffer_size, step=cache.step)
    for i, n in enumerate(sizes):
        cache.update_and_fetch(*kv(n, i))
        state = buffered_update(state, *kv(n, i))
    ours = to_mlx_vlm(state)
    assert (ours.offset, ours.start_position) == (cache.offset, cache.start_position)
    for a, b in zip(ours.state, cache.state, strict=True):
        same(a, b, "held entries")


def test_a_buffered_window_whose_counts_disagree_is_refused():
    cache = buffered([3])
    cache.start_position = 1  # _idx 3, but offset - start_position 2
    with pytest.raises(ks.StateError, match="offset - start_position"):
        from_mlx_vlm(cache)


def assert_commit_is_trim(
    state: Any, k: int, data: Any, fields: tuple[str, ...], futures: list[int]
) -> None:
    """A verify forward of `k` tokens, then commit_prefix of a drawn `kept`: mlx-vlm's `trim`
    (its `fields`), and forwards of `futures` tokens attend as after decoding only the kept."""
    batch = ks.batch_size(state)
    verify = to_mlx_vlm(state)
    verify.update_and_fetch(*kv(k, 1, batch))
    verified = record_forward(from_mlx_vlm(verify), state, k)
    kept = data.draw(st.integers(0, k), label="kept")
    committed = to_mlx_vlm(ks.commit_prefix(verified, kept))
    verify.trim(k - kept)
    same_fields(committed, verify, fields)
    direct = to_mlx_vlm(state)
    if kept:
        keys, values = kv(k, 1, batch)
        direct.update_and_fetch(keys[..., :kept, :], values[..., :kept, :])
    for i, n in enumerate(futures):
        np.testing.assert_allclose(
            np.array(attend(committed, n, 7 + i, batch)),
            np.array(attend(direct, n, 7 + i, batch)),
            rtol=1e-5,
            atol=1e-6,
        )


@given(state=buffered_window_kv_states(**SHAPES, appended=0), k=st.integers(1, 6), data=st.data())
def test_buffered_commit_is_mlx_vlm_trim_and_attends_as_decoding_only_the_kept(state, k, data):
    assert_commit_is_trim(state, k, data, BUFFERED, [1, 3, 1])


# ---------------------------------------------------------------------------------------
# StaticPrefixKVCache
# ---------------------------------------------------------------------------------------

STATIC = ("offset", "max_size", "step", "read_only")


def static(sizes: list[int], max_size: int = 6, step: int = 4, batch: int = 1) -> Any:
    cache = V.StaticPrefixKVCache(max_size, step)
    for i, n in enumerate(sizes):
        cache.update_and_fetch(*kv(n, i, batch))
    return cache


@pytest.mark.parametrize("sizes", [[], [2], [6], [4, 3], [2, 1, 1, 9]])
@pytest.mark.parametrize("read_only", [False, True])
def test_static_prefix_round_trips_and_behaves_the_same(sizes, read_only):
    cache = static(sizes, batch=2)
    if read_only:
        cache = V.StaticPrefixKVCache.from_prefix(cache)
    state = from_mlx_vlm(cache)
    assert isinstance(state, ks.StaticPrefixKV) and state.read_only == read_only
    back = to_mlx_vlm(state)
    same_fields(back, cache, STATIC)
    for i, n in enumerate([1, 3, 5]):
        for ours, theirs in zip(back.decoder_state, cache.decoder_state, strict=True):
            same(ours, theirs, "decoder_state")
        same_update(back, cache, n, 50 + i)
        same_fields(back, cache, STATIC)
        back = to_mlx_vlm(from_mlx_vlm(back))


@given(
    state=static_prefix_kv_states(**SHAPES, read_only=False, appended=0),
    k=st.integers(1, 5),
    data=st.data(),
)
def test_static_prefix_commit_is_mlx_vlm_trim_and_attends_as_decoding_only_the_kept(state, k, data):
    assert_commit_is_trim(state, k, data, STATIC, [1, 3])


def test_a_forward_through_a_read_only_prefix_appends_nothing():
    prefix = V.StaticPrefixKVCache.from_prefix(static([3]))
    before = from_mlx_vlm(prefix)
    keys, _ = prefix.update_and_fetch(*kv(2, 9))
    assert keys.shape[2] == 5  # it attended to prefix + block ...
    after = record_forward(from_mlx_vlm(prefix), before, 2)
    assert after.appended == 0 and after.offset == 3  # ... and stored nothing
    assert_states_equal(ks.commit_prefix(after, 0), before)
    with pytest.raises(ks.CommitError):
        ks.commit_prefix(after, 1)  # nothing was appended to keep
