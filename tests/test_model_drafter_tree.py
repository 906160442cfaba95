"""ModelDrafter's tree proposals against mlx-lm, driven by hand through `verify_tree` and
`verify_paths` on a tiny random-init target.

Every round: (a) each proposed path is the draft model's own greedy continuation of its
first token, and the first tokens are the draft model's most likely ones (oracle: mlx-lm's
model on its own caches over the row's history); (b) after `accept` the draft state holds
exactly the kept history: the draft model's logits over [pending, last, probe] from the
state equal mlx-lm's over the whole history from scratch; (c) with the target as its own
draft every draft of the top branch is accepted."""

from __future__ import annotations

from typing import Any, cast

import mlx.core as mx
import numpy as np
import pytest

from kvstate import StateError
from kvstate.adapters import wrap
from kvstate.adapters.tiny_models import tiny_model
from kvstate.speculative import (
    DraftTree,
    ModelDrafter,
    Sampler,
    tree_of_paths,
    verify_paths,
    verify_tree,
)
from kvstate.speculative import _model_drafter as drafter_module
from kvstate.speculative._branches import first_picks
from kvstate.speculative._trees import root_to_leaf_paths
from tests.helpers import CountingModel, greedy_reference, raw_logits

PROMPT = [3, 17, 42, 99, 7, 250, 31, 8, 120, 64, 5]
PROBE = 77  # a token fed after `last` in the state check, so two positions are compared


class Rounds:
    """A batch-1 target and a ModelDrafter, round after round, with the oracle checks."""

    def __init__(self, target: Any, draft: Any, *, chain: bool = True, branches: int = 3):
        self.target, self.draft = wrap(target), draft
        self.counting = CountingModel(wrap(draft), chain)
        self.drafter = ModelDrafter(self.counting, branches=branches)
        logits, self.state = self.target(mx.array([PROMPT]), self.target.init_state())
        self.last = int(logits[0, -1].argmax())
        self.emitted = [self.last]
        self.history = list(PROMPT)  # every kept token: the draft state's, then `pending`
        self.drafter.start([list(PROMPT)])
        self.winners: list[tuple[int, int]] = []  # (branch, accepted) per round
        self.reruns = 0

    def check_state(self) -> None:
        """(b): the draft state holds the history, bar a pending final draft."""
        pending = self.drafter.pending
        held = self.history if pending is None else self.history[:-1]
        fed = [*self.history[len(held) :], self.last, PROBE]
        if pending is not None:  # the kept final draft, to be fed first
            assert cast(list[int], pending.tolist()) == [[self.history[-1]]]
        ours = self.counting.wrapped(mx.array([fed]), self.drafter.state)[0][0, -2:]
        want = raw_logits(self.draft, [*held, *fed], [len(held) + len(fed)])
        np.testing.assert_allclose(np.array(ours), want[0][0, -2:], rtol=1e-3, atol=1e-3)

    def propose(self, k: int, sampler: Sampler | None = None) -> list[list[int]]:
        self.check_state()
        tree = self.drafter.propose_tree(self.last, k, sampler or Sampler())
        return root_to_leaf_paths(tree)

    def check_paths(self, paths: list[list[int]], k: int, branches: int) -> None:
        """(a): the draft model's top first tokens, each continued greedily by the draft."""
        context = [*self.history, self.last]
        logits = raw_logits(self.draft, context, [len(context)])[0][0, -1]
        assert [p[0] for p in paths] == [int(t) for t in np.argsort(-logits)[:branches]]
        for p in paths:
            assert len(p) == k
            assert p[1:] == greedy_reference(self.draft, [*context, p[0]], k - 1)

    def verify(self, mode: str, paths: list[list[int]], tree: DraftTree) -> None:
        """The target's verdict, then the drafter told the winning path, as the generator
        tells it (the whole root-to-leaf path, kept = accepted + 1)."""
        if mode == "paths":
            v = verify_paths(self.target, self.state, self.last, paths)
            branch, accepted, tokens, self.state = v.path, v.accepted, v.tokens, v.state
        else:
            t = verify_tree(self.target, self.state, self.last, tree.tokens, tree.parents)
            kept = [tree.tokens[i] for i in t.nodes]
            branch = next(b for b, p in enumerate(paths) if p[: len(kept)] == kept)
            accepted, tokens, self.state = t.accepted, t.tokens, t.state
        fed = mx.array([[self.last, *paths[branch]]], mx.int32)
        before = self.counting.calls
        self.drafter.accept(fed, [accepted + 1])
        self.reruns += self.counting.calls - before
        self.winners.append((branch, accepted))
        self.history += [self.last, *paths[branch][:accepted]]
        self.emitted += tokens
        self.last = tokens[-1]

    def round(self, mode: str, k: int, branches: int = 3) -> None:
        paths = self.propose(k)
        self.check_paths(paths, k, branches)
        self.verify(mode, paths, DraftTree(*tree_of_paths(paths)))


# Target and draft of one architecture, the draft's weights scaled differently: the target
# accepts some drafts, not all, and now and then prefers a lower branch.
CASES = [
    ("llama", "tree"),
    ("llama", "paths"),
    ("qwen3_next", "tree"),
    ("mamba2", "paths"),
    ("gemma3_text", "tree"),
]


@pytest.mark.parametrize(("name", "mode"), CASES)
def test_tree_proposals_are_the_draft_models_continuations_and_accept_keeps_its_state_exact(
    name, mode
):
    target = tiny_model(name)
    r = Rounds(target, tiny_model(name, scale=3.0))
    k = 3
    for _ in range(8):
        r.round(mode, k)
    r.check_state()
    # The target's own greedy decode (verify is exact): the rounds were real ones.
    assert r.emitted == greedy_reference(target, PROMPT, len(r.emitted))
    assert any(0 < a < k for _, a in r.winners)  # partial rounds, which roll back
    assert any(b > 0 and a > 0 for b, a in r.winners), r.winners  # a lower branch won
    if drafter_module.rolls_back_by_trim(r.drafter.state):
        assert r.reruns == 0  # the winning row was trimmed, never re-run
    else:
        assert r.reruns > 0


@pytest.mark.parametrize(("name", "mode"), [("llama", "paths"), ("qwen3_next", "tree")])
def test_a_target_drafting_for_itself_accepts_every_draft_of_the_top_branch(name, mode):
    model = tiny_model(name)
    r = Rounds(model, model)
    k = 4
    for _ in range(4):
        r.round(mode, k)
    assert r.winners == [(0, k)] * 4  # every round: the top branch, all of it
    assert r.drafter.pending is not None  # the final draft, kept but never fed
    r.check_state()
    assert r.emitted == greedy_reference(model, PROMPT, len(r.emitted))


def test_a_draft_model_without_chain_drafts_the_same_tree_by_calls():
    target = tiny_model("llama")
    chained = Rounds(target, tiny_model("llama", scale=3.0))
    by_calls = Rounds(target, tiny_model("llama", scale=3.0), chain=False)
    for _ in range(4):
        paths = chained.propose(3)
        assert by_calls.propose(3) == paths
        for r in (chained, by_calls):
            r.verify("tree", paths, DraftTree(*tree_of_paths(paths)))
    by_calls.check_state()
    assert by_calls.winners == chained.winners


@pytest.mark.parametrize("name", ["llama", "qwen3_next"])
def test_sampled_first_tokens_are_distinct_and_the_state_stays_exact(name):
    """With a temperature the branches are random draws: distinct first tokens, and after
    each accept the draft state still holds exactly the kept history. top_k=2 leaves two
    tokens with mass: the third branch is dropped, not drafted on a token never drawn."""
    target = tiny_model(name)
    r = Rounds(target, tiny_model(name, scale=3.0))
    widths = set()
    for sampler in [Sampler(temperature=1.0)] * 3 + [Sampler(temperature=1.0, top_k=2)] * 3:
        paths = r.propose(3, sampler)
        firsts = [p[0] for p in paths]
        assert len(set(firsts)) == len(firsts)
        widths.add((sampler.top_k, len(paths)))
        r.verify("paths", paths, DraftTree(*tree_of_paths(paths)))
    r.check_state()
    assert widths == {(0, 3), (2, 2)}


def test_linear_rounds_follow_a_tree_round():
    """The state a tree round leaves (a pending draft included) is the one linear drafting
    expects."""
    model = tiny_model("llama")
    r = Rounds(model, model)
    r.round("tree", 3)
    assert r.drafter.pending is not None
    context = [*r.history, r.last]
    proposal = r.drafter.propose([r.last], 3, Sampler())
    assert cast(list[int], proposal.tokens[0].tolist()) == greedy_reference(model, context, 3)


def test_a_refused_accept_leaves_the_drafter_as_it_was():
    model = tiny_model("llama")
    r = Rounds(model, model)
    r.round("paths", 2)  # everything kept: a pending final draft
    paths = r.propose(2)
    fed = mx.array([[r.last, *paths[0]]], mx.int32)
    for bad_fed, kept in [(fed, [1, 1]), (mx.repeat(fed, 2, axis=0), [1]), (fed, [4]), (fed, [0])]:
        with pytest.raises(StateError, match=r"ModelDrafter\.accept"):
            r.drafter.accept(bad_fed, kept)
    assert r.drafter.pending is not None
    r.verify("paths", paths, DraftTree(*tree_of_paths(paths)))
    r.check_state()


def test_trees_take_one_row_and_at_least_one_branch():
    with pytest.raises(StateError, match="branches"):
        ModelDrafter(wrap(tiny_model("llama")), branches=0)
    drafter = ModelDrafter(wrap(tiny_model("llama")))
    with pytest.raises(StateError, match="start"):
        drafter.propose_tree(5, 3, Sampler())
    drafter.start([[1, 2, 3]])
    with pytest.raises(StateError, match="k must be"):
        drafter.propose_tree(5, 0, Sampler())
    wide = ModelDrafter(wrap(tiny_model("llama")), branches=300)  # the vocabulary is 256
    wide.start([[1, 2]])
    with pytest.raises(StateError, match="vocabulary"):
        wide.propose_tree(5, 2, Sampler())
    drafter.start([[1, 2, 3], [4, 5]])
    with pytest.raises(StateError, match="one row"):
        drafter.propose_tree(5, 3, Sampler())


def test_sampled_first_tokens_are_draws_without_replacement_from_the_draft_distribution():
    """Branch 0's first token is distributed as the sampler's q, branch 1's as the second
    draw without replacement, sum_i q_i q_j / (1 - q_i) (NumPy); distinct every time."""
    logits = mx.array([2.0, 1.0, 0.5, 0.0, -1.0, 1.5])
    sampler = Sampler(temperature=0.7)
    q = np.array(sampler.probs(logits), dtype=np.float64)
    second = np.array([sum(q[i] * q[j] / (1 - q[i]) for i in range(6) if i != j) for j in range(6)])
    draws = 3000
    counts = np.zeros((2, 6))
    key = mx.random.key(7)
    for _ in range(draws):
        key, sub = mx.random.split(key)
        ids, weight = first_picks(logits, 3, sampler, sub)
        picked = cast(list[int], ids.tolist())
        assert len(set(picked)) == 3
        assert weight is not None
        np.testing.assert_allclose(np.array(weight), q[picked], rtol=1e-5)
        counts[0, picked[0]] += 1
        counts[1, picked[1]] += 1
    np.testing.assert_allclose(counts[0] / draws, q, atol=0.03)
    np.testing.assert_allclose(counts[1] / draws, second, atol=0.03)


@pytest.mark.parametrize("name", ["llama", "mamba2"])
def test_kept_tokens_no_branch_proposed_run_again_from_the_state_before(name):
    """A winning path the drafter never proposed (a caller's own tree): the kept tokens run
    through the draft model again, after the pending final draft, and the state is exact."""
    model = tiny_model(name)
    r = Rounds(model, model)
    r.round("paths", 2)  # everything kept: a pending final draft
    assert r.drafter.pending is not None
    paths = r.propose(2)
    other = next(t for t in range(1, 256) if t not in {p[0] for p in paths})
    before = r.counting.calls
    r.drafter.accept(mx.array([[r.last, other, 9]], mx.int32), [2])
    assert r.counting.calls == before + 1
    r.history += [r.last, other]
    r.last = 9
    r.check_state()
