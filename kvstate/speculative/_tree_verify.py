"""Tree verification over ONE copy of the prefix: a token tree of drafts in one forward.

The drafts form a tree: `tokens[i]` is a draft whose parent is draft `parents[i]` (-1: the
root, a child of `last`). One forward of `[last, *tokens]` with a tree attention mask, RoPE
at each token's depth and the recurrent layers following parent pointers
(`target.tree_forward`) gives, at every node, the logits a linear forward of its
root-to-node path gives. Greedy: a draft is accepted when its parent is (or it is a root)
and the target's pick after its parent is that draft; the deepest accepted node wins (the
first in tree order among equals), and exactly its path is committed. With a sampler: exact
speculative sampling over the tree (recursive rejection sampling, `_tree_accept`), every
emitted token distributed as the target alone would sample it; the accepted path is
committed the same way.

Against `verify_paths` (a batch of paths): one copy of the state instead of P, and shared
prefixes of the candidates computed once; the price is a commit that gathers the path's
KV entries into place.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, cast

import mlx.core as mx

from .._errors import StateError, TokenError
from .._ints import as_int, as_ints
from .._transforms import batch_size
from ._sampling import Sampler
from ._tree_accept import sample_tree, sampling_of
from ._tree_commit import commit_path


class TreeVerdict(NamedTuple):
    nodes: list[int]  # the accepted drafts, as tree indices from the root down
    accepted: int  # len(nodes)
    tokens: list[int]  # what to emit: the accepted drafts, then the target's next token
    state: Any  # batch 1: `last` and the accepted drafts committed
    logits: mx.array  # (accepted + 1, vocab): the target's logits at `last` and each accepted draft


def verify_tree(
    target: Any,
    state: Any,
    last: int,
    tokens: Sequence[int],
    parents: Sequence[int],
    *,
    sampler: Sampler | None = None,
    key: mx.array | None = None,
) -> TreeVerdict:
    """Verify a draft tree (`tokens[i]` with parent `parents[i]`, -1 for a root, parents
    listed before their children) of a batch-1 `state` whose next input is `last`, in one
    forward of 1 + len(tokens) tokens over one copy of the state. Greedy (no sampler, or a
    greedy one): the longest path the target agrees with wins. With a sampler: exact
    speculative sampling over the tree, drawing from `key` (the global PRNG if None).
    `target` is a wrapped model (`tree_forward`)."""
    if batch_size(state) != 1:
        raise StateError(f"verify_tree: takes a batch-1 state; got {batch_size(state)} rows")
    drafts, links = checked_tree(tokens, parents)
    sampling = sampling_of(sampler, key, "verify_tree")
    last = as_int(last, "verify_tree: last", TokenError)
    forward = getattr(target, "tree_forward", None)
    if forward is None:
        raise StateError(
            f"verify_tree: the target ({type(target).__name__}) has no tree_forward; pass a "
            "model wrapped by kvstate.adapters.wrap"
        )
    # Input position 0 is `last`; draft i sits at position i + 1.
    positions = [-1, *[p + 1 for p in links]]
    logits, verified, checkpoints = forward([[last, *drafts]], state, positions)
    if sampling is None:
        best = cast(list[int], logits[0].argmax(-1).tolist())  # the pick after each position
        nodes = _longest_agreeing(drafts, links, best)
        follow = best[nodes[-1] + 1 if nodes else 0]
    else:
        nodes, follow = sample_tree(sampling.probs(logits[0]), drafts, links, sampling, key)
    kept_positions = [0, *[i + 1 for i in nodes]]
    kept = commit_path(verified, kept_positions, checkpoints)
    emitted = [*[drafts[i] for i in nodes], follow]
    return TreeVerdict(nodes, len(nodes), emitted, kept, logits[0, mx.array(kept_positions)])


def tree_of_paths(paths: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
    """Candidate continuations -> the draft tree (tokens, parents) that shares their common
    prefixes (a trie, nodes in first-seen order)."""
    tokens: list[int] = []
    parents: list[int] = []
    children: dict[tuple[int, int], int] = {}
    for path in paths:
        at = -1
        for t in path:
            key = (at, int(t))
            if key not in children:
                children[key] = len(tokens)
                tokens.append(int(t))
                parents.append(at)
            at = children[key]
    return tokens, parents


def checked_tree(
    tokens: Sequence[int], parents: Sequence[int], where: str = "verify_tree"
) -> tuple[list[int], list[int]]:
    """A draft tree as lists of ints, checked (TokenError naming `where` otherwise)."""
    drafts, scalar = as_ints(tokens, f"{where}: tokens", TokenError)
    links, scalar_link = as_ints(parents, f"{where}: parents", TokenError)
    if scalar or scalar_link:
        raise TokenError(f"{where}: tokens and parents must be lists of ints, one per draft")
    if not drafts:
        raise TokenError(f"{where}: the tree is empty; give at least one draft")
    if len(links) != len(drafts):
        raise TokenError(
            f"{where}: {len(drafts)} tokens but {len(links)} parents; give one parent per token"
        )
    bad = [i for i, p in enumerate(links) if not -1 <= p < i]
    if bad:
        raise TokenError(
            f"{where}: parents {links[:16]} are not a tree listed parents first: draft(s) "
            f"{bad[:8]} point at themselves, at a later draft (a cycle or an order the forward "
            "cannot run) or below -1. List every parent before its children; -1 marks a root"
        )
    return drafts, links


def _longest_agreeing(drafts: list[int], parents: list[int], best: list[int]) -> list[int]:
    """The deepest node whose whole path the target agrees with, as its path of nodes."""
    depth = [0] * len(drafts)  # 0: not accepted; else the accepted path's length
    for i, p in enumerate(parents):
        if p == -1:
            depth[i] = 1 if best[0] == drafts[i] else 0
        elif depth[p] and best[p + 1] == drafts[i]:
            depth[i] = depth[p] + 1
    deepest = max(range(len(drafts)), key=lambda i: (depth[i], -i))
    return path_to(parents, deepest) if depth[deepest] else []


def path_to(parents: Sequence[int], node: int) -> list[int]:
    """The nodes from a root down to `node` (parents listed first, -1 marks a root)."""
    path = [node]
    while parents[path[-1]] != -1:
        path.append(parents[path[-1]])
    return path[::-1]
