"""The sampler's filters keep exactly the tokens they promise: top_k the k largest logits,
top_p the smallest set of most likely tokens whose mass reaches top_p, the token that
crosses it included (kills the review's surviving mutants: top_k keeping k + 1, top_p
dropping the crossing token)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kvstate.speculative import Sampler

LOGITS = mx.log(mx.array([[0.05, 0.4, 0.1, 0.25, 0.2], [0.3, 0.1, 0.2, 0.15, 0.25]]))


def kept(sampler: Sampler) -> list[list[int]]:
    probs = np.array(sampler.probs(LOGITS))
    np.testing.assert_allclose(probs.sum(-1), 1, rtol=1e-6)
    return [sorted(np.flatnonzero(row).tolist()) for row in probs]


@pytest.mark.parametrize(
    ("k", "want"),
    [(1, [[1], [0]]), (2, [[1, 3], [0, 4]]), (4, [[1, 2, 3, 4], [0, 2, 3, 4]]), (5, None)],
)
def test_top_k_keeps_the_k_largest(k, want):
    got = kept(Sampler(temperature=1.0, top_k=k))
    assert got == (want or [[0, 1, 2, 3, 4]] * 2)


def test_top_k_renormalises_the_kept_tokens():
    probs = np.array(Sampler(temperature=1.0, top_k=2).probs(LOGITS))
    np.testing.assert_allclose(probs[0, [1, 3]], [0.4 / 0.65, 0.25 / 0.65], rtol=1e-5)


@pytest.mark.parametrize(
    ("top_p", "want"),
    [
        # Cumulative mass, most likely first: row 0 0.4, 0.65, 0.85, 0.95; row 1 0.3, 0.55,
        # 0.75, 0.9 (thresholds away from them: no tie with rounding).
        (0.35, [[1], [0, 4]]),  # row 0's first token crosses 0.35; row 1's second does
        (0.5, [[1, 3], [0, 4]]),
        (0.6, [[1, 3], [0, 2, 4]]),
        (0.92, [[1, 2, 3, 4], [0, 1, 2, 3, 4]]),
    ],
)
def test_top_p_keeps_the_token_that_crosses_the_threshold(top_p, want):
    assert kept(Sampler(temperature=1.0, top_p=top_p)) == want


def test_top_p_renormalises_the_kept_tokens():
    probs = np.array(Sampler(temperature=1.0, top_p=0.5).probs(LOGITS))
    np.testing.assert_allclose(probs[0, [1, 3]], [0.4 / 0.65, 0.25 / 0.65], rtol=1e-5)
