"""Sampled requests served by the engine follow the target's own distribution, in batches
that mix them with greedy requests and with requests of another sampler (a `RowSampler`
round), without a drafter, with the n-gram drafter and with a draft model.

As in tests/test_sampling_exact.py: a tiny llama of vocabulary 32; the oracle is analytic,
p1 (after the prompt) and p2(.|x) (after the prompt and x) from one batched forward, under
each request's sampler. Each sampled request emits 3 tokens (t1 from the prefill, t2 from
a round: a verified draft or the target's own draw; t3 leaves room for that draft); every request has its own seed, and
the requests arrive a few at a time, so rows join batches of every composition. Checked at
ALPHA = 1e-4 per statistic: Pearson's chi-square of t1 against p1 and of t2 given t1
against p2 (cells below 5 pooled), and the exact binomial test of #(t2 == t1), which a
drafter reusing the target's noise would inflate. Greedy requests equal the argmax decode.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from kvstate.adapters import wrap
from kvstate.adapters.tiny_models import tiny_model
from kvstate.engine import Engine, Request, RequestParams
from kvstate.speculative import ModelDrafter, NGramDrafter, Sampler

from .stats import binomial_test, chi2_sf, conditional_chi2

ALPHA = 1e-4
VOCAB = 32
PROMPT = (5, 9, 13, 17, 9, 13)  # repeats: the n-gram drafter has something to propose
SAMPLERS = {
    "t=1": RequestParams(max_tokens=3, temperature=1.0),
    "t=0.7 top_k=6 top_p=0.95": RequestParams(max_tokens=3, temperature=0.7, top_k=6, top_p=0.95),
}
COUNTS = {"t=1": 1200, "t=0.7 top_k=6 top_p=0.95": 600}
GREEDY = [(1, 2, 3), (30, 1), (7, 7, 7, 7)]


@pytest.fixture(scope="module")
def model() -> Any:
    return tiny_model(
        "llama", num_hidden_layers=1, vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
        head_dim=8, scale=3.0,
    )  # fmt: skip


def analytic(model: Any, sampler: Sampler) -> tuple[np.ndarray, np.ndarray]:
    """p1 (V,) and p2 (V, V) under `sampler`: after PROMPT, and after PROMPT and x (row x)."""
    target = wrap(model)
    logits, _ = target(mx.array([PROMPT]), target.init_state())
    p1 = np.array(sampler.probs(logits[0, -1]), np.float64)
    batch = mx.array([[*PROMPT, x] for x in range(VOCAB)])
    logits, _ = target(batch, target.init_state(VOCAB))
    p2 = np.array(sampler.probs(logits[:, -1]), np.float64)
    return p1 / p1.sum(), p2 / p2.sum(1, keepdims=True)


def greedy_truth(model: Any, prompt: tuple[int, ...], n: int) -> list[int]:
    target = wrap(model)
    logits, state = target(mx.array([prompt]), target.init_state())
    out: list[int] = []
    for _ in range(n):
        out.append(int(logits[0, -1].argmax().item()))
        logits, state = target(mx.array([[out[-1]]]), state)
    return out


def serve(model: Any, drafter: Any) -> tuple[dict[str, list[Request]], dict[str, Any]]:
    """Every request of COUNTS (and the greedy ones), a few arriving each step; the engine's
    stats after."""
    engine = Engine(wrap(model), drafter, max_batch=48, k=2, seed=11, adaptive=False)
    order = [name for name, n in COUNTS.items() for _ in range(n)]
    rng = np.random.default_rng(3)
    rng.shuffle(order)
    served: dict[str, list[Request]] = {name: [] for name in [*COUNTS, "greedy"]}
    seed = 0
    while order or engine.has_work():
        for _ in range(int(rng.integers(0, 24))):
            if order:
                name = order.pop()
                params = SAMPLERS[name]
                request = engine.submit(
                    PROMPT,
                    RequestParams(
                        max_tokens=3, temperature=params.temperature, top_k=params.top_k,
                        top_p=params.top_p, seed=seed,
                    ),
                )  # fmt: skip
                served[name].append(request)
                seed += 1
                if seed % 50 == 0:
                    prompt = GREEDY[seed // 50 % len(GREEDY)]
                    served["greedy"].append(engine.submit(prompt, RequestParams(max_tokens=6)))
        engine.step()
    return served, engine.stats()


def check(pairs: list[tuple[int, int]], p1: np.ndarray, p2: np.ndarray) -> None:
    first = [(0, x) for x, _ in pairs]
    s1, df1 = conditional_chi2(first, p1[None])
    s2, df2 = conditional_chi2(pairs, p2)
    repeats = sum(x == y for x, y in pairs)
    rate = float(np.sum(p1 * np.diag(p2)))
    p_values = (chi2_sf(s1, df1), chi2_sf(s2, df2), binomial_test(repeats, len(pairs), rate))
    shown = (
        f"t1: chi-square {s1:.0f} on {df1} df; t2 | t1: {s2:.0f} on {df2} df; t2 == t1 in "
        f"{repeats} of {len(pairs)} (target rate {rate:.4f}); p-values {p_values}"
    )
    assert min(p_values) > ALPHA, shown
    assert df1 >= 5 and df2 >= 20, shown  # the distributions are wide enough to test


@pytest.mark.parametrize("drafter", ["none", "ngram", "draft model"])
def test_sampled_requests_follow_the_targets_distribution(model, drafter):
    made = {"none": None, "ngram": NGramDrafter(), "draft model": ModelDrafter(wrap(model))}
    served, stats = serve(model, made[drafter])
    for name, requests in served.items():
        if name == "greedy":
            for r in requests:
                assert r.tokens == greedy_truth(model, r.prompt, 6)
            continue
        assert all(len(r.tokens) == 3 for r in requests)
        p1, p2 = analytic(model, SAMPLERS[name].sampler)
        check([(r.tokens[0], r.tokens[1]) for r in requests], p1, p2)
    assert len(served["greedy"]) > 20
    if drafter != "none":  # the second tokens were verified drafts (often accepted)
        least = 0.15 if drafter == "ngram" else 0.8  # n-gram: when t1 is in the prompt
        assert stats["drafted"] > least * sum(COUNTS.values())
        assert stats["accepted"] > (0.5 if drafter == "draft model" else 0.02) * stats["drafted"]
