"""The generator's tree modes (`generate(..., tree="tree" | "paths")`) against the
un-speculated oracle, mlx-lm's greedy `generate_step`, on every architecture tree
verification supports, with candidate trees whose winning branch varies round to round;
sampled tree rounds against the target's own distribution; the drafter told the winning path."""

from __future__ import annotations

from typing import Any, cast

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

from kvstate import NotSupportedError, StateError, TokenError
from kvstate.adapters import wrap
from kvstate.adapters.tiny_models import VOCAB, tiny_model
from kvstate.speculative import (
    CostAwarePolicy,
    DraftTree,
    FixedCost,
    ModelDrafter,
    MTPDrafter,
    NGramDrafter,
    Sampler,
    generate,
    tree_of_paths,
)

from .helpers import ScriptedDrafter, second_tokens_checked

NEW = 64
PROMPT = [3, 17, 42, 99, 7, 250, 31, 8, 120, 64, 5]
MODES = ["tree", "paths"]


def greedy(model, prompt: list[int], n: int) -> list[int]:
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n)]


class ScriptedTreeDrafter:
    """Three candidate paths in a random order: the true greedy continuation with each token
    right with probability `p`, one that follows the truth for one token and then goes wrong,
    and one wrong from its first token. Checks that `accept` is told a real candidate path
    whose kept prefix is what the generator emitted."""

    def __init__(self, truth: list[int], p: float, seed: int = 0) -> None:
        self.truth, self.p = truth, p
        self.rng = np.random.default_rng(seed)
        self.emitted = 1  # the prefill's token
        self.proposed: list[list[int]] = []
        self.winners = 0  # rounds won by a path that was not the first candidate

    def start(self, prompts: list[list[int]]) -> None:
        pass

    def propose_tree(self, last: int, k: int, sampler: Sampler) -> DraftTree:
        assert last == self.truth[self.emitted - 1]
        true = (self.truth + [0] * (k + 1))[self.emitted : self.emitted + k]
        noisy = [t if self.rng.random() < self.p else (t + 1) % VOCAB for t in true]
        wrong = [(t + 2) % VOCAB for t in true]
        paths = [noisy, [true[0], *wrong[1:]], wrong]
        self.rng.shuffle(paths)
        self.proposed = paths
        return DraftTree(*tree_of_paths(paths))

    def accept(self, fed: mx.array, kept: list[int]) -> None:
        row = cast(list[list[int]], fed.tolist())[0]
        # A candidate path, or a prefix of one (a policy may verify paths cut shorter).
        fed_path = row[1:]
        assert any(path[: len(fed_path)] == fed_path for path in self.proposed), (
            "accept must get a candidate path or a prefix of one"
        )
        (n,) = kept
        assert row[:n] == self.truth[self.emitted - 1 : self.emitted - 1 + n]
        self.winners += n > 1 and row[1:] != self.proposed[0]
        self.emitted += n

    def keep_rows(self, rows: list[int]) -> None:
        assert rows == [0]


def run(target, drafter, mode: str, k: int = 4, **kwargs) -> tuple[list[int], int]:
    out, drafted = [], 0
    kwargs.setdefault("adaptive", False)  # whole candidate paths (the policy may cut them)
    for tokens in generate(target, [PROMPT], drafter, k=k, max_tokens=NEW, tree=mode, **kwargs):
        for t in tokens:
            out.append(t.token)
            drafted += t.from_draft
    return out, drafted


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "name",
    ["llama", "qwen3", "gemma3_text", "qwen3_next", "mamba2", "nemotron_h", "falcon_h1", "lfm2"],
)
def test_tree_rounds_decode_exactly_like_greedy(name, mode):
    """64 tokens equal mlx-lm's greedy ones; drafts are accepted, some rounds through a
    candidate other than the first (gemma3's window of 8 wraps during the verifies)."""
    model = tiny_model(name)
    truth = greedy(model, PROMPT, NEW + 9)
    drafter = ScriptedTreeDrafter(truth, 0.7)
    out, drafted = run(wrap(model), drafter, mode)
    assert out == truth[:NEW]
    assert drafted > 0 and drafter.winners > 0


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("p", "k"), [(1.0, 8), (0.0, 3), (0.5, 1)])
def test_any_acceptance_and_depth(mode, p, k):
    model = tiny_model("qwen3_next")
    truth = greedy(model, PROMPT, NEW + 9)
    out, drafted = run(wrap(model), ScriptedTreeDrafter(truth, p, seed=k), mode, k=k)
    assert out == truth[:NEW]
    if p == 1.0:  # the all-right candidate wins every round: k drafts + 1 per round
        assert drafted >= NEW - NEW // (k + 1) - 1


@pytest.mark.parametrize("mode", MODES)
def test_prompt_lookup_trees_are_exact(mode):
    """An unscaled random llama repeats itself: prompt lookup finds several continuations,
    and the output is still mlx-lm's greedy output."""
    model = tiny_model("llama", scale=1.0)
    truth = greedy(model, PROMPT, NEW)
    drafter = NGramDrafter(branches=3)
    out, drafted = run(wrap(model), drafter, mode)
    assert out == truth
    assert drafted > 0


def test_prompt_lookup_proposes_the_latest_distinct_continuations():
    drafter = NGramDrafter(max_n=2, branches=3)
    # "5" was followed by 6 7, then by 8 9, then by 6 7 again, then by 1 2
    drafter.start([[5, 6, 7, 0, 5, 8, 9, 0, 5, 6, 7, 0, 5, 1, 2, 0]])
    tree = drafter.propose_tree(5, 2, Sampler())
    # the bigram (0, 5) and the unigram 5 agree; latest first, duplicates once
    assert tree == DraftTree(*tree_of_paths([[1, 2], [6, 7], [8, 9]]))
    assert drafter.propose_tree(4, 2, Sampler()) == DraftTree([], [])
    assert drafter.propose([5], 2, Sampler()).tokens.tolist() == [[1, 2]]


class TopCandidates:
    """Root siblings: the target's three most likely tokens after the last one (chosen
    without the acceptance's randomness, so the rule must stay exact), each followed by one
    fixed token."""

    def __init__(self, target, prompt: list[int]) -> None:
        self.target, self.prompt = target, prompt

    def start(self, prompts: list[list[int]]) -> None:
        pass

    def propose_tree(self, last: int, k: int, sampler: Sampler) -> DraftTree:
        logits, _ = self.target(mx.array([[*self.prompt, last]]), self.target.init_state())
        top = np.argsort(-np.array(logits[0, -1]))[:3].tolist()
        return DraftTree([*top, 1, 2, 3][: 3 * min(k, 2)], [-1, -1, -1, 0, 1, 2][: 3 * min(k, 2)])

    def accept(self, fed: mx.array, kept: list[int]) -> None:
        pass

    def keep_rows(self, rows: list[int]) -> None:
        pass


@pytest.mark.parametrize("mode", MODES)
def test_sampled_tree_rounds_follow_the_target_distribution(mode):
    """160 runs sample the same prompt at temperature 1 (top_k 6); the second token (the
    first a tree can supply) follows the target's distribution given the first, within total
    variation 0.3 (accepting the first candidate whenever it is drafted would put the most
    likely token's share near 1)."""
    model = tiny_model("llama", num_hidden_layers=2, seed=3)
    target = wrap(model)
    sampler = Sampler(temperature=1.0, top_k=6)
    prompt = [5, 9, 13]
    drafter = TopCandidates(target, prompt)
    pairs: dict[int, list[int]] = {}
    from_draft = 0
    for seed in range(160):
        rounds = generate(
            target, [prompt], drafter, k=2, max_tokens=3, sampler=sampler, seed=seed, tree=mode
        )
        tokens = [t for r in rounds for t in r]
        pairs.setdefault(tokens[0].token, []).append(tokens[1].token)
        from_draft += tokens[1].from_draft
    assert from_draft > 0
    assert second_tokens_checked(target, prompt, sampler, pairs, least=40, bound=0.3) >= 1


def test_logprobs_are_the_targets_at_each_emitted_token():
    model = tiny_model("llama")
    truth = greedy(model, PROMPT, 12)
    target = wrap(model)
    tokens = [
        t
        for r in generate(
            target,
            [PROMPT],
            ScriptedTreeDrafter(truth, 0.7),
            max_tokens=12,
            tree="tree",
            adaptive=False,  # whole candidate paths (the policy may cut them)
        )
        for t in r
    ]
    logits, _ = target(mx.array([PROMPT + truth[:11]]), target.init_state())
    want = np.array(
        logits[0, len(PROMPT) - 1 :] - mx.logsumexp(logits[0, len(PROMPT) - 1 :], -1, keepdims=True)
    )
    got = np.stack([np.array(t.logprobs) for t in tokens])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_bad_tree_modes_are_refused():
    target = wrap(tiny_model("llama"))
    truth = [0] * 8
    with pytest.raises(StateError, match="tree must be") as bad:  # bad input, not unsupported
        next(generate(target, [PROMPT], ScriptedTreeDrafter(truth, 1.0), tree="trie"))
    assert not isinstance(bad.value, NotSupportedError)
    cases: list[tuple[dict[str, Any], list[list[int]], Any, str]] = [
        ({"tree": "tree"}, [PROMPT, PROMPT], ScriptedTreeDrafter(truth, 1.0), "one prompt"),
        ({"tree": "paths"}, [PROMPT], ScriptedDrafter([truth], 1.0), "propose_tree"),
        ({"tree": "tree"}, [PROMPT], None, "propose_tree"),
    ]
    for kwargs, prompts, drafter, message in cases:
        with pytest.raises(NotSupportedError, match=message):
            next(generate(target, prompts, drafter, **kwargs))
    mtp = MTPDrafter.__new__(MTPDrafter)
    mtp.propose_tree = lambda *a: None  # type: ignore[attr-defined]
    with pytest.raises(NotSupportedError, match="hidden states"):
        next(generate(target, [PROMPT], mtp, tree="tree"))


@pytest.mark.parametrize(("name", "mode"), [("llama", "tree"), ("qwen3_next", "paths")])
def test_a_draft_model_proposing_trees_is_exact(name, mode):
    """A draft model's top-3 first tokens, each continued k-1 steps: the output stays mlx-lm's
    greedy output (llama's draft rolls back by a trim, qwen3_next's by a re-run)."""
    model = tiny_model(name)
    truth = greedy(model, PROMPT, NEW)
    drafter = ModelDrafter(wrap(tiny_model(name, scale=3.9)), branches=3)
    out, drafted = run(wrap(model), drafter, mode)
    assert out == truth
    assert drafted > 0


class CyclicTree(ScriptedTreeDrafter):
    def propose_tree(self, last: int, k: int, sampler: Sampler) -> DraftTree:
        return DraftTree([4, 5, 6], [1, 2, 1])  # 0 -> 1 -> 2 -> 1 ...: no root


@pytest.mark.parametrize("mode", MODES)
def test_a_malformed_tree_from_the_drafter_is_refused(mode):
    target = wrap(tiny_model("llama"))
    with pytest.raises(TokenError, match="drafter's tree: parents"):
        list(generate(target, [PROMPT], CyclicTree([0] * 8, 1.0), max_tokens=4, tree=mode))


class OutOfVocabulary(ScriptedTreeDrafter):
    def propose_tree(self, last: int, k: int, sampler: Sampler) -> DraftTree:
        return DraftTree([5, VOCAB + 3], [-1, 0])


@pytest.mark.parametrize("mode", MODES)
def test_drafts_outside_the_vocabulary_are_refused_in_both_modes(mode):
    target = wrap(tiny_model("llama"))
    with pytest.raises(TokenError, match=f"ids \\[{VOCAB + 3}\\] outside"):
        list(generate(target, [PROMPT], OutOfVocabulary([0] * 8, 1.0), max_tokens=4, tree=mode))


class WrongThenRight(ScriptedTreeDrafter):
    """Two candidate paths, both wrong from their first token for the first 3 rounds, then
    the truth in both; records the depth asked for each round."""

    def __init__(self, truth: list[int]) -> None:
        super().__init__(truth, 1.0)
        self.asked: list[int] = []

    def propose_tree(self, last: int, k: int, sampler: Sampler) -> DraftTree:
        self.asked.append(k)
        true = (self.truth + [0] * (k + 1))[self.emitted : self.emitted + k]
        shift = 1 if len(self.asked) <= 3 else 0
        paths = [[(t + shift) % VOCAB for t in true], [(t + 2 * shift) % VOCAB for t in true]]
        self.proposed = paths
        return DraftTree(*tree_of_paths(paths))


@pytest.mark.parametrize("mode", MODES)
def test_the_tree_depth_adapts_to_the_acceptance(mode):
    model = tiny_model("llama")
    truth = greedy(model, PROMPT, 40)
    drafter = WrongThenRight(truth)
    # Verifies priced like a GPU's (a wide verify costs little more than a plain step): the
    # policy keeps asking for trees through the wrong rounds and at the whole depth after the
    # truth returns (its choices under scripted costs: tests/test_policy.py).
    policy = CostAwarePolicy(cost=FixedCost(lambda width: 1 + 0.05 * width))
    rounds = generate(wrap(model), [PROMPT], drafter, k=3, max_tokens=30, tree=mode, policy=policy)
    assert [t.token for r in rounds for t in r] == truth[:30]
    assert len(drafter.asked) > 3 and drafter.asked[0] == 3
    assert drafter.asked[-1] == 3  # back to the whole depth once the drafts are right
