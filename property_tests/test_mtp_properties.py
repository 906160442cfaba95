"""MTPDrafter under random batches, draft lengths and heads, against plain greedy decoding.

The head is either a random-init `MTPHead` (its drafts almost never right) or a close copy of
the target used as a head (often right, so rows accept different counts and the head's
state takes ragged commits); whatever it drafts, every row's output must be mlx-lm's greedy
continuation of its prompt.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import mlx.core as mx
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.generate import generate_step

from kvstate.adapters import MTPHead, wrap
from kvstate.adapters.tiny_models import VOCAB, tiny_model
from kvstate.speculative import MTPDrafter, generate

NEW = 16


@cache
def model(name: str, scale: float = 4.0) -> Any:
    return tiny_model(name, scale=scale)


@cache
def truth(name: str, prompt: tuple[int, ...]) -> list[int]:
    steps = generate_step(mx.array(list(prompt)), model(name), max_tokens=NEW)
    return [int(t) for t, _ in steps]


class CloseHead:
    """A copy of the target with its weights scaled a little differently, as a head (it
    ignores the hidden states)."""

    def __init__(self, name: str) -> None:
        self.model = wrap(model(name, 3.9))

    def init_state(self, batch_size: int = 1) -> Any:
        return self.model.init_state(batch_size)

    def __call__(self, hidden: Any, tokens: Any, state: Any, *, capture: bool = False) -> Any:
        out = self.model(tokens, state, capture=capture, hidden=True)
        return (out[0], out[-1], *out[1:-1])


@settings(max_examples=12)
@given(
    name=st.sampled_from(["llama", "qwen3_next"]),
    prompts=st.lists(
        st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6), min_size=1, max_size=3
    ),
    k=st.integers(1, 5),
    close=st.booleans(),
    adaptive=st.booleans(),
)
def test_any_head_any_batch_gives_greedy_output(name, prompts, k, close, adaptive):
    head = CloseHead(name) if close else MTPHead(model(name))
    out: list[list[int]] = [[] for _ in prompts]
    rounds = generate(
        wrap(model(name)), prompts, MTPDrafter(head), k=k, max_tokens=NEW, adaptive=adaptive
    )
    for tokens in rounds:
        for t in tokens:
            out[t.row].append(t.token)
    assert out == [truth(name, tuple(p)) for p in prompts]
