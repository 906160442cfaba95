"""Token-tree verification (`verify_tree`) against its oracles: at every tree node, the logits
of mlx-lm's own model and caches fed the node's root-to-node path linearly; after the commit,
the state a linear capturing verify of the chosen path commits, and the state a plain forward
of only the accepted tokens gives (compared array by array, then by decoding on)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import kvstate as ks
from kvstate._rotating import temporal
from kvstate.adapters import wrap, wrap_options
from kvstate.adapters.instruments import buckets
from kvstate.adapters.tiny_models import VOCAB, tiny_model
from kvstate.speculative import tree_of_paths, verify_paths, verify_tree
from kvstate.testing import assert_states_equal, frozen_copy
from tests.helpers import greedy_reference, raw_logits

PROMPT = [3, 17, 42, 99, 7, 250, 31, 8, 120, 64, 5]
# gemma3_text: sliding windows of 8 that wrap (11-token prompt, trees of up to 10 tokens).
MODELS = [
    "llama",
    "qwen3",
    "gemma3_text",
    "qwen3_next",
    "mamba2",
    "nemotron_h",
    "falcon_h1",
    "lfm2",
]
TOL = {"rtol": 1e-4, "atol": 1e-4}

# Branching at depths 0, 1 and 2: node i's parent is PARENTS[i] (-1: a child of `last`).
PARENTS = [-1, 0, 0, 1, 1, 2, -1, 6, 3]


def _path(parents: list[int], node: int) -> list[int]:
    out = [node]
    while parents[out[-1]] != -1:
        out.append(parents[out[-1]])
    return out[::-1]


def prefilled(name: str):
    model = tiny_model(name)
    m = wrap(model)
    state = m(mx.array([PROMPT]), m.init_state())[1]
    truth = greedy_reference(model, PROMPT, 8)
    return model, m, state, truth


def assert_same_context(got, want, m, probe: list[int]) -> None:
    """The same committed context: equal lengths, allclose keys/values in use and recurrent
    arrays, and the same logits when both decode `probe` on."""
    for i, (a, b) in enumerate(zip(got.layers, want.layers, strict=True)):
        for x, y in zip(_parts(a), _parts(b), strict=True):
            assert type(x) is type(y), i
            if isinstance(x, ks.DenseKV):
                assert x.length == y.length, i
                for u, v in ((x.keys, y.keys), (x.values, y.values)):
                    np.testing.assert_allclose(
                        np.array(u[..., : x.length, :]), np.array(v[..., : y.length, :]), **TOL
                    )
            elif isinstance(x, ks.RotatingKV):
                # The window's entries oldest first; compare what both still hold.
                assert x.offset == y.offset, i
                for u, v in zip(temporal(x), temporal(y), strict=True):
                    n = min(u.shape[2], v.shape[2])
                    np.testing.assert_allclose(
                        np.array(u[..., -n:, :]), np.array(v[..., -n:, :]), **TOL
                    )
            else:
                for u, v in zip(x.arrays, y.arrays, strict=True):
                    np.testing.assert_allclose(np.array(u), np.array(v), **TOL)
    tokens = mx.array([probe])
    np.testing.assert_allclose(np.array(m(tokens, got)[0]), np.array(m(tokens, want)[0]), **TOL)


def _parts(layer):
    return layer.parts if isinstance(layer, ks.ListState) else (layer,)


@pytest.mark.parametrize("name", MODELS)
def test_every_node_gets_the_logits_of_a_linear_forward_of_its_path(name):
    """One tree forward of 1 + 9 tokens: the logits at every node equal mlx-lm's logits at
    the end of that node's root-to-node path fed linearly on its own caches."""
    model, m, state, truth = prefilled(name)
    tokens = [(t * 37 + 11) % VOCAB for t in range(len(PARENTS))]
    positions = [-1, *[p + 1 for p in PARENTS]]
    logits, _, _ = m.tree_forward(mx.array([[truth[0], *tokens]]), state, positions)
    for q in range(len(positions)):
        path = [truth[0]] + [tokens[i] for i in (_path(PARENTS, q - 1) if q else [])]
        (_, ref) = raw_logits(model, PROMPT + path, [len(PROMPT), len(path)])
        np.testing.assert_allclose(np.array(logits[0, q]), ref[0, -1], **TOL, err_msg=f"{q}")


def _truth_tree(truth: list[int]) -> tuple[list[int], list[int], list[int]]:
    """A tree whose node 4 ends the target's own continuation of depth 3 (truth[1..3]),
    with wrong siblings at depths 1, 2 and 3 and a wrong second root."""
    wrong = [(t + 1) % VOCAB for t in truth]
    tokens = [truth[1], wrong[2], truth[2], wrong[3], truth[3], wrong[4], wrong[1]]
    parents = [-1, 0, 0, 2, 2, 4, -1]
    return tokens, parents, [0, 2, 4]


@pytest.mark.parametrize("name", MODELS)
def test_the_commit_is_a_linear_verify_of_the_chosen_path(name):
    """The deepest agreeing path wins; the committed state equals the one a linear
    capturing verify of that path commits, and a plain forward of only the accepted tokens."""
    _, m, state, truth = prefilled(name)
    tokens, parents, expected = _truth_tree(truth)
    verdict = verify_tree(m, state, truth[0], tokens, parents)
    assert (verdict.nodes, verdict.accepted) == (expected, 3)
    assert verdict.tokens == truth[1:5]
    chosen = [tokens[i] for i in expected]
    _, linear, checkpoints = m(mx.array([[truth[0], *chosen, tokens[5]]]), state, capture=True)
    reference = ks.commit_prefix(linear, 4, checkpoints)
    only_accepted = m(mx.array([[truth[0], *truth[1:4]]]), state)[1]
    for want in (reference, only_accepted):
        assert_same_context(verdict.state, want, m, truth[4:8])


@pytest.mark.parametrize("name", ["llama", "gemma3_text", "qwen3_next", "nemotron_h"])
def test_a_single_chain_and_an_all_rejected_tree(name):
    """A chain is a linear verify (all three drafts right: all kept); a tree whose roots are
    all wrong keeps only `last`, and emits the target's own next token."""
    _, m, state, truth = prefilled(name)
    chain = verify_tree(m, state, truth[0], truth[1:4], [-1, 0, 1])
    assert (chain.nodes, chain.tokens) == ([0, 1, 2], truth[1:5])
    assert_same_context(chain.state, m(mx.array([truth[:4]]), state)[1], m, truth[4:7])
    wrong = [(truth[1] + d) % VOCAB for d in (1, 2)]
    rejected = verify_tree(m, state, truth[0], [wrong[0], truth[2], wrong[1]], [-1, 0, -1])
    assert (rejected.nodes, rejected.accepted, rejected.tokens) == ([], 0, [truth[1]])
    assert_same_context(rejected.state, m(mx.array([truth[:1]]), state)[1], m, truth[1:4])


def test_the_tree_and_the_batch_of_paths_agree():
    """The same candidates as a batch of paths (verify_paths) and as their trie: the same
    tokens emitted and the same committed context."""
    _, m, state, truth = prefilled("qwen3_next")
    paths = [[truth[1], 5, 6], [truth[1], truth[2], truth[3], 9], [7, 8], [truth[1], truth[2], 1]]
    tokens, parents = tree_of_paths(paths)
    assert (tokens, parents) == (
        [truth[1], 5, 6, truth[2], truth[3], 9, 7, 8, 1],
        [-1, 0, 1, 0, 3, 4, -1, 6, 3],
    )
    tree = verify_tree(m, state, truth[0], tokens, parents)
    batch = verify_paths(m, state, truth[0], paths)
    assert tree.tokens == batch.tokens == truth[1:5]
    assert_same_context(tree.state, batch.state, m, truth[4:7])


def test_the_input_state_is_left_as_it_was():
    _, m, state, truth = prefilled("qwen3_next")
    before = frozen_copy(state)
    tokens, parents, _ = _truth_tree(truth)
    verify_tree(m, state, truth[0], tokens, parents)
    assert_states_equal(state, before)


@pytest.mark.parametrize(
    ("tokens", "parents", "error"),
    [
        ([], [], "empty"),
        ([1, 2], [-1], "2 tokens but 1 parents"),
        ([1, 2], [1, -1], "listed parents first"),  # a parent after its child
        ([1, 2], [1, 0], "listed parents first"),  # a cycle
        ([1, 2], [-1, 1], "listed parents first"),  # its own parent
        ([1, 2], [-2, 0], "listed parents first"),
        ([1.5], [-1], "ints"),
    ],
)
def test_bad_trees_are_refused(tokens, parents, error):
    _, m, state, truth = prefilled("llama")
    with pytest.raises(ks.TokenError, match=error):
        verify_tree(m, state, truth[0], tokens, parents)


def test_bad_states_and_layers_are_refused(monkeypatch):
    _, m, state, truth = prefilled("llama")
    with pytest.raises(ks.NotSupportedError, match="batch-1"):
        verify_tree(m, ks.tile(state, 2), truth[0], [1], [-1])
    with pytest.raises(ks.TokenError, match="outside the vocabulary"):
        verify_tree(m, state, truth[0], [VOCAB], [-1])
    with pytest.raises(ks.StateError, match="parents"):
        m.tree_forward(mx.array([[1, 2]]), state, [-1, 1])
    gemma = wrap(tiny_model("gemma3_text"))  # a row of a batch: batched sliding windows
    batch = gemma([PROMPT, PROMPT], gemma.init_state(2))[1]
    with pytest.raises(ks.StateError, match="BatchRotatingKVCache"):
        verify_tree(gemma, ks.row_select(batch, 1), 1, [2], [-1])
    # Its recurrent layer is now one kvstate does not record, so a tree cannot follow it.
    hybrid = wrap(tiny_model("qwen3_next"), record_mixers=False)
    with pytest.raises(ks.StateError, match="not ones kvstate records"):
        verify_tree(hybrid, hybrid(mx.array([PROMPT]), hybrid.init_state())[1], 1, [2], [-1])


@pytest.mark.parametrize("name", ["llama", "qwen3_next"])
def test_a_row_of_a_ragged_batch_and_an_empty_state(name):
    """A batch-1 state taken from a left-padded batch (its caches keep their padding), and
    a state with no prefix at all, commit what a linear forward of the accepted tokens gives."""
    model = tiny_model(name)
    m = wrap(model)
    prompts = [PROMPT, PROMPT[:4]]
    batch = m([p + [0] * (len(PROMPT) - len(p)) for p in prompts], m.init_state(2),
              lengths=[len(p) for p in prompts])[1]  # fmt: skip
    short = ks.row_select(batch, 1)
    truth = greedy_reference(model, PROMPT[:4], 6)
    tokens, parents, expected = _truth_tree(truth)
    verdict = verify_tree(m, short, truth[0], tokens, parents)
    assert (verdict.nodes, verdict.tokens) == (expected, truth[1:5])
    plain = m(mx.array([truth[:4]]), short)[1]
    assert_same_context(verdict.state, plain, m, truth[4:6])

    empty = m.init_state()
    verdict = verify_tree(m, empty, PROMPT[0], [*PROMPT[1:3], 7], [-1, 0, 0])
    kept = [PROMPT[0], *verdict.tokens[:-1]]
    logits, plain = m(mx.array([kept]), empty)
    assert verdict.tokens[-1] == int(logits[0, -1].argmax())
    assert_same_context(verdict.state, plain, m, [1, 2])


def test_a_tree_deeper_than_the_sliding_window():
    """gemma3_text's window is 8: a chain of 10 drafts with a branch at depth 9 sees, at its
    deep nodes, only the last 8 positions of its own path (its first ancestors drop out)."""
    model, m, state, truth = prefilled("gemma3_text")
    parents = [-1, *range(9), 7]  # a chain of 10, and a sibling of the 9th node
    tokens = [(t * 29 + 5) % VOCAB for t in range(len(parents))]
    positions = [-1, *[p + 1 for p in parents]]
    logits, _, _ = m.tree_forward([[truth[0], *tokens]], state, positions)
    for q in range(len(positions)):
        path = [truth[0]] + [tokens[i] for i in (_path(parents, q - 1) if q else [])]
        (_, ref) = raw_logits(model, PROMPT + path, [len(PROMPT), len(path)])
        np.testing.assert_allclose(np.array(logits[0, q]), ref[0, -1], **TOL, err_msg=f"{q}")


@pytest.mark.parametrize("name", ["llama", "qwen3_next"])
def test_bucketed_attention_keeps_the_tree_exact(name, monkeypatch):
    """With CUDA's bucketed key lengths forced on (the attention runs over a padded key
    length, its mask extended by False), the tree mask extends the bucketed one: same logits
    at every node, same commit."""
    padded = []
    real = buckets.padded_mask
    monkeypatch.setattr(buckets, "padded_mask", lambda *a: padded.append(1) or real(*a))
    with wrap_options(buckets=True):
        test_every_node_gets_the_logits_of_a_linear_forward_of_its_path(name)
        test_the_commit_is_a_linear_verify_of_the_chosen_path(name)
    assert padded  # the bucketed masks were made
