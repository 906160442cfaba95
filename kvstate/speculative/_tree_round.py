"""One round of the generator in a tree mode: a drafter's candidate tree verified in one
forward, as a token tree over one copy of the state (`verify_tree`) or as a batch of its
root-to-leaf paths (`verify_paths`), batch 1."""

from __future__ import annotations

from typing import Any, NamedTuple, cast

import mlx.core as mx

from .._errors import TokenError
from ._drafter import DraftTree
from ._paths import PathVerdict, verify_paths
from ._sampling import Sampler
from ._tree_verify import TreeVerdict, checked_tree, path_to, verify_tree

TREE_MODES = ("tree", "paths")


class TreeRound(NamedTuple):
    state: Any  # the last token and the accepted drafts committed
    accepted: int
    tokens: list[int]  # emitted: the accepted drafts, then the target's next token
    fed: mx.array  # (1, 1 + depth) the last token and the winning path, for the drafter
    logits: mx.array  # (1, accepted + 1, vocab) what each emitted token was chosen from
    depth: int  # the tree's depth: every draft of a deepest path accepted when equal


def tree_round(
    mode: str,
    target: Any,
    state: Any,
    last: int,
    tree: DraftTree,
    sampler: Sampler,
    key: mx.array | None,
) -> TreeRound:
    # A malformed tree must not reach the path walk (a cycle would never end).
    tree = DraftTree(*checked_tree(tree.tokens, tree.parents, "generate: the drafter's tree"))
    vocab = getattr(target, "vocab_size", None)
    outside = [] if vocab is None else sorted({t for t in tree.tokens if not 0 <= t < vocab})
    if outside:  # both modes alike (paths would feed them as an mx.array: NaN, never kept)
        raise TokenError(
            f"generate: the drafter proposed token ids {outside[:8]} outside the target's "
            f"vocabulary (0..{cast(int, vocab) - 1})"
        )
    paths = root_to_leaf_paths(tree)
    verdict: PathVerdict | TreeVerdict
    if mode == "paths":
        verdict = verify_paths(target, state, last, paths, sampler=sampler, key=key)
        path = paths[verdict.path]
    else:
        verdict = verify_tree(
            target, state, last, tree.tokens, tree.parents, sampler=sampler, key=key
        )
        path = _path_through(tree, paths, verdict.nodes)
    return TreeRound(
        verdict.state,
        verdict.accepted,
        list(verdict.tokens),
        mx.array([[last, *path]], mx.int32),
        verdict.logits[None],
        max(len(p) for p in paths),
    )


def root_to_leaf_paths(tree: DraftTree) -> list[list[int]]:
    """Every root-to-leaf path of the tree as its tokens, leaves in tree order."""
    has_child = set(tree.parents)
    leaves = [i for i in range(len(tree.tokens)) if i not in has_child]
    return [[tree.tokens[n] for n in path_to(tree.parents, leaf)] for leaf in leaves]


def _path_through(tree: DraftTree, paths: list[list[int]], nodes: list[int]) -> list[int]:
    """A root-to-leaf path (as tokens) through the accepted nodes: the drafts the drafter
    proposed along the winning branch, rejected ones included."""
    accepted = [tree.tokens[i] for i in nodes]
    return next(p for p in paths if p[: len(accepted)] == accepted)
