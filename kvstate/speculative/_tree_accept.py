"""Exact speculative sampling over a draft tree: recursive rejection sampling, every draft a
point mass.

The rule. Walk from the root (the node after `last`). At the current node, with the target's
sampling distribution p there, try its children in tree order: accept child c with
probability p'(c), where p' is p with the tokens of the siblings already rejected zeroed and
renormalised (a duplicate of a rejected sibling's token has p' = 0). On acceptance descend
into c. When every child is rejected, or the node is a leaf, emit one token drawn from the
final p' (the residual; at a leaf, or when no child was tried, p itself) and stop.

Why it is exact. Take one node with p and children tokens c_1..c_m (distinct, after dropping
duplicates, which are never accepted). Let R_j = {c_1..c_j} and r_j = p(R_j). Child c_j is
reached with probability 1 - r_{j-1} (every earlier one rejected) and accepted with
p(c_j) / (1 - r_{j-1}), so it is taken with probability p(c_j); a token x outside R_m is
emitted with probability (1 - r_m) * p(x) / (1 - r_m) = p(x). So the token taken at the node
is distributed as p: exactly what the target alone samples there. Given that the token is a
child, the walk continues at that child with the target's distribution after it, and the
same argument applies one level down; given an emitted non-draft token the round ends and
the next token is the next round's, sampled after that token. By induction every emitted
token is distributed as the target's sample given the tokens before it. The argument needs
only that the tree is fixed before the uniforms of this round are drawn, so it holds for any
drafter (an n-gram lookup, top-b branching of a draft model): the drafts' own probabilities
do not enter (point masses), at the price of accepting less often than a rule that knows
them. For one child it is "accept with p(c), else sample p without c", whose marginal is p.

Cost: one device read (p at every node's parent and node's token, and one uniform per node;
a node is tried at most once), a walk on the host, one `sampler.sample` of the residual.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, cast

import mlx.core as mx

from .. import StateError
from ._sampling import Sampler, draw_from


class TreeDraw(NamedTuple):
    nodes: list[int]  # the accepted drafts, as tree indices from the root down
    token: int  # the token sampled after the last accepted node (or after `last`)


def sample_tree(
    probs: mx.array,
    tokens: Sequence[int],
    parents: Sequence[int],
    sampler: Sampler,
    key: mx.array | None = None,
) -> TreeDraw:
    """Recursive rejection sampling over the tree `tokens[i]` / `parents[i]` (-1: a root;
    parents listed first). `probs` (1 + N, V): the target's sampling distributions after
    `last` (row 0) and after draft i (row i + 1). Two host reads."""
    keys = mx.random.split(key, 2) if key is not None else (None, None)
    rows = mx.array([p + 1 for p in parents])
    p_drafts = probs[rows, mx.array(list(tokens))]  # p at each node's parent, of the node's token
    uniforms = mx.random.uniform(shape=(len(tokens),), key=keys[0])
    read = cast(list[list[float]], mx.stack([p_drafts.astype(mx.float32), uniforms]).tolist())
    nodes, rejected = walk_tree(tokens, parents, read[0], read[1])
    at = probs[nodes[-1] + 1 if nodes else 0]
    if rejected:
        # The residual: p with the rejected children's tokens zeroed. If rounding left it
        # no mass (p lay all on rejected tokens, each accepted with probability ~1), use p.
        vocab = mx.arange(at.shape[-1])
        residual = mx.where((vocab[:, None] == mx.array(rejected)[None]).any(-1), 0, at)
        mass = residual.sum()
        at = mx.where(mass > 0, residual / mx.where(mass > 0, mass, 1), at)
    token = cast(int, draw_from(sampler, at, keys[1]).item())
    return TreeDraw(nodes, token)


def walk_tree(
    tokens: Sequence[int],
    parents: Sequence[int],
    p_drafts: Sequence[float],
    uniforms: Sequence[float],
) -> tuple[list[int], list[int]]:
    """The host walk: `p_drafts[i]` is p(tokens[i]) under the distribution at node i's parent,
    `uniforms[i]` node i's own uniform draw. Returns the accepted path (tree indices, root
    down) and the tokens rejected at its last node (to zero in the residual)."""
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        children.setdefault(p, []).append(i)
    nodes: list[int] = []
    at = -1
    while True:
        rejected: list[int] = []
        removed = 0.0  # p's mass on the rejected tokens: p' = p / (1 - removed) elsewhere
        for child in children.get(at, ()):
            token = tokens[child]
            if token in rejected:
                continue  # p'(token) = 0: a duplicate of a rejected sibling
            # left > 0: a rejection needs p(c) <= u * left < left, so removed stays below 1.
            left = 1.0 - removed
            if uniforms[child] * left < p_drafts[child]:  # u < p(c) / left
                break
            rejected.append(token)
            removed += p_drafts[child]
        else:
            return nodes, rejected
        nodes.append(child)
        at = child


def sampling_of(sampler: Sampler | None, key: mx.array | None, where: str) -> Sampler | None:
    """The sampler to sample the tree with, or None for greedy verification (no sampler, or a
    greedy one, with or without a key). Refuses a key without a sampler (the caller meant to
    sample and would silently get greedy) and keys that are not MLX PRNG keys."""
    if sampler is not None and not isinstance(sampler, Sampler):
        raise StateError(
            f"{where}: sampler must be a kvstate.speculative.Sampler or None; got "
            f"{type(sampler).__name__}"
        )
    if key is not None:
        if sampler is None:
            raise StateError(
                f"{where}: a key was given without a sampler; pass sampler=Sampler(temperature="
                "...) to sample (with no sampler the verification is greedy and uses no key)"
            )
        if not (isinstance(key, mx.array) and key.shape == (2,) and key.dtype == mx.uint32):
            shown = f"{key.dtype} {key.shape}" if isinstance(key, mx.array) else type(key).__name__
            raise StateError(
                f"{where}: key must be an mx.random.key(seed) (uint32, (2,)); got {shown}"
            )
    return None if sampler is None or sampler.greedy else sampler
