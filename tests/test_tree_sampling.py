"""Exact speculative sampling over a draft tree (`verify_tree` / `verify_paths` with a
sampler) against its oracles: on synthetic distributions, the distribution of the emitted
tokens equals what the target alone samples (computed analytically, chi-square bound); on
tiny random-init mlx-lm models, the committed state and the verdict's logits equal mlx-lm's
own forward of the emitted tokens."""

from __future__ import annotations

from collections import Counter

import mlx.core as mx
import numpy as np
import pytest
from scipy.stats import chi2

import kvstate as ks
from kvstate.adapters import wrap
from kvstate.adapters.tiny_models import tiny_model
from kvstate.speculative import Sampler, tree_of_paths, verify_paths, verify_tree
from kvstate.speculative._tree_accept import sample_tree
from kvstate.testing import assert_states_equal
from tests.helpers import raw_logits
from tests.test_tree_verify import PROMPT, assert_same_context

V = 6
# The target, defined on paths: its sampling distribution after each drafted path, and after
# any other one-token path (what the next round would sample from when the round stops
# after its first token). Peaked on the drafts so that both acceptance and rejection are
# common, and with p(5) = 0 at the root (as top-k/top-p leave zeros): draft 5 there must
# never be accepted nor 5 emitted.
TARGET = {
    (): [0.10, 0.35, 0.25, 0.15, 0.15, 0.00],
    (1,): [0.40, 0.05, 0.10, 0.05, 0.30, 0.10],
    (2,): [0.20, 0.20, 0.30, 0.10, 0.10, 0.10],
    (1, 0): [0.10, 0.10, 0.10, 0.10, 0.10, 0.50],
    (1, 4): [0.05, 0.15, 0.20, 0.25, 0.30, 0.05],
    (1, 0, 5): [0.30, 0.10, 0.10, 0.10, 0.20, 0.20],
    (2, 2): [0.25, 0.25, 0.10, 0.10, 0.20, 0.10],
    (1, 3): [0.60, 0.10, 0.10, 0.10, 0.05, 0.05],
    (0,): [0.05, 0.05, 0.10, 0.50, 0.20, 0.10],
    (3,): [0.30, 0.30, 0.10, 0.10, 0.10, 0.10],
    (4,): [0.10, 0.10, 0.10, 0.10, 0.10, 0.50],
    (5,): [1 / 6] * 6,
}
# Roots 1, 2, 1 (a duplicate: never accepted, as 1 was tried first), 3 and 5 (p = 0);
# depth 2 under the first 1: 0 and 4, under 2: 2, under the duplicate 1: 3; depth 3: 5.
TOKENS = [1, 2, 1, 3, 5, 0, 4, 2, 3, 5]
PARENTS = [-1, -1, -1, -1, -1, 0, 0, 1, 2, 5]
DRAWS = 20_000
SIGNIFICANCE = 1e-6  # a correct rule fails this bound once in a million seeds


def _path(node: int) -> tuple[int, ...]:
    out: list[int] = []
    while node != -1:
        out.append(TOKENS[node])
        node = PARENTS[node]
    return tuple(out[::-1])


def _synthetic_probs() -> mx.array:
    return mx.array([TARGET[()], *[TARGET[_path(i)] for i in range(len(TOKENS))]], mx.float32)


def _assert_matches(counts: Counter, expected: dict, what: str) -> None:
    """Pearson's chi-square of the observed `counts` against `expected` probabilities (cells of
    zero probability must be empty), failing above the 1 - SIGNIFICANCE quantile."""
    total = sum(counts.values())
    impossible = {c: n for c, n in counts.items() if expected.get(c, 0) == 0}
    assert not impossible, f"{what}: outcomes of probability 0 drawn: {impossible}"
    cells = [c for c, p in expected.items() if p > 0]
    stat = sum((counts[c] - total * expected[c]) ** 2 / (total * expected[c]) for c in cells)
    bound = chi2.ppf(1 - SIGNIFICANCE, len(cells) - 1)
    assert stat < bound, f"{what}: chi-square {stat:.1f} >= {bound:.1f} ({len(cells)} cells)"


def test_the_emitted_tokens_are_distributed_as_the_target_samples_them():
    """20k seeded rounds over a tree with a duplicate sibling, a zero-probability draft and
    depth 3. Oracle: the target alone samples token 1 from p_root and token 2 from p after
    token 1 (when the round emitted only one token, token 2 is the next round's: drawn here
    from the target after it); and token 3 from p after (1, 0) given that prefix."""
    probs = _synthetic_probs()
    sampler = Sampler(temperature=1.0)
    keys = mx.random.split(mx.random.key(7), DRAWS)
    rng = np.random.default_rng(7)
    firsts: Counter = Counter()
    pairs: Counter = Counter()
    thirds: Counter = Counter()
    lengths: Counter = Counter()
    for i in range(DRAWS):
        nodes, token = sample_tree(probs, TOKENS, PARENTS, sampler, keys[i])
        emitted = [*[TOKENS[n] for n in nodes], token]
        lengths[len(emitted)] += 1
        if len(emitted) == 1:
            emitted.append(int(rng.choice(V, p=TARGET[(emitted[0],)])))
        firsts[emitted[0]] += 1
        pairs[tuple(emitted[:2])] += 1
        if emitted[:2] == [1, 0] and len(emitted) > 2:
            thirds[emitted[2]] += 1
    root = TARGET[()]
    _assert_matches(firsts, dict(enumerate(root)), "token 1")
    joint = {(a, b): root[a] * TARGET[(a,)][b] for a in range(V) for b in range(V)}
    _assert_matches(pairs, joint, "tokens 1 and 2")
    _assert_matches(thirds, dict(enumerate(TARGET[(1, 0)])), "token 3 after (1, 0)")
    assert all(lengths[n] > DRAWS // 50 for n in (1, 2, 3, 4)), lengths  # every depth reached


def test_the_rule_on_a_leaf_only_tree_and_a_draft_of_probability_one():
    """A draft of probability 1 is always accepted (then the leaf's p is sampled); one of
    probability 0 never is, and its token is never emitted at that node."""
    certain = mx.array([[0, 0, 1, 0], [0, 1, 0, 0]], mx.float32)
    impossible = mx.array([[0.5, 0.5, 0, 0], [0.25] * 4], mx.float32)
    sampler = Sampler(temperature=1.0)
    for seed in range(20):
        key = mx.random.key(seed)
        assert sample_tree(certain, [2], [-1], sampler, key) == ([0], 1)
        nodes, token = sample_tree(impossible, [2], [-1], sampler, key)
        assert nodes == [] and token in (0, 1)


# --- end to end on tiny random-init mlx-lm models -------------------------------------------

SAMPLER = Sampler(temperature=0.5)


def _top(model, path: list[int], n: int) -> list[int]:
    logits = raw_logits(model, PROMPT + path, [len(PROMPT) + len(path)])[0]
    return [int(t) for t in np.argsort(-logits[0, -1])[:n]]


def _likely_tree(model, last: int) -> tuple[list[int], list[int]]:
    """The target's own top tokens: two roots, two children under the first, one under the
    second, and a third level under the first child (its top pick); accepted and rejected both common at
    temperature 0.5 on a scaled model."""
    a = _top(model, [last], 2)
    b = _top(model, [last, a[0]], 2)
    c = _top(model, [last, a[1]], 1)
    d = _top(model, [last, a[0], b[0]], 1)
    return [a[0], b[0], d[0], b[1], a[1], c[0]], [-1, 0, 1, 0, -1, 4]  # in trie order


def _children(tokens: list[int], parents: list[int], node: int) -> list[int]:
    return [t for t, p in zip(tokens, parents, strict=True) if p == node]


def _assert_against_mlx_lm(model, m, state, last: int, verdict) -> None:
    """The verdict's logits are mlx-lm's at `last` and each accepted draft; its state decodes
    on exactly as mlx-lm's caches fed the prompt and the kept tokens do, and matches a plain
    forward of the kept tokens through the wrapped model."""
    kept = [last, *verdict.tokens[:-1]]
    probe = [9, 200, 77]
    _, ref, after = raw_logits(model, PROMPT + kept + probe, [len(PROMPT), len(kept), 3])
    assert verdict.logits.shape == (len(kept), ref.shape[-1])
    np.testing.assert_allclose(np.array(verdict.logits), ref[0], rtol=1e-4, atol=1e-4)
    decoded = m(mx.array([probe]), verdict.state)[0]
    np.testing.assert_allclose(np.array(decoded), after, rtol=1e-4, atol=1e-4)
    assert_same_context(verdict.state, m(mx.array([kept]), state)[1], m, probe)


@pytest.mark.parametrize(
    ("name", "sampler"),
    [
        ("llama", SAMPLER),
        ("qwen3_next", SAMPLER),
        ("mamba2", Sampler(temperature=0.7, top_p=0.9, top_k=8)),  # zeros in p: never accepted
    ],
)
def test_sampled_tree_and_paths_commit_what_mlx_lm_computes(name, sampler):
    """verify_tree and verify_paths with a temperature sampler over several seeds: the emitted
    drafts form a root path of the tree, the final token is none of the rejected children of
    the last accepted node, and the state and logits equal mlx-lm's forward of the emitted
    tokens (minus the final sampled one, which no state holds). The same key gives the same
    draw in both modes (the paths' trie is the tree)."""
    model = tiny_model(name, scale=4.0)
    m = wrap(model)
    state = m(mx.array([PROMPT]), m.init_state())[1]
    last = _top(model, [], 1)[0]
    tokens, parents = _likely_tree(model, last)
    paths = [[tokens[i] for i in path] for path in ([0, 1, 2], [0, 3], [4, 5])]
    assert tree_of_paths(paths) == (tokens, parents)
    accepted = Counter()
    for seed in range(6):
        tree = verify_tree(
            m, state, last, tokens, parents, sampler=sampler, key=mx.random.key(seed)
        )
        batch = verify_paths(m, state, last, paths, sampler=sampler, key=mx.random.key(seed))
        assert tree.tokens == batch.tokens
        assert tree.accepted == batch.accepted == len(tree.nodes)
        assert [parents[i] for i in tree.nodes] == [-1, *tree.nodes][: tree.accepted]  # root path
        assert tree.tokens[:-1] == [tokens[i] for i in tree.nodes]
        assert batch.tokens[:-1] == paths[batch.path][: batch.accepted]
        end = tree.nodes[-1] if tree.nodes else -1
        assert tree.tokens[-1] not in _children(tokens, parents, end)  # all were rejected
        assert float(sampler.probs(tree.logits[-1])[tree.tokens[-1]]) > 0  # in p's support
        accepted[tree.accepted] += 1
        for verdict in (tree, batch):
            _assert_against_mlx_lm(model, m, state, last, verdict)
    assert len(accepted) >= 2 and max(accepted) >= 2, accepted  # not a degenerate oracle


def test_greedy_verdicts_are_unchanged_and_carry_mlx_lms_logits():
    """No sampler, a greedy Sampler and a greedy Sampler with a key: the same verdict as
    greedy verification gives (the longest agreeing path), with mlx-lm's logits."""
    model = tiny_model("llama", scale=4.0)
    m = wrap(model)
    state = m(mx.array([PROMPT]), m.init_state())[1]
    last = _top(model, [], 1)[0]
    tokens, parents = _likely_tree(model, last)
    greedy = Sampler()
    plain = verify_tree(m, state, last, tokens, parents)
    assert plain.nodes == [0, 1, 2]  # the top-1 chain is the greedy continuation
    paths = [[tokens[i] for i in path] for path in ([4, 5], [0, 3], [0, 1, 2])]
    plain_paths = verify_paths(m, state, last, paths)
    assert (plain_paths.path, plain_paths.accepted) == (2, 3)
    assert plain_paths.tokens == plain.tokens
    for kwargs in ({"sampler": greedy}, {"sampler": greedy, "key": mx.random.key(1)}):
        for a, b in (
            (verify_tree(m, state, last, tokens, parents, **kwargs), plain),
            (verify_paths(m, state, last, paths, **kwargs), plain_paths),
        ):
            assert a[:3] == b[:3]
            assert_states_equal(a.state, b.state)
            np.testing.assert_array_equal(np.array(a.logits), np.array(b.logits))
    for verdict in (plain, plain_paths):
        _assert_against_mlx_lm(model, m, state, last, verdict)


def test_bad_samplers_and_keys_are_refused():
    model = tiny_model("llama")
    m = wrap(model)
    state = m(mx.array([PROMPT]), m.init_state())[1]
    cases = [
        ({"key": mx.random.key(0)}, "without a sampler"),
        ({"sampler": 0.7}, "must be a kvstate.speculative.Sampler"),
        ({"sampler": SAMPLER, "key": 3}, "mx.random.key"),
        ({"sampler": SAMPLER, "key": mx.zeros((2,), mx.int32)}, "int32"),
        ({"sampler": SAMPLER, "key": mx.random.split(mx.random.key(0), 2)}, r"\(2, 2\)"),
    ]
    for kwargs, error in cases:
        with pytest.raises(ks.StateError, match=error):
            verify_tree(m, state, 1, [2], [-1], **kwargs)
        with pytest.raises(ks.StateError, match=error):
            verify_paths(m, state, 1, [[2]], **kwargs)


def test_sampling_without_a_key_draws_from_the_global_prng():
    model = tiny_model("llama", scale=4.0)
    m = wrap(model)
    state = m(mx.array([PROMPT]), m.init_state())[1]
    draws = []
    for _ in range(2):
        mx.random.seed(3)
        draws.append(verify_tree(m, state, 1, [2, 3], [-1, 0], sampler=Sampler(1.0)).tokens)
    assert draws[0] == draws[1]
