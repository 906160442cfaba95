"""The exact tests of tests/stats.py against scipy's (where installed), and against cases
worked by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from .stats import binomial_test, chi2_sf, collisions, conditional_chi2, normal_sf


def test_by_hand():
    assert binomial_test(5, 10, 0.5) == 1.0
    assert math.isclose(binomial_test(0, 10, 0.5), 2 * 0.5**10)
    assert math.isclose(chi2_sf(2.0, 2), math.exp(-1.0))  # df 2: exp(-x / 2)
    assert math.isclose(normal_sf(0.0), 0.5)
    # Two first tokens, each followed by a fair coin: 20 draws exactly at the mean.
    p2 = np.array([[0.5, 0.5], [0.5, 0.5]])
    statistic, df = conditional_chi2([(0, 0)] * 10 + [(0, 1)] * 10, p2)
    assert (statistic, df) == (0.0, 1)


def test_against_scipy():
    stats = pytest.importorskip("scipy.stats")
    for k, n, p in [(5, 4000, 0.005), (30, 600, 0.05), (449, 4000, 0.1123), (60, 4000, 0.0388)]:
        doubled = min(1.0, 2 * min(stats.binom.cdf(k, n, p), stats.binom.sf(k - 1, n, p)))
        assert math.isclose(binomial_test(k, n, p), doubled, rel_tol=1e-9)
    for x, df in [(229.0, 115), (96.0, 115), (0.5, 4), (50.0, 10), (13.82, 2), (6746.0, 129)]:
        assert math.isclose(chi2_sf(x, df), stats.chi2.sf(x, df), rel_tol=1e-9, abs_tol=1e-300)


def test_collisions_see_a_repeated_draw():
    """Rows that draw the same second token in every generation: far too many equal pairs."""
    p2 = np.full((2, 4), 0.25)
    rng = np.random.default_rng(0)
    fresh = [(row, 0, int(rng.integers(4))) for _ in range(50) for row in range(10)]
    repeated = [(row, 0, row % 4) for _ in range(50) for row in range(10)]
    assert collisions(fresh, p2) > 1e-3
    assert collisions(repeated, p2) < 1e-12
