"""Sampled speculative decoding is exact whatever the seeds: every drafter and mode against
the target's own distribution, with seeds chosen to line up.

The target is a tiny random-init llama (vocabulary 32) and, wrapped apart, its own draft
model, so every draft is drawn from the target's distribution (q = p) and is accepted: the
second token of a row IS the draft. The oracle is analytic: p1 (the target after the
prompt) and p2(.|x) (after the prompt and x, for every x) from one batched forward. Each
row decodes 3 tokens at temperature 1 with k = 1 (the round after the first token verifies
one draft); the second token t2 is checked against p2(.|t1) by

- the exact binomial test of #(t2 == t1) against n * sum_x p1(x) p2(x|x): a draft whose noise
  is the first token's repeats it (22% of rows at the seeds of the review, against 4% here);
  with n = 4000 a 2-point rise of that rate (4% -> 6%) gives z = 6.5, found at the level
  below with probability 0.99;
- Pearson's chi-square of t2 given t1 (cells expected below 5 pooled), summed over t1;
- for the default-seed case, the collision count of rows decoded again under other
  generator seeds (`stats.collisions`): a drafter reusing its noise repeats its drafts.

Every test runs at significance ALPHA = 1e-4 per statistic (seeds fixed: the outcome is
deterministic; a correct sampler fails one with probability 1e-4 over the choice of seeds).
`KVSTATE_SAMPLING_SCALE=n` multiplies the draws (the default keeps the file near 20-30 s on
2 CPU cores).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from kvstate.adapters import wrap
from kvstate.adapters.tiny_models import tiny_model
from kvstate.speculative import (
    ModelDrafter,
    MTPDrafter,
    NGramDrafter,
    Sampler,
    generate,
)

from .stats import binomial_test, chi2_sf, collisions, conditional_chi2
from .test_mtp_drafter import TargetHead

ALPHA = 1e-4
SCALE = int(os.environ.get("KVSTATE_SAMPLING_SCALE", "1"))
VOCAB = 32
SAMPLER = Sampler(temperature=1.0)
PROMPT = [5, 9, 13, 17]


@pytest.fixture(scope="module")
def model() -> Any:
    return tiny_model(
        "llama", num_hidden_layers=1, vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
        head_dim=8, scale=3.0,
    )  # fmt: skip


def oracle(model: Any, prompt: list[int] = PROMPT) -> tuple[np.ndarray, np.ndarray]:
    """p1 (V,) and p2 (V, V): the target's sampling distributions after `prompt`, and after
    `prompt` and each token x (row x)."""
    target = wrap(model)
    logits, _ = target(mx.array([prompt]), target.init_state())
    p1 = np.array(SAMPLER.probs(logits[0, -1]), np.float64)
    logits, _ = target(mx.array([[*prompt, x] for x in range(VOCAB)]), target.init_state(VOCAB))
    p2 = np.array(SAMPLER.probs(logits[:, -1]), np.float64)
    return p1 / p1.sum(), p2 / p2.sum(1, keepdims=True)


class Rows:
    """(t1, t2) pairs of sampled rows, and how many of the t2 were accepted drafts."""

    def __init__(self) -> None:
        self.pairs: list[tuple[int, int]] = []
        self.drafted = 0

    def decode(
        self, target: Any, prompts: list[list[int]], drafter: Any, seed: int, **kw: Any
    ) -> list[tuple[int, int]]:
        """One sampled generation of 3 tokens a row with k = 1: its rows' (t1, t2), added."""
        out: list[list[int]] = [[] for _ in prompts]
        for tokens in generate(
            target, prompts, drafter, k=1, max_tokens=3, sampler=SAMPLER, seed=seed, **kw
        ):
            for t in tokens:
                out[t.row].append(t.token)
                self.drafted += t.from_draft and len(out[t.row]) == 2
        got = [(r[0], r[1]) for r in out]
        self.pairs += got
        return got

    def assert_exact(self, p1: np.ndarray, p2: np.ndarray, drafted: float = 0.25) -> None:
        """t2 == t1 as often as the target makes it, and t2 distributed as p2(.|t1); and the
        rounds did verify drafts (at least the fraction `drafted` of the t2 were drafts)."""
        pairs = self.pairs
        repeats = sum(x == y for x, y in pairs)
        rate = float(np.sum(p1 * np.diag(p2)))
        p_repeat = binomial_test(repeats, len(pairs), rate)
        statistic, df = conditional_chi2(pairs, p2)
        p_chi2 = chi2_sf(statistic, df)
        shown = (
            f"t2 == t1 in {repeats} of {len(pairs)} ({repeats / len(pairs):.4f}, target "
            f"{rate:.4f}): p = {p_repeat:.2e}; chi-square {statistic:.0f} on {df} df: "
            f"p = {p_chi2:.2e}"
        )
        assert p_repeat > ALPHA and p_chi2 > ALPHA, shown
        assert self.drafted >= drafted * len(pairs), (self.drafted, len(pairs))


def linear_rows(
    model: Any, drafter_of: Callable[[int], Any], seeds: Iterable[int], rows: int, **kw: Any
) -> Rows:
    target = wrap(model)
    out = Rows()
    for s in seeds:
        out.decode(target, [PROMPT] * rows, drafter_of(s), s, **kw)
    return out


def test_a_draft_model_seeded_like_the_generator_samples_the_target_distribution(model):
    """The review's case 1: `ModelDrafter(draft, seed=s)` and `generate(..., seed=s)`. With
    the generator's seed as its own, the first draft reused the first token's noise (the
    same key): it repeated it in 22% of rows. 4000 rows."""
    p1, p2 = oracle(model)
    draft = wrap(model)
    rows = linear_rows(model, lambda s: ModelDrafter(draft, seed=s), range(10), 400 * SCALE)
    rows.assert_exact(p1, p2)


def test_a_draft_model_at_its_default_seed_draws_new_noise_in_every_generation(model):
    """The review's case 2: `ModelDrafter(draft)` (its seed 0) and `generate(seed=s)` for
    100 seeds, 40 rows each. A row decoded again under another generator seed, with the
    same first token, must draw its second token anew: a drafter whose noise is the same
    in every generation gives the same draft again (the pair count was 22x its mean)."""
    p1, p2 = oracle(model)
    target, draft = wrap(model), wrap(model)
    rows, keyed = Rows(), []
    for s in range(1, 1 + 100 * SCALE):
        got = rows.decode(target, [PROMPT] * 40, ModelDrafter(draft), s)
        keyed += [(row, x, y) for row, (x, y) in enumerate(got)]
    p_collide = collisions(keyed, p2)
    assert p_collide > ALPHA, f"equal second tokens across generations: p = {p_collide:.2e}"
    rows.assert_exact(p1, p2)


def test_the_generators_seed_alone_fixes_a_sampled_generation(model):
    """The drafter draws from the key the generator hands it: its own seed does not enter
    (so no choice of the two can line them up), and one generator seed gives one output."""
    target, draft = wrap(model), wrap(model)
    first = Rows().decode(target, [PROMPT] * 8, ModelDrafter(draft, seed=0), 3)
    assert Rows().decode(target, [PROMPT] * 8, ModelDrafter(draft, seed=12345), 3) == first
    assert Rows().decode(target, [PROMPT] * 8, ModelDrafter(draft, seed=0), 4) != first


def test_an_mtp_head_seeded_like_the_generator_samples_the_target_distribution(model):
    """`MTPDrafter(head, seed=s)` with `generate(seed=s)`; the head is the target itself
    (it ignores the hidden states): q = p. 2400 rows."""
    p1, p2 = oracle(model)
    rows = linear_rows(
        model, lambda s: MTPDrafter(TargetHead(model), seed=s), range(6), 400 * SCALE
    )
    rows.assert_exact(p1, p2)


def test_prompt_lookup_drafts_sampled_are_exact(model):
    """`NGramDrafter` drafts are point masses (no randomness of their own): every token is
    in the prompt, so nearly every round verifies a draft (the token that followed it),
    mostly rejected (the target rarely picks it): t2 is then drawn from the residual, p
    without the draft. 4000 rows."""
    prompt = list(range(VOCAB))
    p1, p2 = oracle(model, prompt)
    target, rows = wrap(model), Rows()
    for s in range(10):
        rows.decode(target, [prompt] * 400 * SCALE, NGramDrafter(max_n=1), s)
    rows.assert_exact(p1, p2, drafted=0.01)


def test_a_ragged_batch_seeded_like_the_generator_samples_each_prompts_distribution(model):
    """Prompts of two lengths in one batch (prefilled one by one and merged, left-padded),
    `ModelDrafter(draft, seed=s)` with `generate(seed=s)`: each prompt's rows follow its own
    distribution. 2 x 500 rows (a ragged prefill runs each prompt alone)."""
    other = [3, 1, 4, 1, 5, 9]
    (p1, p2), (q1, q2) = oracle(model, PROMPT), oracle(model, other)
    target, draft = wrap(model), wrap(model)
    mine, theirs = Rows(), Rows()
    for s in range(5):
        got = Rows()
        got.decode(target, [PROMPT, other] * 100 * SCALE, ModelDrafter(draft, seed=s), s)
        mine.pairs += got.pairs[0::2]
        theirs.pairs += got.pairs[1::2]
        mine.drafted += got.drafted // 2
        theirs.drafted += got.drafted // 2
    mine.assert_exact(p1, p2)
    theirs.assert_exact(q1, q2)


@pytest.mark.parametrize("mode", ["tree", "paths"])
def test_tree_modes_seeded_like_the_generator_sample_the_target_distribution(model, mode):
    """One prompt a call (the tree modes take one), `ModelDrafter(draft, seed=s, branches=2)`
    (two sampled first tokens, without replacement) and `generate(seed=s, tree=mode)`, 400
    calls. The tree's drafts are point masses: exact whatever drew them, as long as the
    acceptance draws are the target's own."""
    p1, p2 = oracle(model)
    draft = wrap(model)
    rows = linear_rows(
        model, lambda s: ModelDrafter(draft, seed=s, branches=2), range(400 * SCALE), 1,
        tree=mode,
    )  # fmt: skip
    rows.assert_exact(p1, p2)
