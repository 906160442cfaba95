"""An empty state (nothing written yet) still has rows: tile and row_select keep count of
them for every kind that can be empty, TurboQuantKV included (kills the review's surviving
mutant: `tile` of an empty TurboQuantKV losing its row count)."""

from __future__ import annotations

import mlx.core as mx
import pytest

import kvstate as ks
from kvstate import kinds


def empty_kinds() -> list[type]:
    """Every registered layer kind whose default construction is an empty state."""
    found = []
    for cls in kinds.layer_kinds():
        try:
            state = cls()
        except (TypeError, ks.StateError):  # a kind that needs its configuration
            continue
        if not ks.tree_flatten(state)[0]:  # holds no arrays: empty
            found.append(cls)
    return found


def test_the_kinds_that_can_be_empty_include_turboquant():
    assert ks.TurboQuantKV in empty_kinds() and ks.DenseKV in empty_kinds()


@pytest.mark.parametrize("cls", empty_kinds(), ids=lambda c: c.__name__)
def test_tile_and_row_select_of_an_empty_state_keep_its_rows(cls):
    """Or refuse (NotSupportedError: a kind that keeps no rows while empty), never lose them."""
    empty = cls()
    assert ks.batch_size(empty) == 1
    try:
        three = ks.tile(empty, 3)
    except ks.NotSupportedError as e:
        assert "empty" in str(e)
        return
    assert ks.batch_size(three) == 3
    assert ks.batch_size(ks.tile(three, 2)) == 6
    assert ks.batch_size(ks.row_select(three, [2, 0])) == 2
    assert ks.batch_size(ks.row_select(three, 1)) == 1


def test_an_empty_turboquant_state_of_two_rows_tiles_to_six():
    empty = ks.TurboQuantKV(left_padding=mx.array([0, 1], mx.int32))
    tiled = ks.tile(empty, 3)
    assert ks.batch_size(tiled) == 6
    assert tiled.left_padding.tolist() == [0, 0, 0, 1, 1, 1]
