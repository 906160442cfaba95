"""Transforms stay local on a split model: applying a transform to every rank's state and
gathering gives what the transform gives on the single-process state; scatter is the exact
inverse of gather; each rank holds the NumPy slice of heads (or run of layers) mlx-lm gives it.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvstate as ks
from kvstate import distributed
from kvstate.distributed import Placement
from kvstate.testing import (
    accepted_counts,
    assert_states_equal,
    chunked_kv_states,
    dense_kv_states,
    model_states,
    quantized_kv_states,
    rotating_kv_states,
)

RANKS = 2


def _two_head_layer(*, batch: int, appended: int) -> st.SearchStrategy[Any]:
    """A layer of any attention kind with 2 heads: one per rank."""
    return st.one_of(
        dense_kv_states(batch=batch, appended=appended, heads=2),
        rotating_kv_states(batch=batch, appended=appended, heads=2),
        quantized_kv_states(batch=batch, appended=appended, heads=2),
        chunked_kv_states(batch=1, appended=appended, heads=2) if batch == 1 else st.nothing(),
    )


def _placements(data: st.DataObject, layers: int) -> list[Placement]:
    if layers > 1 and data.draw(st.booleans(), label="pipeline"):
        cut = data.draw(st.integers(1, layers - 1), label="cut")
        return [
            Placement("pipeline", 0, RANKS, (cut, layers), layers),  # rank 0: the last layers
            Placement("pipeline", 1, RANKS, (0, cut), layers),
        ]
    return [Placement("tensor", r, RANKS) for r in range(RANKS)]


def _transform(data: st.DataObject, state: Any) -> Any:
    """A transform drawn with its arguments: a function of one state."""
    batch = ks.batch_size(state)
    choice = data.draw(st.sampled_from(["commit", "row_select", "filter", "extract", "tile"]))
    if choice == "commit":
        counts = data.draw(accepted_counts(state))
        return lambda s: ks.commit_prefix(s, counts)
    rows = data.draw(st.lists(st.integers(0, batch - 1), min_size=1, max_size=3, unique=True))
    if choice == "row_select":
        return lambda s: ks.row_select(s, rows)
    if choice == "filter":
        return lambda s: ks.filter(s, rows)
    if choice == "extract":
        return lambda s: ks.extract(s, rows[0])
    n = data.draw(st.integers(1, 2))
    return lambda s: ks.tile(s, n)


@given(st.data())
def test_a_transform_on_every_rank_gathers_to_the_transform_of_the_whole(data):
    state = data.draw(model_states(_two_head_layer))
    placements = _placements(data, len(state.layers))
    parts = distributed.scatter(state, placements)
    assert_states_equal(distributed.gather(parts), state)
    fn = _transform(data, state)
    try:
        expected = fn(state)
    except ks.StateError as e:  # a transform this state refuses: every rank refuses it alike
        for p in parts:
            with pytest.raises(type(e)):
                fn(p)
        return
    assert_states_equal(distributed.gather([fn(p) for p in parts]), expected)


@given(st.data())
def test_each_rank_holds_its_slice_of_heads(data):
    """Against NumPy: rank r's keys are heads [r, r+1) of the whole layer's, for a dense
    layer of 2 heads; and ranks listed in any order gather alike."""
    state = data.draw(
        model_states(lambda **k: dense_kv_states(heads=2, empty=False, dtype=mx.float32, **k))
    )
    parts = distributed.scatter(state, [Placement("tensor", r, RANKS) for r in range(RANKS)])
    for r, part in enumerate(parts):
        for whole, mine in zip(state.layers, part.layers, strict=True):
            np.testing.assert_array_equal(np.array(mine.keys), np.array(whole.keys)[:, r : r + 1])
            np.testing.assert_array_equal(
                np.array(mine.values), np.array(whole.values)[:, r : r + 1]
            )
    assert_states_equal(distributed.gather(parts[::-1]), state)
