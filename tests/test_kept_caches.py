"""A wrapped model runs a plain forward from the state its last plain forward returned on
that forward's own cache objects (adapters/_kept.py). Oracle: mlx-lm's model on its own
caches over the same history; the tests branch, fail midway and drop states to show the
kept caches are used only when they hold exactly the state passed in."""

from __future__ import annotations

import gc

import mlx.core as mx
import numpy as np
import pytest

import kvstate as ks
from kvstate.adapters import wrap
from kvstate.adapters.tiny_models import tiny_model

from .helpers import raw_logits

ARCHITECTURES = ["llama", "gemma3_text", "qwen3_next", "mamba2"]  # dense, window, hybrids
PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]  # longer than gemma3_text's window of 8


def _expected(model: object, history: list[int], last: int) -> np.ndarray:
    """mlx-lm's logits for `last` after `history`, on its own caches."""
    return raw_logits(model, [*history, last], [len(history), 1])[1]


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_branches_from_a_kept_state_follow_their_own_history(name: str) -> None:
    model = tiny_model(name)
    m = wrap(model)
    _, state = m(mx.array([PROMPT]), m.init_state())
    _, s1 = m(mx.array([[7]]), state)  # s1's caches are kept
    history = [*PROMPT, 7]
    # The first branch runs on s1's kept caches, the others convert s1 (its caches have
    # moved on): each must see s1's history only, whatever ran before it.
    for token in (11, 23, 11):
        logits, _ = m(mx.array([[token]]), s1)
        np.testing.assert_allclose(
            np.array(logits), _expected(model, history, token), rtol=1e-4, atol=1e-4
        )


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_a_long_decode_on_kept_caches_equals_mlx_lm(name: str) -> None:
    model = tiny_model(name)
    m = wrap(model)
    tokens = [*PROMPT, *range(40, 60)]  # gemma3_text's window wraps several times
    logits, state = m(mx.array([PROMPT]), m.init_state())
    refs = raw_logits(model, tokens, [len(PROMPT)] + [1] * 20)
    for t, ref in zip(tokens[len(PROMPT) :], refs[1:], strict=True):
        logits, state = m(mx.array([[t]]), state)
        np.testing.assert_allclose(np.array(logits), ref, rtol=1e-4, atol=1e-4)


def test_a_forward_that_fails_midway_leaves_nothing_half_updated() -> None:
    model = tiny_model("llama")
    m = wrap(model)
    _, state = m(mx.array([PROMPT]), m.init_state())
    _, s1 = m(mx.array([[7]]), state)
    layer = model.model.layers[2]
    original = type(layer)

    class Failing(original):  # type: ignore[valid-type, misc]
        def __call__(self, *args: object, **kwargs: object) -> None:
            raise RuntimeError("injected")  # after layers 0-1 appended to their caches

    layer.__class__ = Failing
    try:
        with pytest.raises(RuntimeError, match="injected"):
            m(mx.array([[9]]), s1)
    finally:
        layer.__class__ = original
    logits, _ = m(mx.array([[9]]), s1)
    np.testing.assert_allclose(
        np.array(logits), _expected(model, [*PROMPT, 7], 9), rtol=1e-4, atol=1e-4
    )


def test_derived_states_and_captures_convert_as_before() -> None:
    model = tiny_model("qwen3_next")
    m = wrap(model)
    _, state = m(mx.array([PROMPT]), m.init_state())
    _, verified, checkpoints = m(mx.array([[7, 8, 9]]), state, capture=True)
    committed = ks.commit_prefix(verified, 2, checkpoints)  # keeps 7, 8
    logits, _ = m(mx.array([[5]]), committed)
    np.testing.assert_allclose(
        np.array(logits), _expected(model, [*PROMPT, 7, 8], 5), rtol=1e-4, atol=1e-4
    )


def test_kept_caches_go_with_the_state_they_hold() -> None:
    m = wrap(tiny_model("llama"))
    _, state = m(mx.array([PROMPT]), m.init_state())
    assert m.kept.take(state) is not None  # the prompt forward's caches were kept
    _, state = m(mx.array([[7]]), state)
    del state
    gc.collect()
    assert m.kept.take(None) is None and m.kept._caches is None  # nothing holds the KV now
