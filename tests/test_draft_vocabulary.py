"""A draft distribution over another vocabulary than the target's (a draft model with a
padded or a smaller vocabulary) keeps speculative sampling exact: draft ids the target lacks
have target probability 0 and are rejected, and the residual is p - q over the target's ids.

40000 rows verify 1 draft drawn from q against a fixed target distribution p; the first
emitted token (the draft if accepted, else the residual's draw) must follow p: Pearson's
chi-square at significance 1e-4, a token of p = 0 never emitted."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kvstate.speculative import Sampler, accept

from .stats import chi2_sf

VOCAB, ROWS = 6, 40000


def first_tokens(p: np.ndarray, q: np.ndarray, seed: int) -> np.ndarray:
    """Row by row: the draft if accepted, else the next token."""
    rng = np.random.default_rng(seed)
    drafts = rng.choice(q.size, size=(ROWS, 1), p=q / q.sum())
    target = mx.broadcast_to(mx.array(p, mx.float32)[None, None], (ROWS, 2, p.size))
    draft_probs = mx.broadcast_to(mx.array(q, mx.float32)[None, None], (ROWS, 1, q.size))
    verdict = accept(
        target, mx.array(drafts, mx.int32), draft_probs, [1] * ROWS, Sampler(temperature=1.0),
        mx.random.key(seed),
    )  # fmt: skip
    accepted = np.array(verdict.accepted)
    return np.where(accepted == 1, drafts[:, 0], np.array(verdict.next_tokens))


def assert_distributed_as(tokens: np.ndarray, p: np.ndarray) -> None:
    counts = np.bincount(tokens, minlength=p.size)
    assert counts.size == p.size and counts[p == 0].sum() == 0, counts
    expected = p * tokens.size
    seen = expected > 0
    statistic = float((((counts - expected) ** 2)[seen] / expected[seen]).sum())
    assert chi2_sf(statistic, int(seen.sum()) - 1) > 1e-4, (counts, expected)


P = np.array([0.3, 0.25, 0.2, 0.1, 0.1, 0.05])


@pytest.mark.parametrize("seed", [0, 1])
def test_a_wider_draft_vocabulary_is_exact(seed):
    """q puts 30% of its mass on 3 ids past the target's 6: those drafts are rejected."""
    q = np.array([0.05, 0.05, 0.2, 0.2, 0.1, 0.1, 0.1, 0.1, 0.1])
    tokens = first_tokens(P, q, seed)
    assert_distributed_as(tokens, P)


@pytest.mark.parametrize("seed", [0, 1])
def test_a_narrower_draft_vocabulary_is_exact(seed):
    """q covers the target's first 4 ids: the others come from the residual only."""
    q = np.array([0.1, 0.2, 0.3, 0.4])
    tokens = first_tokens(P, q, seed)
    assert_distributed_as(tokens, P)
