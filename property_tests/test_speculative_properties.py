"""The speculative generator driven by random drafters, against plain greedy decoding.

A drafter here proposes, per row and round, a random number of drafts (0 included: a plain
step) each right or wrong at random; whatever it does, every row's output must be exactly
mlx-lm's greedy continuation of its prompt, and the target's state must fit the next step.
"""

from __future__ import annotations

from functools import cache
from typing import Any, cast

import mlx.core as mx
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.generate import generate_step

from kvstate.adapters import wrap
from kvstate.adapters.tiny_models import VOCAB, tiny_model
from kvstate.speculative import DraftTree, Proposal, Sampler, generate, tree_of_paths

NEW = 24


@cache
def model(name: str) -> Any:
    return tiny_model(name)


@cache
def truth(name: str, prompt: tuple[int, ...]) -> list[int]:
    steps = generate_step(mx.array(list(prompt)), model(name), max_tokens=NEW + 12)
    return [int(t) for t, _ in steps]


class RandomDrafter:
    """Per row and round: a random count of drafts (0..k), each the true next token with a
    drawn probability, a random token otherwise."""

    def __init__(self, truths: list[list[int]], seed: int, p_right: float) -> None:
        self.truths, self.p = truths, p_right
        self.rng = np.random.default_rng(seed)
        self.rows = list(range(len(truths)))
        self.emitted = [1] * len(truths)

    def start(self, prompts: list[list[int]]) -> None:
        pass

    def propose(self, last: list[int], k: int, sampler: Sampler) -> Proposal:
        drafts, counts = [], []
        for row, at in zip(self.rows, self.emitted, strict=True):
            true = (self.truths[row] + [0] * (k + 1))[at : at + k]
            drafts.append(
                [t if self.rng.random() < self.p else int(self.rng.integers(VOCAB)) for t in true]
            )
            counts.append(int(self.rng.integers(0, k + 1)))
        return Proposal(mx.array(drafts, mx.int32), counts, None)

    def accept(self, fed: mx.array, kept: list[int]) -> None:
        self.emitted = [e + n for e, n in zip(self.emitted, kept, strict=True)]

    def keep_rows(self, rows: list[int]) -> None:
        self.rows = [self.rows[i] for i in rows]
        self.emitted = [self.emitted[i] for i in rows]


@settings(max_examples=12)
@given(
    name=st.sampled_from(["llama", "qwen3_next", "gemma3_text"]),
    prompts=st.lists(
        st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=9), min_size=1, max_size=3
    ),
    k=st.integers(1, 6),
    p_right=st.sampled_from([0.0, 0.5, 0.9, 1.0]),
    seed=st.integers(0, 2**16),
    adaptive=st.booleans(),
)
def test_random_drafters_never_change_the_greedy_output(name, prompts, k, p_right, seed, adaptive):
    truths = [truth(name, tuple(p)) for p in prompts]
    drafter = RandomDrafter(truths, seed, p_right)
    out: list[list[int]] = [[] for _ in prompts]
    for tokens in generate(
        wrap(model(name)), prompts, drafter, k=k, max_tokens=NEW, adaptive=adaptive
    ):
        for t in tokens:
            out[t.row].append(t.token)
    assert out == [t[:NEW] for t in truths]


class RandomTreeDrafter:
    """Per round: a random tree of up to 4 candidate paths of random depths (1..k), each draft
    the true next token with a drawn probability, a random token otherwise; sometimes no tree
    at all (a plain step)."""

    def __init__(self, truth: list[int], seed: int, p_right: float) -> None:
        self.truth, self.p = truth, p_right
        self.rng = np.random.default_rng(seed)
        self.emitted = 1
        self.paths: list[list[int]] = []

    def start(self, prompts: list[list[int]]) -> None:
        pass

    def propose_tree(self, last: int, k: int, sampler: Sampler) -> DraftTree:
        true = (self.truth + [0] * (k + 1))[self.emitted : self.emitted + k]
        paths = [
            [t if self.rng.random() < self.p else int(self.rng.integers(VOCAB)) for t in true][
                : int(self.rng.integers(1, k + 1))
            ]
            for _ in range(int(self.rng.integers(0, 5)))
        ]
        self.paths = paths
        return DraftTree(*tree_of_paths(paths))

    def accept(self, fed: mx.array, kept: list[int]) -> None:
        # Told a proposed path (none after a plain step) whose kept prefix is the last token
        # and the accepted truth.
        row = cast(list[list[int]], fed.tolist())[0]
        # a candidate path, or a prefix of one (the drafting policy may verify a subtree)
        assert any(p[: len(row) - 1] == row[1:] for p in self.paths) or kept == [1]
        assert row[: kept[0]] == self.truth[self.emitted - 1 : self.emitted - 1 + kept[0]]
        self.emitted += kept[0]

    def keep_rows(self, rows: list[int]) -> None:
        pass


@settings(max_examples=12)
@given(
    name=st.sampled_from(["llama", "qwen3_next", "gemma3_text", "mamba2"]),
    prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=9),
    mode=st.sampled_from(["tree", "paths"]),
    k=st.integers(1, 6),
    p_right=st.sampled_from([0.0, 0.5, 0.9, 1.0]),
    seed=st.integers(0, 2**16),
)
def test_random_tree_drafters_never_change_the_greedy_output(name, prompt, mode, k, p_right, seed):
    want = truth(name, tuple(prompt))
    drafter = RandomTreeDrafter(want, seed, p_right)
    rounds = generate(wrap(model(name)), [prompt], drafter, k=k, max_tokens=NEW, tree=mode)
    assert [t.token for r in rounds for t in r] == want[:NEW]
