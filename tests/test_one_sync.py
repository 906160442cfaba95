"""A ragged commit of a whole model's DenseKV layers evaluates its moved blocks once, not
once a layer (`kvstate._one_sync`), reads every layer's left padding in one read and
computes the moves once for the layers that share a padding, and gives each layer what a
NumPy reference gives, whether the layers' paddings agree or not."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import kvstate
from kvstate import DenseKV, ModelState

LAYERS, ROWS, HEADS, DIM, CONTEXT, APPENDED = 30, 3, 2, 8, 12, 4
COUNTS = [4, 1, 2]
PADS = [0, 2, 1]
OTHER_PADS = [3, 8, 0]  # row 1 keeps 1 token in all, fewer than its hole of 3


def layer(seed: int, pads: list[int] = PADS) -> DenseKV:
    """A DenseKV after a forward of APPENDED tokens over CONTEXT, rows left-padded by `pads`."""
    mx.random.seed(seed)
    k, v = (mx.random.normal((ROWS, HEADS, CONTEXT + 4, DIM)) for _ in range(2))
    return DenseKV(k, v, left_padding=mx.array(pads), length=CONTEXT, appended=APPENDED)


def layer_pads(mixed: bool) -> list[list[int]]:
    return [OTHER_PADS if mixed and i % 3 == 1 else PADS for i in range(LAYERS)]


@pytest.fixture(params=[False, True], ids=["paddings alike", "paddings differ"])
def model_state(request: pytest.FixtureRequest) -> ModelState:
    return ModelState(layers=tuple(layer(i, p) for i, p in enumerate(layer_pads(request.param))))


def counting_evals(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = mx.eval

    def counted(*arrays: object) -> None:
        calls.append(1)
        real(*arrays)

    monkeypatch.setattr(mx, "eval", counted)
    return calls


def test_a_ragged_commit_of_thirty_layers_evaluates_once(model_state, monkeypatch):
    calls = counting_evals(monkeypatch)
    kvstate.commit_prefix(model_state, COUNTS)
    assert len(calls) == 1


def test_each_row_keeps_its_tokens_and_its_accepted_ones(model_state):
    """NumPy reference: row b's tokens after the commit are its tokens before the forward
    and the first COUNTS[b] of the forward's, as a set of positions (a ragged DenseKV
    commit may move a row's oldest tokens; attention does not depend on key order)."""
    whole = kvstate.commit_prefix(model_state, COUNTS)
    start = CONTEXT - APPENDED
    for got, before in zip(whole.layers, model_state.layers, strict=True):
        pads = np.array(got.left_padding)
        pads_before = np.array(before.left_padding).tolist()
        for b, (pad_before, count) in enumerate(zip(pads_before, COUNTS, strict=True)):
            for name in ("keys", "values"):
                kept = np.array(getattr(before, name))[b, :, pad_before : start + count]
                rows = np.array(getattr(got, name))[b, :, pads[b] : got.length]
                assert rows.shape == kept.shape
                order = lambda a: a[:, np.lexsort(a[0].T[::-1])]  # noqa: E731
                np.testing.assert_array_equal(order(rows), order(kept))


def test_paddings_are_read_once_and_moves_computed_once_a_padding(model_state, monkeypatch):
    from kvstate import _dense

    stacks, moves = [], []
    real_stack, real_moves = mx.stack, _dense._moves
    monkeypatch.setattr(mx, "stack", lambda *a, **k: stacks.append(1) or real_stack(*a, **k))
    monkeypatch.setattr(_dense, "_moves", lambda *a: moves.append(a[0]) or real_moves(*a))
    kvstate.commit_prefix(model_state, COUNTS)
    distinct = {tuple(np.array(s.left_padding).tolist()) for s in model_state.layers}
    assert len(stacks) == 1
    assert sorted(moves) == sorted(distinct)


def test_the_input_state_is_unchanged(model_state):
    before = [(np.array(s.keys), np.array(s.values)) for s in model_state.layers]
    mx.eval(kvstate.tree_flatten(kvstate.commit_prefix(model_state, COUNTS))[0])
    for s, (k, v) in zip(model_state.layers, before, strict=True):
        np.testing.assert_array_equal(np.array(s.keys), k)
        np.testing.assert_array_equal(np.array(s.values), v)


def test_a_failing_commit_evaluates_nothing_and_leaves_no_collector(model_state, monkeypatch):
    from kvstate import _one_sync

    with pytest.raises(RuntimeError), _one_sync.one_sync():
        _one_sync.materialise([mx.zeros(3)])
        raise RuntimeError("inside")
    calls = counting_evals(monkeypatch)
    _one_sync.materialise([mx.zeros(3)])  # no collector left open: evaluated now
    assert len(calls) == 1
