"""Position keys: a sampled token's noise depends on its row's seed and position only, so a
sampled generation with point-mass drafts (n-gram, scripted) gives the un-speculated decode's
tokens, token for token, whatever k, the policy, the batch or the engine's rounds decide.

Oracles: Threefry-2x32-20's known-answer vectors (Random123's kat_vectors, also JAX's test);
the plain sampled decode (no drafter) of the same seed; the exact distribution of the
coupled acceptance rule (Pearson's chi-square at ALPHA = 1e-4 over N = 40,000 rows, enough
to see a 2% bias in a cell of probability 0.3: 8.7 standard errors)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from kvstate.adapters import wrap
from kvstate.adapters.tiny_models import tiny_model
from kvstate.engine import Engine, RequestParams
from kvstate.speculative import (
    CostAwarePolicy,
    FixedCost,
    NGramDrafter,
    Sampler,
    generate,
    position_keys,
)
from kvstate.speculative._position_keys import fold_in, rows_of, threefry
from kvstate.speculative._sampling import accept_columns

from .helpers import ScriptedDrafter
from .stats import chi2_sf, conditional_chi2

ALPHA = 1e-4
HOT = Sampler(temperature=1.0)
FILTERED = Sampler(temperature=0.8, top_k=12, top_p=0.95)
PROMPTS = [[5, 9, 13, 17, 9, 13, 17, 9], [3, 4, 3, 4, 3, 4], [7, 1, 2, 7, 1]]


def test_threefry_gives_the_known_answer_vectors() -> None:
    def hexes(key: list[int], block: list[int]) -> list[int]:
        out = threefry(mx.array(key, mx.uint32), mx.array(block, mx.uint32))
        return [int(v) for v in out.tolist()]

    assert hexes([0, 0], [0, 0]) == [0x6B200159, 0x99BA4EFE]
    ones = [0xFFFFFFFF, 0xFFFFFFFF]
    assert hexes(ones, ones) == [0x1CB996FC, 0xBB002BE7]
    assert hexes([0x13198A2E, 0x03707344], [0x243F6A88, 0x85A308D3]) == [0xC4923A9C, 0x483DF7A0]


def test_position_keys_are_each_rows_key_folded_with_its_positions() -> None:
    rows = rows_of(mx.random.key(3), 3)
    keys = position_keys(rows, [0, 5, 2], 4)
    assert keys.shape == (3, 4, 2) and keys.dtype == mx.uint32
    for b, start in enumerate([0, 5, 2]):
        for j in range(4):
            assert keys[b, j].tolist() == fold_in(rows[b], start + j).tolist()
    flat = {tuple(k) for k in np.array(keys).reshape(-1, 2).tolist()}
    assert len(flat) == 12  # every (row, position) its own key
    assert rows[1].tolist() == fold_in(mx.random.key(3), 1).tolist()


@pytest.fixture(scope="module")
def target() -> Any:
    return wrap(tiny_model("llama", num_hidden_layers=2, vocab_size=64, scale=3.0))


FROM_DRAFTS: dict[str, int] = {}  # accepted drafts by drafter class, over the module's runs


def tokens_of(target: Any, drafter: Any, sampler: Sampler, seed: int, **options: Any) -> list:
    rows: list[list[int]] = [[] for _ in PROMPTS]
    for r in generate(target, PROMPTS, drafter, max_tokens=14, sampler=sampler, seed=seed,
                      **options):  # fmt: skip
        for t in r:
            rows[t.row].append(t.token)
            name = type(drafter).__name__
            FROM_DRAFTS[name] = FROM_DRAFTS.get(name, 0) + t.from_draft
    return rows


@pytest.mark.parametrize("sampler", [HOT, FILTERED], ids=["t=1", "top-k top-p"])
def test_point_mass_drafts_give_the_plain_decodes_tokens(target: Any, sampler: Sampler) -> None:
    FROM_DRAFTS.clear()
    for seed in (0, 1, 2):
        plain = tokens_of(target, None, sampler, seed)
        assert plain != tokens_of(target, None, sampler, seed + 10)  # the seed matters
        runs = {
            "n-gram k=1": tokens_of(target, NGramDrafter(), sampler, seed, k=1, adaptive=False),
            "n-gram k=5": tokens_of(target, NGramDrafter(), sampler, seed, k=5, adaptive=False),
            # A scripted drafter proposes the plain decode's tokens, corrupted at random: long
            # acceptances and rejections at every depth.
            "scripted k=4": tokens_of(
                target, ScriptedDrafter(plain, 0.6, seed=seed), sampler, seed, k=4, adaptive=False
            ),
            # The default policy times its rounds: its choices differ from run to run.
            "default policy": tokens_of(target, NGramDrafter(), sampler, seed),
            "policy, verify cheap": tokens_of(
                target,
                NGramDrafter(),
                sampler,
                seed,
                policy=CostAwarePolicy(cost=FixedCost(lambda w: 1 + 0.05 * w)),
            ),
        }
        for name, rows in runs.items():
            assert rows == plain, (name, seed)
    # Drafts were accepted, so the equality says something about the acceptance rule.
    assert FROM_DRAFTS["ScriptedDrafter"] > 20, FROM_DRAFTS


def test_the_engine_serves_a_sampled_request_as_generate_decodes_it_alone(target: Any) -> None:
    params = [RequestParams(max_tokens=12, temperature=1.0, seed=s) for s in (4, 5, 6)]
    alone = [tokens_of_one(target, p, prompt) for p, prompt in zip(params, PROMPTS, strict=True)]
    for drafter in (None, NGramDrafter()):
        engine = Engine(target, drafter, k=3, adaptive=False)
        requests = [engine.submit(prompt, p) for p, prompt in zip(params, PROMPTS, strict=True)]
        while engine.step():
            pass
        assert [list(r.tokens) for r in requests] == alone, drafter


def tokens_of_one(target: Any, params: RequestParams, prompt: list[int]) -> list[int]:
    rounds = generate(target, [prompt], None, max_tokens=params.max_tokens,
                      sampler=params.sampler, seed=params.seed)  # fmt: skip
    return [t.token for r in rounds for t in r]


def chi_square_p(tokens: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's chi-square p-value of `tokens` against `probs` (cells below 5 pooled)."""
    statistic, df = conditional_chi2(((0, int(t)) for t in tokens), probs[None])
    return chi2_sf(statistic, df)


@pytest.mark.parametrize("with_draft_probs", [False, True], ids=["point mass", "distribution"])
def test_the_rule_with_position_keys_is_exact(with_draft_probs: bool) -> None:
    """Every row: the same p1 (V,) and p2 (V,) after its one draft (d, or drawn from q);
    the first emitted token must follow p1 and, after an accepted draft, the second p2."""
    n, vocab, d = 40_000, 8, 2
    rng = np.random.default_rng(0)
    p1 = rng.dirichlet(np.ones(vocab)).astype(np.float32)
    p1[d] = 0.3
    p1 /= p1.sum()
    p2 = rng.dirichlet(np.ones(vocab)).astype(np.float32)
    target = mx.broadcast_to(mx.array(np.stack([p1, p2]))[None], (n, 2, vocab))
    drafted = np.full(n, d)
    q = None
    if with_draft_probs:  # each row's draft drawn from q, as a drafter draws it
        q_row = rng.dirichlet(np.ones(vocab)).astype(np.float32)
        q = mx.broadcast_to(mx.array(q_row)[None, None], (n, 1, vocab))
        drafted = rng.choice(vocab, size=n, p=q_row.astype(np.float64) / q_row.sum())
    drafts = mx.array(drafted[:, None], mx.int32)
    keys = position_keys(rows_of(mx.random.key(9), n), [3] * n, 2)
    cols = np.array(accept_columns(target, drafts, q, [1] * n, HOT, keys))
    accepted, nxt, marks = cols[:, 0], cols[:, 1], cols[:, 2]
    assert (marks == 0).all()
    first = np.where(accepted == 1, drafted, nxt)
    assert chi_square_p(first, p1.astype(np.float64)) > ALPHA
    second = nxt[accepted == 1]
    assert chi_square_p(second, p2.astype(np.float64)) > ALPHA
    if not with_draft_probs:  # the coupled rule accepts with probability p1(d)
        assert abs(accepted.mean() - p1[d]) < 4 * np.sqrt(p1[d] * (1 - p1[d]) / n)
