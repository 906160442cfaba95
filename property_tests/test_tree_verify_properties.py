"""Random draft trees through `verify_tree`, against linear forwards on mlx-lm's own caches.

A tree of 1-10 drafts with random parents (each draft right or wrong at random, so paths are
accepted to random depths): the logits at every node are those of mlx-lm's model fed the
node's root-to-node path linearly; the verdict is the deepest path those oracle logits accept;
and the committed state decodes on exactly like a plain forward of the accepted tokens.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import mlx.core as mx
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from kvstate.adapters import wrap
from kvstate.adapters.tiny_models import VOCAB, tiny_model
from kvstate.speculative import verify_tree

PROMPT = [9, 4, 200, 31, 77, 15]
TOL = {"rtol": 1e-4, "atol": 1e-4}


@cache
def setup(name: str) -> tuple[Any, Any, Any, list[int]]:
    model = tiny_model(name)
    m = wrap(model)
    state = m(mx.array([PROMPT]), m.init_state())[1]
    truth = [int(t) for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=12)]
    return model, m, state, truth


def oracle_logits(model: Any, path: list[int]) -> np.ndarray:
    """mlx-lm's logits after prompt + path, on its own fresh caches."""
    caches = make_prompt_cache(model)
    model(mx.array([PROMPT]), cache=caches)
    return np.array(model(mx.array([path]), cache=caches)[0, -1])


@st.composite
def trees(draw: Any) -> tuple[list[int], list[bool]]:
    n = draw(st.integers(1, 10))  # up to 11 tokens: past gemma3_text's window of 8
    parents = [draw(st.integers(-1, i - 1)) for i in range(n)]
    right = [draw(st.integers(0, 3)) > 0 for _ in range(n)]  # right 3 times in 4
    return parents, right


@settings(max_examples=30)
@given(
    name=st.sampled_from(["llama", "gemma3_text", "qwen3_next", "nemotron_h"]),
    tree=trees(),
    noise=st.integers(0, 2**16),
)
def test_random_trees_verify_like_linear_forwards_of_their_paths(name, tree, noise):
    model, m, state, truth = setup(name)
    parents, right = tree
    rng = np.random.default_rng(noise)
    depth: list[int] = []
    for p in parents:
        depth.append(1 if p == -1 else depth[p] + 1)
    tokens = [
        truth[d] if ok else int(rng.integers(VOCAB)) for d, ok in zip(depth, right, strict=True)
    ]

    def path(i: int) -> list[int]:
        out = [i]
        while parents[out[-1]] != -1:
            out.append(parents[out[-1]])
        return out[::-1]

    positions = [-1, *[p + 1 for p in parents]]
    logits = np.array(m.tree_forward([[truth[0], *tokens]], state, positions)[0][0])
    oracle = [oracle_logits(model, [truth[0]])]
    oracle += [
        oracle_logits(model, [truth[0], *[tokens[j] for j in path(i)]]) for i in range(len(tokens))
    ]
    for q, want in enumerate(oracle):
        np.testing.assert_allclose(logits[q], want, **TOL, err_msg=f"node {q - 1}")

    # The verdict: the deepest node (first among equals) whose path the oracle accepts.
    pick = [int(o.argmax()) for o in oracle]
    agree = [all(tokens[j] == pick[parents[j] + 1] for j in path(i)) for i in range(len(tokens))]
    best = max(range(len(tokens)), key=lambda i: (len(path(i)) if agree[i] else 0, -i))
    nodes = path(best) if agree[best] else []
    verdict = verify_tree(m, state, truth[0], tokens, parents)
    assert verdict.nodes == nodes
    assert verdict.tokens == [*[tokens[j] for j in nodes], pick[nodes[-1] + 1 if nodes else 0]]

    # The committed state continues exactly like a plain forward of the accepted tokens.
    plain = m(mx.array([[truth[0], *[tokens[j] for j in nodes]]]), state)[1]
    probe = mx.array([[verdict.tokens[-1], 1, 2]])
    np.testing.assert_allclose(
        np.array(m(probe, verdict.state)[0]), np.array(m(probe, plain)[0]), **TOL
    )
