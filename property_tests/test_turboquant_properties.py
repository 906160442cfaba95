"""TurboQuantKV's row transforms against mlx-vlm's BatchTurboQuantKVCache on drawn states.

Each drawn state becomes mlx-vlm's batch cache (`to_mlx_vlm`); mlx-vlm's own filter /
extend / extract / trim run on that cache and must equal kvstate's filter / extend / extract
/ commit_prefix, array for array over the used positions, with the same left padding,
offsets and `_idx`.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("mlx_vlm")

import mlx.core as mx
from mlx_vlm import turboquant as tq

import kvstate as ks
from kvstate.adapters.vlm import to_mlx_vlm
from kvstate.testing import accepted_counts, turboquant_kv_states
from property_tests._reference import meaning

MSE = {"heads": 2, "key_dim": 12, "value_dim": 16, "key_bits": 3, "value_bits": 2, "seed": 1}
# mlx-vlm's Split layout on both sides (12 channels at 2.5 bits: 6 high; 16 at 3.5: 8 high),
# one set of channels so drawn states can be batched together.
SPLIT = MSE | {"key_bits": 2.5, "value_bits": 3.5}
SPLIT |= {"key_channels": (0, 2, 3, 7, 9, 11), "value_channels": (1, 2, 4, 8, 9, 10, 13, 15)}
CONFIGS = pytest.mark.parametrize("config", [MSE, SPLIT], ids=["mse", "split"])


def leaves(held: Any) -> list[mx.array]:
    """One side's arrays as mlx-vlm holds it (an MSE state, or a Split state of two)."""
    if isinstance(held, tq.TurboQuantSplitState):
        return leaves(held.low) + leaves(held.high)
    return [held.norms, held.indices]


def batch(state: ks.TurboQuantKV) -> tq.BatchTurboQuantKVCache:
    if state.left_padding is None:  # the batch cache always has left padding
        state = ks.kinds.replace(state, left_padding=mx.zeros((ks.batch_size(state),), mx.int32))
    cache = to_mlx_vlm(state)
    assert type(cache) is tq.BatchTurboQuantKVCache
    return cache


def fields(cache: tq.BatchTurboQuantKVCache) -> list[Any]:
    n = cache._idx
    used = [a[:, :, :n] for a in leaves(cache.keys) + leaves(cache.values)]
    return [*used, cache.left_padding, cache.offset]


def assert_same_cache(got: tq.BatchTurboQuantKVCache, want: tq.BatchTurboQuantKVCache) -> None:
    assert got._idx == want._idx
    for a, b in zip(fields(got), fields(want), strict=True):
        assert a.shape == b.shape and mx.array_equal(a, b).item(), (a, b)


@CONFIGS
@given(data=st.data())
def test_filter_equals_mlx_vlms(config, data):
    state = data.draw(turboquant_kv_states(**config, empty=False), label="state")
    rows = data.draw(st.lists(st.integers(0, ks.batch_size(state) - 1), min_size=1, max_size=3))
    theirs = copy.deepcopy(batch(state))
    theirs.filter(mx.array(rows))
    assert_same_cache(batch(ks.filter(state, rows)), theirs)


@CONFIGS
@given(data=st.data())
def test_extend_equals_mlx_vlms(config, data):
    a, b = (data.draw(turboquant_kv_states(**config, empty=False), label=x) for x in "ab")
    a, b = ks.kinds.replace(a, appended=0), ks.kinds.replace(b, appended=0)
    theirs = copy.deepcopy(batch(a))
    theirs.extend(batch(b))
    assert_same_cache(batch(ks.extend(a, b)), theirs)


@CONFIGS
@given(data=st.data())
def test_extract_equals_mlx_vlms(config, data):
    state = data.draw(turboquant_kv_states(**config, empty=False), label="state")
    row = data.draw(st.integers(0, ks.batch_size(state) - 1))
    theirs = batch(state).extract(row)
    ours = to_mlx_vlm(ks.extract(state, row))
    assert type(ours) is tq.TurboQuantKVCache and ours.offset == theirs.offset
    for x, y in zip(
        leaves(ours.state[0]) + leaves(ours.state[1]),
        leaves(theirs.state[0]) + leaves(theirs.state[1]),
        strict=True,
    ):
        assert mx.array_equal(x, y).item()


@CONFIGS
@given(data=st.data())
def test_uniform_commit_equals_trim(config, data):
    state = data.draw(turboquant_kv_states(**config, empty=False), label="state")
    keep = data.draw(st.integers(0, state.appended))
    theirs = batch(state)
    theirs.trim(state.appended - keep)
    assert_same_cache(batch(ks.commit_prefix(state, keep)), theirs)


def _tokens(row: tuple[Any, ...]) -> np.ndarray:
    """A `meaning` row's tokens as a sorted (T, H * columns) int64 matrix: a multiset."""
    if row[1] == 0:
        return np.zeros((0, 0), np.int64)
    per_head = np.concatenate([a.astype(np.int64) for a in row[2:]], axis=-1)  # (H, T, X)
    tokens = per_head.transpose(1, 0, 2).reshape(per_head.shape[1], -1)
    return tokens[np.lexsort(tokens.T[::-1])]


@CONFIGS
@given(data=st.data())
def test_ragged_commit_keeps_each_rows_prefix(config, data):
    state = data.draw(turboquant_kv_states(**config, empty=False), label="state")
    """mlx-vlm's caches have no ragged commit: the reference is each row's tokens before the
    pending ones plus its first accepted[b] pending ones (a multiset: they may move)."""
    accepted = data.draw(accepted_counts(state, ragged=True), label="accepted")
    counts = [accepted] * ks.batch_size(state) if isinstance(accepted, int) else accepted
    committed = ks.commit_prefix(state, accepted)
    rows = meaning(state, history=False)
    for b, (row, c) in enumerate(zip(meaning(committed, history=False), counts, strict=True)):
        held = rows[b][1] - state.appended  # row b's tokens before the pending ones
        expected = ("turboquant", held + c, *(a[:, : held + c] for a in rows[b][2:]))
        assert row[1] == held + c, f"row {b}: length {row[1]}, expected {held + c}"
        assert np.array_equal(_tokens(row), _tokens(expected))
    assert committed.length - state.length == max(counts) - state.appended
