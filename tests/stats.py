"""Exact tests of sampled tokens against a known distribution, in plain Python (no scipy):
the two-sided exact binomial test, Pearson's chi-square with its exact tail (the regularised
upper incomplete gamma function), and a collision count against its exact null mean and
variance. Each returns a p-value; a correct sampler fails a test at significance a with
probability a."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence

import numpy as np


def binomial_test(successes: int, n: int, rate: float) -> float:
    """Two-sided exact binomial p-value of `successes` in `n` draws of probability `rate`
    (twice the smaller tail, at most 1)."""
    logs = [_log_pmf(i, n, rate) for i in range(n + 1)]
    lower = _log_sum(logs[: successes + 1])
    upper = _log_sum(logs[successes:])
    return min(1.0, 2 * math.exp(min(lower, upper)))


def _log_pmf(i: int, n: int, p: float) -> float:
    if p in (0.0, 1.0):
        return 0.0 if i == n * p else -math.inf
    log_choose = math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1)
    return log_choose + i * math.log(p) + (n - i) * math.log1p(-p)


def _log_sum(logs: Sequence[float]) -> float:
    top = max(logs)
    if top == -math.inf:
        return top
    return top + math.log(sum(math.exp(v - top) for v in logs))


def chi2_sf(statistic: float, df: int) -> float:
    """P(X >= statistic) for X chi-square with `df` degrees of freedom."""
    return _upper_gamma(df / 2, statistic / 2)


def _upper_gamma(a: float, x: float) -> float:
    """The regularised upper incomplete gamma function Q(a, x) (Numerical Recipes: the series
    below a + 1, Lentz's continued fraction above)."""
    if x <= 0:
        return 1.0
    scale = math.exp(-x + a * math.log(x) - math.lgamma(a))
    if x < a + 1:
        term = total = 1 / a
        k = a
        while abs(term) > abs(total) * 1e-15:
            k += 1
            term *= x / k
            total += term
        return max(0.0, 1 - total * scale)
    tiny = 1e-300
    b = x + 1 - a
    c, d = 1 / tiny, 1 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        h *= d * c
        if abs(d * c - 1) < 1e-15:
            break
    return h * scale


def normal_sf(z: float) -> float:
    """P(Z >= z) for a standard normal Z."""
    return 0.5 * math.erfc(z / math.sqrt(2))


def conditional_chi2(pairs: Iterable[tuple[int, int]], p2: np.ndarray) -> tuple[float, int]:
    """Pearson's chi-square of second tokens given first tokens against `p2[x]` (the
    distribution after first token x), summed over the first tokens; cells expected below 5
    are pooled per first token. Returns (statistic, degrees of freedom)."""
    groups: dict[int, list[int]] = defaultdict(list)
    for x, y in pairs:
        groups[x].append(y)
    statistic, df = 0.0, 0
    for x, ys in groups.items():
        observed = np.bincount(ys, minlength=p2.shape[1]).astype(float)
        expected = len(ys) * p2[x]
        big = expected >= 5
        o, e = list(observed[big]), list(expected[big])
        if expected[~big].sum() > 0:
            o.append(observed[~big].sum())
            e.append(expected[~big].sum())
        if len(e) < 2:
            continue
        statistic += float(sum((a - b) ** 2 / b for a, b in zip(o, e, strict=True)))
        df += len(e) - 1
    return statistic, df


def collisions(keyed: Iterable[tuple[object, int, int]], p2: np.ndarray) -> float:
    """One-sided p-value of too many equal second tokens among draws that share a key (a row
    index across calls) and a first token x: independent draws from p2[x] make
    sum_groups C(m, 2) * sum_y p2[x, y]^2 such pairs on average (exact mean and variance of
    the pair count; a normal tail)."""
    groups: dict[tuple[object, int], list[int]] = defaultdict(list)
    for key, x, y in keyed:
        groups[key, x].append(y)
    observed = mean = var = 0.0
    for (_, x), ys in groups.items():
        m = len(ys)
        if m < 2:
            continue
        counts = np.bincount(ys, minlength=p2.shape[1])
        observed += float((counts * (counts - 1) / 2).sum())
        c, d = float((p2[x] ** 2).sum()), float((p2[x] ** 3).sum())
        pairs, triples = m * (m - 1) / 2, m * (m - 1) * (m - 2) / 6
        mean += pairs * c
        var += pairs * (c - c * c) + 6 * triples * (d - c * c)
    return normal_sf((observed - mean) / math.sqrt(var))
