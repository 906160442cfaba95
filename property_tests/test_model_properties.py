"""commit_prefix after a capturing verify == decoding only the accepted prefix, through
`kvstate.adapters.wrap` on tiny random-init models of every recurrent family (and a wrapped forward
never changes the state it was given)."""

from __future__ import annotations

import functools
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvstate as ks
from kvstate.adapters import wrap
from kvstate.adapters.tiny_models import VOCAB, tiny_model

from ._reference import Witness

TOL = {"rtol": 2e-4, "atol": 2e-4}
TOKENS = st.integers(0, VOCAB - 1)


@functools.cache
def wrapped(name: str) -> Any:
    return wrap(tiny_model(name))


def recurrent_arrays(state: Any) -> list[mx.array]:
    out: list[mx.array] = []
    for layer in state.layers:
        for part in layer.states if isinstance(layer, ks.ListState) else (layer,):
            if isinstance(part, ks.RecurrentState):
                out.extend(a for a in part.arrays if a is not None)
    return out


@pytest.mark.parametrize("name", ["mamba2", "qwen3_next", "lfm2", "gemma3_text"])
@given(
    prompts=st.lists(st.lists(TOKENS, min_size=1, max_size=6), min_size=1, max_size=2),
    draft=st.lists(TOKENS, min_size=1, max_size=4),
    follow=TOKENS,
    data=st.data(),
)
def test_capture_commit_equals_decoding_the_prefix(name, prompts, draft, follow, data):
    """Per row: verify the draft (capture=True), keep a[b] tokens == run only those a[b]
    tokens; both then give the same logits for the next token, and the recurrent arrays
    agree."""
    m = wrapped(name)
    witness = Witness()
    rows = [witness.hold(m(mx.array([p]), m.init_state())[1], "prompt") for p in prompts]
    state = witness.hold(ks.merge(rows) if len(rows) > 1 else rows[0], "merged")
    batch = len(prompts)
    tokens = mx.array([draft] * batch)
    _, verified, checkpoints = m(tokens, state, capture=True)
    witness.check()  # the verify forward left its input alone
    accepted = data.draw(
        st.lists(st.integers(0, len(draft)), min_size=batch, max_size=batch), label="accepted"
    )
    committed = ks.commit_prefix(verified, accepted, checkpoints)
    logits, _ = m(mx.array([[follow]] * batch), committed)
    for b, a in enumerate(accepted):
        alone = ks.extract(committed, b)
        direct = rows[b]
        if a:
            _, direct = m(mx.array([draft[:a]]), rows[b])
        expected, _ = m(mx.array([[follow]]), direct)
        np.testing.assert_allclose(np.array(logits[b]), np.array(expected[0]), **TOL)
        for x, y in zip(recurrent_arrays(alone), recurrent_arrays(direct), strict=True):
            np.testing.assert_allclose(
                np.array(x.astype(mx.float32)), np.array(y.astype(mx.float32)), **TOL
            )
    witness.check()
