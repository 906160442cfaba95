"""A state's constructor checks what it built; the library's own constructions do not.

Constructing a state whose fields disagree raises `kvstate.ShapeError` naming them, without a
host sync (shapes, dtypes and statics only; `kvstate.check` reads the values too), as
equinox's `__check_init__` does. The transforms build their results with
`kvstate.kinds.trusted(cls)(...)` / `kinds.replace`, which skip the check: their fields agree
by construction and the decode step pays nothing for it. (Per-kind properties:
property_tests/test_construction_properties.py; each kind's messages: tests/test_check.py.)
"""

from __future__ import annotations

import contextlib
import inspect
import tempfile
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvstate as ks
from kvstate import kinds
from kvstate.testing import STRATEGIES, accepted_counts, recurrent_checkpoints

K2 = mx.zeros((2, 1, 4, 8))
LIBRARY_KINDS = [k for k in kinds.kinds() if k.__module__.startswith("kvstate.")]


def refused(build: Any, *named: str) -> str:
    with pytest.raises(ks.ShapeError) as info:
        build()
    message = str(info.value)
    for text in named:
        assert text in message, message
    return message


def test_keys_and_values_of_different_batches_are_refused_naming_both():
    """The review's example: it used to build, and merge then failed inside MLX."""
    refused(
        lambda: ks.DenseKV(K2, mx.zeros((3, 1, 4, 8)), None, 4),
        "keys (2, 1, 4, 8) and values (3, 1, 4, 8) disagree in batch",
    )


def test_left_padding_of_more_rows_than_the_keys_is_refused():
    """It used to build, and extract(s, 2) returned a state of 0 rows."""
    padding = mx.zeros((3,), mx.int32)
    refused(lambda: ks.DenseKV(K2, K2, padding, 4), "left_padding: has 3 rows, but keys has 2")
    quantized = ks.quantize(ks.DenseKV(mx.zeros((2, 1, 4, 64)), mx.zeros((2, 1, 4, 64)), None, 4))
    refused(
        lambda: ks.QuantizedKV(quantized.keys, quantized.values, padding, 4),
        "left_padding: has 3 rows, but keys has 2",
    )


def test_no_transform_ever_sees_a_hand_built_state_whose_fields_disagree():
    """row_select, extract, tile, filter, merge and extend used to take such a state (and
    return a consistent-looking one, or fail inside MLX): its constructor refuses it now."""
    transforms = [
        lambda s: ks.row_select(s, [1]),
        lambda s: ks.extract(s, 2),
        lambda s: ks.tile(s, 2),
        lambda s: ks.filter(s, [0]),
        lambda s: ks.merge([s, s]),
        lambda s: ks.extend(s, s),
    ]
    for transform in transforms:
        refused(lambda: transform(ks.DenseKV(K2, K2, mx.zeros((3,), mx.int32), 4)), "left_padding")  # noqa: B023


def test_the_check_reads_no_values():
    """Left padding past the length needs the values: the constructor leaves it to check."""
    state = ks.DenseKV(K2, K2, mx.array([0, 9], mx.int32), 4)
    refused(lambda: ks.check(state), r"left_padding: entries [9]")


def test_trusted_is_the_constructor_without_the_check():
    for kind in LIBRARY_KINDS:
        build = kinds.trusted(kind)
        same = inspect.signature(build).parameters == inspect.signature(kind).parameters
        assert same, kind.__name__
    made = kinds.trusted(ks.DenseKV)(K2, K2, None, 4, appended=1)
    assert type(made) is ks.DenseKV and (made.length, made.appended, made.simple) == (4, 1, False)
    ks.check(made)
    bad = kinds.trusted(ks.DenseKV)(K2, mx.zeros((3, 1, 4, 8)), None, 4)  # not checked
    assert bad.values.shape[0] == 3
    assert kinds.replace(made, length=40).length == 40  # replace is trusted too
    refused(lambda: ks.check(bad), "disagree in batch")


def _raise_if_checked(state: Any) -> None:
    raise AssertionError(
        f"a transform built a {type(state).__name__} through its checking constructor"
    )


LAYER_KINDS = [k for k in kinds.layer_kinds() if k.__module__.startswith("kvstate.")]


@pytest.mark.parametrize("kind", LAYER_KINDS, ids=lambda k: k.__name__)
def test_the_transforms_build_through_the_trusted_path(kind):
    """Every transform's result is built with `kinds.trusted` / `replace`: none runs a
    constructor's check (which the decode step and commit_prefix would pay for). Each
    transform runs on a layer of `kind` and on a ModelState of two, every commit count
    the state takes (uniform, ragged, none) included."""

    @settings(max_examples=15, deadline=None)
    @given(st.data())
    def run(data: Any) -> None:
        layer = data.draw(STRATEGIES[kind](batch=2, appended=data.draw(st.integers(1, 3))))
        for state in (layer, ks.ModelState((layer, layer))):
            with pytest.MonkeyPatch.context() as patch:
                for cls in LIBRARY_KINDS:
                    patch.setattr(cls, "__attrs_post_init__", _raise_if_checked)
                with pytest.raises(AssertionError, match="checking constructor"):
                    ks.ModelState(())  # the patch is in place
                for work in _transforms(state, data):
                    # A refusal of this state (an empty window cannot merge, ...) is fine.
                    with contextlib.suppress(ks.StateError):
                        ks.eval(work())

    run()


def _transforms(state: Any, data: Any) -> list[Any]:
    """Every public transform on `state`, as thunks (counts and checkpoints drawn first)."""
    checkpoints = None
    if isinstance(state, ks.RecurrentState):
        checkpoints = data.draw(recurrent_checkpoints(state))
    elif isinstance(state, ks.ModelState) and isinstance(state.layers[0], ks.RecurrentState):
        one = data.draw(recurrent_checkpoints(state.layers[0]))
        checkpoints = (one, one)
    n = kinds.appended_of(state)
    counts = [data.draw(accepted_counts(state, ragged=r)) for r in (False, True)]
    commits = [
        lambda c=c: ks.commit_prefix(state, c, checkpoints)
        for c in (n, 0, *counts)  # type: ignore[misc]
    ]
    return [
        *commits,
        lambda: ks.tile(state, 2),
        lambda: ks.row_select(state, [1, 0]),
        lambda: ks.filter(state, [1]),
        lambda: ks.extract(state, 1),
        lambda: ks.merge([state, state]),
        lambda: ks.extend(state, state),
        lambda: ks.tree_map(lambda a: a, state),
        lambda: ks.tree_unflatten(*reversed(ks.tree_flatten(state))),
        lambda: _saved_and_loaded(state),
    ]


def _saved_and_loaded(state: Any) -> Any:
    with tempfile.TemporaryDirectory() as tmp:
        ks.save(Path(tmp) / "s.safetensors", state)
        return ks.load(Path(tmp) / "s.safetensors")
