"""The speculative package's errors: a well-formed request it cannot serve raises
`NotSupportedError` (a caller can fall back), bad values a plain `StateError`, and every
drafter raises kvstate's errors."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest

import kvstate as ks
from kvstate import kinds
from kvstate.adapters import wrap
from kvstate.adapters.tiny_models import tiny_model
from kvstate.speculative import (
    ModelDrafter,
    NGramDrafter,
    Sampler,
    generate,
    verify_paths,
    verify_tree,
)

PROMPT = [3, 17, 42, 99, 7]


@pytest.fixture(scope="module")
def llama():
    m = wrap(tiny_model("llama"))
    return m, m(mx.array([PROMPT]), m.init_state())[1]


class NoTree:
    """A target without `tree_forward`."""

    def __init__(self, m: Any) -> None:
        self.m = m

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.m(*args, **kwargs)

    def init_state(self, batch_size: int = 1) -> Any:
        return self.m.init_state(batch_size)


def test_what_tree_verification_cannot_do_is_not_supported(llama):
    m, state = llama
    two = ks.tile(state, 2)
    with pytest.raises(ks.NotSupportedError, match="verify_tree: takes a batch-1 state; got 2"):
        verify_tree(m, two, 1, [2], [-1])
    with pytest.raises(ks.NotSupportedError, match="verify_paths: takes a batch-1 state; got 2"):
        verify_paths(m, two, 1, [[2]])
    with pytest.raises(ks.NotSupportedError, match="has no tree_forward"):
        verify_tree(NoTree(m), state, 1, [2], [-1])
    drafter = ModelDrafter(m)
    drafter.start([PROMPT, PROMPT])
    with pytest.raises(ks.NotSupportedError, match="tree drafting takes one row"):
        drafter.propose_tree(1, 2, Sampler())


def test_an_unknown_tree_mode_is_bad_input_not_an_unsupported_request(llama):
    m, _ = llama
    with pytest.raises(ks.StateError, match="tree must be None, 'tree' or 'paths'") as e:
        next(generate(m, [PROMPT], NGramDrafter(), tree="trees"))
    assert not isinstance(e.value, ks.NotSupportedError)


def test_a_kind_without_keep_path_cannot_keep_a_tree_path():
    """The refusal names the kinds that registered `keep_path` (derived, not a list)."""
    with pytest.raises(ks.NotSupportedError, match="a QuantizedKV layer cannot keep a tree") as e:
        kinds.keep_path(ks.QuantizedKV(), (0,), None, None)
    named = str(e.value).split("kinds that can: ")[1].rstrip(")").split(", ")
    assert set(named) == {"DenseKV", "RotatingKV", "RecurrentState"}  # in registration order
    k = mx.zeros((1, 1, 4, 64))
    dense = ks.DenseKV(k, k, length=4, appended=2)
    layers = ks.ModelState((dense, ks.quantize(dense)))  # parts of one pending forward
    with pytest.raises(ks.NotSupportedError, match="QuantizedKV"):
        kinds.keep_path(layers, (0,), None, None)


def test_a_batched_sliding_window_cannot_keep_a_tree_path():
    k = mx.zeros((2, 1, 4, 8))
    lp, offsets = mx.zeros((2,), mx.int32), mx.full((2,), 4, mx.int32)
    window = ks.RotatingKV(k, k, lp, offsets, max_size=8, offset=4, index=4)
    with pytest.raises(ks.NotSupportedError, match="batched sliding window"):
        kinds.keep_path(window, (0,), None, None)
    with pytest.raises(ks.StateError, match="holds nothing"):  # bad input, not unsupported
        kinds.keep_path(ks.RotatingKV(max_size=8), (0,), None, None)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_n": 2, "min_n": 3}, "need 1 <= min_n <= max_n; got 3, 2"),
        ({"min_n": 0}, "need 1 <= min_n <= max_n"),
        ({"branches": 0}, "branches must be >= 1; got 0"),
    ],
)
def test_ngram_drafter_refuses_bad_sizes_with_a_state_error(kwargs, match):
    with pytest.raises(ks.StateError, match=match) as e:
        NGramDrafter(**kwargs)
    assert not isinstance(e.value, ks.NotSupportedError)
