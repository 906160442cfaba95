"""The speculative generator against the un-speculated oracle: mlx-lm's greedy `generate_step`
on every architecture, with drafters that are right, wrong or partly right, batch 1 and a
ragged batch; and exact speculative sampling against the target's own distribution."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

import kvstate as ks
from kvstate.adapters import wrap
from kvstate.adapters.tiny_models import tiny_model
from kvstate.speculative import (
    CostAwarePolicy,
    FixedCost,
    ModelDrafter,
    NGramDrafter,
    Proposal,
    Sampler,
    accept,
    generate,
    verify_paths,
)
from kvstate.speculative import _linear_round as round_module
from kvstate.speculative._sampling import sampled_verdict as verdict

from .helpers import ScriptedDrafter, second_tokens_checked

NEW = 64
PROMPTS = [[3, 17, 42, 99, 7, 250, 31, 8, 120, 64, 5], [100, 101, 102], [7, 7, 40, 41, 42]]


def greedy(model, prompt: list[int], n: int) -> list[int]:
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n)]


def run(target, prompts, drafter, k: int, adaptive: bool = True) -> tuple[list[list[int]], int]:
    out: list[list[int]] = [[] for _ in prompts]
    drafted = 0
    for tokens in generate(target, prompts, drafter, k=k, max_tokens=NEW, adaptive=adaptive):
        for t in tokens:
            out[t.row].append(t.token)
            drafted += t.from_draft
    return out, drafted


@pytest.mark.parametrize(
    "name",
    ["llama", "qwen3", "gemma3_text", "qwen3_next", "mamba2", "nemotron_h", "falcon_h1", "lfm2"],
)
def test_a_ragged_batch_decodes_exactly_like_greedy(name):
    """Three prompts of different lengths, drafts right half of the time, k = 4: every row's
    64 tokens are mlx-lm's greedy ones (gemma3's window of 8 wraps during the verifies)."""
    model = tiny_model(name)
    truth = [greedy(model, p, NEW + 9) for p in PROMPTS]
    out, drafted = run(wrap(model), PROMPTS, ScriptedDrafter(truth, 0.5), 4)
    assert out == [t[:NEW] for t in truth]
    assert drafted > 0


@pytest.mark.parametrize("name", ["llama", "qwen3_next", "nemotron_h", "gemma3_text"])
def test_prompts_of_one_length_prefill_as_one_batch_and_decode_like_greedy(name, monkeypatch):
    """Prompts of one length run as one batched forward (one call of the target for the
    prompts, not one each); every row still decodes mlx-lm's greedy tokens."""
    prompts = [[3, 17, 42, 99, 7], [100, 101, 102, 5, 6], [7, 7, 40, 41, 42]]
    model = tiny_model(name)
    truth = [greedy(model, p, NEW + 9) for p in prompts]
    target = wrap(model)
    widths: list[tuple[int, int]] = []
    original = type(target).__call__

    def counted(self, tokens, state, **kw):
        widths.append(tuple(mx.array(tokens).shape))
        return original(self, tokens, state, **kw)

    monkeypatch.setattr(type(target), "__call__", counted)
    out, drafted = run(target, prompts, ScriptedDrafter(truth, 0.5), 4, adaptive=False)
    assert out == [t[:NEW] for t in truth]
    # verifies are (3, 5) too, until rows end (then fewer rows, never one call per row)
    rows = [b for b, _ in widths]
    assert widths[0] == (3, 5) and rows == sorted(rows, reverse=True)
    assert drafted > 0


@pytest.mark.parametrize("name", ["llama", "qwen3_next"])
@pytest.mark.parametrize("p", [0.0, 1.0, 0.6])
@pytest.mark.parametrize("k", [1, 8])
def test_batch_one_decodes_exactly_like_greedy_for_any_acceptance_and_k(name, p, k):
    model = tiny_model(name)
    truth = [greedy(model, PROMPTS[0], NEW + 9)]
    out, drafted = run(wrap(model), PROMPTS[:1], ScriptedDrafter(truth, p, seed=k), k, False)
    assert out == [truth[0][:NEW]]
    if p == 1.0:
        assert drafted >= NEW - NEW // (k + 1) - 1  # every round accepts all k drafts
    if p == 0.0:
        assert drafted == 0


def test_a_recurrent_layer_kvstate_does_not_know_is_replayed_exactly():
    model = tiny_model("qwen3_next")
    truth = [greedy(model, p, NEW + 9) for p in PROMPTS]
    out, _ = run(wrap(model, record_mixers=False), PROMPTS, ScriptedDrafter(truth, 0.5), 3)
    assert out == [t[:NEW] for t in truth]


def test_a_draft_model_drafter_and_max_tokens_and_eos():
    model = tiny_model("qwen3_next")
    truth = greedy(model, PROMPTS[1], 20)
    drafter = ModelDrafter(wrap(tiny_model("qwen3_next", scale=3.8)))
    rounds = list(generate(wrap(model), PROMPTS[1:2], drafter, k=4, max_tokens=20))
    assert [t.token for r in rounds for t in r] == truth
    stop = truth[7]
    out = [
        t.token
        for r in generate(wrap(model), PROMPTS[1:2], None, max_tokens=20, eos=[stop])
        for t in r
    ]
    assert out == truth[: truth.index(stop) + 1]


@pytest.mark.parametrize("budget", [9, 7])
def test_the_last_rounds_draft_only_the_tokens_still_wanted(budget):
    """A draft past every row's budget would be verified only to be cut (mlx-lm caps its
    drafts the same way): near the end the generator asks for fewer, and for the last token
    of every row it takes a plain step and leaves the drafter alone."""
    model = tiny_model("llama", scale=4.0)
    truth = [greedy(model, p, budget) for p in PROMPTS[:2]]
    asked: list[tuple[int, int]] = []  # (k asked for, tokens the rows still wanted)
    drafter = ScriptedDrafter(truth, p=1.0)
    propose, accept = drafter.propose, drafter.accept
    accepted: list[list[int]] = []

    def recording(last: list[int], k: int, sampler) -> Proposal:
        asked.append((k, budget - min(drafter.emitted)))
        return propose(last, k, sampler)

    def accepting(fed: mx.array, kept: list[int]) -> None:
        accepted.append(kept)
        accept(fed, kept)

    drafter.propose, drafter.accept = recording, accepting  # type: ignore[method-assign]
    rows: list[list[int]] = [[], []]
    for r in generate(wrap(model), PROMPTS[:2], drafter, k=4, max_tokens=budget, adaptive=False):
        for t in r:
            rows[t.row].append(t.token)
    assert rows == truth
    # Every draft is right: the prefill gives 1 token and a round of 4 drafts gives 5.
    if budget == 9:  # 1 + 5, then 3 wanted: 2 drafts and the target's token
        assert asked == [(4, 8), (2, 3)]
    else:  # 1 + 5, then 1 wanted: a plain step, no proposal and no accept
        assert asked == [(4, 6)]
    assert len(accepted) == len(asked)


# ---------------------------------------------------------------------------------------
# Exact speculative sampling
# ---------------------------------------------------------------------------------------


def chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    seen = expected > 0
    assert counts[~seen].sum() == 0, "a token of probability 0 was emitted"
    return float((((counts - expected) ** 2)[seen] / expected[seen]).sum())


@pytest.mark.parametrize("deterministic", [False, True])
def test_accepted_or_resampled_tokens_follow_the_target_distribution(deterministic):
    """40000 rows verify 3 drafts against fixed target distributions p_t; the first emitted
    token must follow p_0, and the second (in rows that accepted the first draft) p_1, by a
    chi-square test at the 0.1% level (df = 5: 20.5). Drafts are drawn from q (or fixed)."""
    vocab, width, rows = 6, 3, 40000
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(vocab), size=width + 1).astype(np.float32)
    q = rng.dirichlet(np.ones(vocab) * 0.5, size=width).astype(np.float32)
    target = mx.broadcast_to(mx.array(p)[None], (rows, width + 1, vocab))
    if deterministic:
        drafts = mx.array(rng.integers(0, vocab, (rows, width)), mx.int32)
        draft_probs = None
    else:
        drafts = mx.stack(
            [
                mx.random.categorical(mx.log(mx.array(q[i])), shape=(rows,), key=mx.random.key(i))
                for i in range(width)
            ],
            axis=1,
        ).astype(mx.int32)
        draft_probs = mx.broadcast_to(mx.array(q)[None], (rows, width, vocab))
    verdict = accept(
        target, drafts, draft_probs, [width] * rows, Sampler(temperature=1.0), mx.random.key(7)
    )
    accepted = np.array(verdict.accepted)
    nxt = np.array(verdict.next_tokens)
    d = np.array(drafts)
    first = np.where(accepted >= 1, d[:, 0], nxt)
    assert chi_square(np.bincount(first, minlength=vocab), p[0]) < 20.5
    went_on = accepted >= 1
    second = np.where(accepted[went_on] >= 2, d[went_on, 1], nxt[went_on])
    assert chi_square(np.bincount(second, minlength=vocab), p[1]) < 20.5


def test_greedy_acceptance_is_prefix_matching():
    target = mx.array([[[0.1, 0.9, 0], [0.8, 0.2, 0], [0, 0, 1]]] * 2)  # argmax 1, 0, 2
    drafts = mx.array([[1, 0], [1, 1]])
    verdict = accept(target, drafts, None, [2, 2], Sampler())
    assert verdict.accepted == [2, 1] and verdict.next_tokens == [2, 0]


def test_drafts_past_a_rows_count_are_never_accepted():
    """Positions past counts[b] are filler: a row accepts at most its count, even when the
    filler happens to be the target's pick (greedy and sampled rules alike)."""
    target = mx.array([[[0.1, 0.9, 0], [0.8, 0.2, 0], [0, 0, 1]]] * 3)  # argmax 1, 0, 2
    drafts = mx.array([[1, 0]] * 3)  # both drafts are the target's picks
    assert accept(target, drafts, None, [2, 1, 0], Sampler()).accepted == [2, 1, 0]
    assert accept(target, drafts, None, [2, 1, 0], Sampler()).next_tokens == [2, 0, 1]
    sampled = accept(target, drafts, None, [2, 1, 0], Sampler(temperature=1.0), mx.random.key(0))
    assert sampled.accepted[1] <= 1 and sampled.accepted[2] == 0


def test_sampled_generation_matches_the_target_distribution(monkeypatch):
    """End to end: 300 rows (3 generations of 100: MLX CUDA fails a step of >= 128 rows,
    README) sample the same prompt at temperature 1 (top_k 6) with a draft model that
    disagrees with the target; the second token (the first that can come from a draft)
    follows the target's distribution given the first, within total variation 0.25 (a rule
    that always accepted drafts would follow the draft model instead)."""
    model = tiny_model("llama", num_hidden_layers=2, seed=3)
    target = wrap(model)
    draft = wrap(tiny_model("llama", num_hidden_layers=2, seed=4))
    sampler = Sampler(temperature=1.0, top_k=6)
    prompt = [5, 9, 13]
    pairs: dict[int, list[int]] = {}
    verdicts = []  # the acceptance rule's, one per verify round: it must have been tried
    monkeypatch.setattr(
        round_module,
        "sampled_verdict",
        lambda *a, **k: verdicts.append(verdict(*a, **k)) or verdicts[-1],
    )
    for seed in (11, 12, 13):
        drafter = ModelDrafter(draft, seed=seed)
        emitted: list[list[int]] = [[] for _ in range(100)]
        # max_tokens 3: the round after the first token drafts (with 2 it would be a plain
        # step, drafts being capped at the tokens still wanted, and the rule untested).
        rounds = generate(target, [prompt] * 100, drafter, k=3, max_tokens=3, sampler=sampler,
                          seed=seed)  # fmt: skip
        for tokens in rounds:
            for t in tokens:
                emitted[t.row].append(t.token)
        for first, second, *_ in emitted:
            pairs.setdefault(first, []).append(second)
    assert len(verdicts) == 3 and all(len(v.accepted) == 100 for v in verdicts)
    assert second_tokens_checked(target, prompt, sampler, pairs, least=60, bound=0.25) >= 1


def test_prompt_lookup_drafts_are_exact_and_nothing_proposed_means_a_plain_step(monkeypatch):
    """An unscaled random llama repeats itself, so prompt lookup finds drafts; the output is
    still mlx-lm's greedy output, and a round with nothing to propose runs no verify."""
    model = tiny_model("llama", scale=1.0)
    target = wrap(model)
    truth = greedy(model, PROMPTS[0], NEW)
    widths = []  # tokens per target forward; the first is the prompt's prefill
    real_call, real_prefill = type(target).__call__, type(target).prefill

    def counting(self, tokens, state, **kwargs):
        widths.append(tokens.shape[1])
        return real_call(self, tokens, state, **kwargs)

    def counting_prefill(self, tokens, state, **kwargs):
        widths.append(tokens.shape[1])
        return real_prefill(self, tokens, state, **kwargs)

    monkeypatch.setattr(type(target), "__call__", counting)
    monkeypatch.setattr(type(target), "prefill", counting_prefill)
    out, drafted = run(target, PROMPTS[:1], NGramDrafter(), 4)
    assert out == [truth]
    assert drafted > 0
    verifies = [w for w in widths[1:] if w > 1]
    assert verifies and max(verifies) <= 5
    widths.clear()
    plain = [t for r in generate(target, [[1, 2, 3]], NGramDrafter(), max_tokens=2) for t in r]
    # nothing to look up in [1, 2, 3, x]: a plain one-token step after the prefill
    assert len(plain) == 2 and widths == [3, 1]


@pytest.mark.parametrize("name", ["llama", "gemma3_text", "qwen3_next", "mamba2"])
def test_a_batch_of_paths_commits_what_a_linear_verify_of_the_winner_gives(name):
    """Three candidate continuations, one forward: the winner is the path the target agrees
    with longest, and the committed state decodes on exactly like the state after a linear
    verify of that path, and like a forward of only the accepted tokens."""
    model = tiny_model(name)
    m = wrap(model)
    prompt = PROMPTS[0]
    truth = greedy(model, prompt, 8)
    state = m(mx.array([prompt]), m.init_state())[1]
    last = truth[0]
    paths = [[truth[1], 5, 6], [truth[1], truth[2], truth[3], 9], [7, 8]]
    verdict = verify_paths(m, state, last, paths)
    assert (verdict.path, verdict.accepted) == (1, 3)
    assert verdict.tokens == truth[1:5]
    _, linear, checkpoints = m(mx.array([[last, *paths[1]]]), state, capture=True)
    reference = ks.commit_prefix(linear, 4, checkpoints)
    only_accepted = m(mx.array([[last, *truth[1:4]]]), state)[1]
    probe = mx.array([[truth[4]]])
    got = np.array(m(probe, verdict.state)[0])
    for other in (reference, only_accepted):
        np.testing.assert_allclose(got, np.array(m(probe, other)[0]), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["gemma3_text", "qwen3_next", "falcon_h1"])
def test_a_draft_model_keeps_step_with_a_ragged_batch(name):
    """A draft model close to the target: rows accept different counts (its state then
    catches up with a ragged commit), or all accept the same (its proposing state is kept,
    a kept final draft fed next round); the output stays mlx-lm's greedy output."""
    model = tiny_model(name)
    truth = [greedy(model, p, 40) for p in PROMPTS]
    drafter = ModelDrafter(wrap(tiny_model(name, scale=3.9)))
    out: list[list[int]] = [[] for _ in PROMPTS]
    for tokens in generate(wrap(model), PROMPTS, drafter, k=3, max_tokens=40):
        for t in tokens:
            out[t.row].append(t.token)
    assert out == truth


@pytest.mark.parametrize("name", ["llama", "qwen3_next"])
def test_a_draft_model_round_reads_the_device_once(monkeypatch, name):
    """mlx-lm's speculative_generate_step waits for the device once per round; so must the
    generator: the draft chain, the verify and the acceptance stay lazy until one read of
    the accepted counts and the target's picks (an unpipelined drafter evaluates nothing
    before it). The tokens stay greedy's."""
    model = tiny_model(name, scale=4.0)
    truth = greedy(model, PROMPTS[0], 24)
    reads = []
    for method in ("tolist", "item"):
        real = getattr(mx.array, method)
        monkeypatch.setattr(
            mx.array, method, lambda a, _r=real, _m=method: (reads.append(_m), _r(a))[1]
        )
    for function in ("eval", "async_eval"):
        real = getattr(mx, function)
        monkeypatch.setattr(
            mx, function, lambda *a, _r=real, _f=function: (reads.append(_f), _r(*a))[1]
        )
    drafter = ModelDrafter(wrap(tiny_model(name, scale=3.8)), pipelined=False)
    rounds = generate(wrap(model), PROMPTS[:1], drafter, k=3, max_tokens=24, adaptive=False)
    out = [t.token for t in next(rounds)]
    per_round = []
    for tokens in rounds:
        per_round.append(len(reads))
        reads.clear()
        out += [t.token for t in tokens]
    assert out == truth
    # per_round[0] also counts the prefill's reads
    assert len(per_round) > 5 and all(n == 1 for n in per_round[1:]), per_round


def test_the_draft_length_adapts_to_the_acceptance():
    """adaptive (the default): after rounds with no draft accepted the policy asks for fewer
    drafts (none, but for probes), and after the drafter recovers for all k again."""
    model = tiny_model("llama", scale=4.0)
    truth = [greedy(model, PROMPTS[0], 40)]
    drafter = ScriptedDrafter(truth, p=0.0)
    propose = drafter.propose
    asked: list[int] = []

    def scheduled(last: list[int], k: int, sampler) -> Proposal:
        asked.append(k)
        drafter.p = 0.0 if len(asked) <= 4 else 1.0  # four wrong rounds, then right ones
        return propose(last, k, sampler)

    drafter.propose = scheduled  # type: ignore[method-assign]
    policy = CostAwarePolicy(cost=FixedCost(lambda w: 1.0 + 0.1 * w), probe=2)
    rounds = generate(wrap(model), PROMPTS[:1], drafter, k=3, max_tokens=30, policy=policy)
    out = [t.token for r in rounds for t in r]
    assert out == truth[0][:30]
    # the prior (acceptance 0.5) asks for 2 at these costs, rejections for 1, the drafter's
    # recovery for all k again
    # (the last round asks only for what the room left allows)
    assert asked[:5] == [2, 1, 1, 1, 1] and asked[-5:-1] == [3, 3, 3, 3], asked
