"""One round of the generator in a tree mode: a drafter's candidate tree verified in one
forward, as a token tree over one copy of the state (`verify_tree`) or as a batch of its
root-to-leaf paths (`verify_paths`), batch 1."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from .. import TokenError
from ._drafter import DraftTree
from ._paths import PathVerdict, verify_paths
from ._round import Round
from ._sampling import Sampler
from ._target import Target
from ._tree_verify import TreeVerdict, verify_tree
from ._trees import checked_tree, root_to_leaf_paths

TREE_MODES = ("tree", "paths")


def tree_round(
    mode: str,
    target: Target,
    state: Any,
    last: int,
    tree: DraftTree,
    sampler: Sampler,
    key: mx.array | None,
    vocab: int | None,
) -> tuple[Any, Round]:
    """Verify `tree` (the drafter's candidates after `last`) from the batch-1 `state`, in
    `mode` ("tree" or "paths"): the state with the winning path's kept tokens committed, and
    the round (`fed` is the last token and the winning path, rejected drafts included).
    `key`: the round's draws (None when greedy); `vocab`: the target's vocabulary size, the
    drafted ids are checked against it (None: not checked)."""
    # A malformed tree must not reach the path walk (a cycle would never end).
    tree = DraftTree(*checked_tree(tree.tokens, tree.parents, "generate: the drafter's tree"))
    if vocab is not None:  # both modes alike (paths would feed them as an mx.array: NaN)
        outside = sorted({t for t in tree.tokens if not 0 <= t < vocab})
        if outside:
            raise TokenError(
                f"generate: the drafter proposed token ids {outside[:8]} outside the "
                f"target's vocabulary (0..{vocab - 1})"
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
    emitted = list(verdict.tokens)
    return verdict.state, Round(
        fed=mx.array([[last, *path]], mx.int32),
        logits=verdict.logits[None],
        accepted=[verdict.accepted],
        next_tokens=[emitted[-1]],
        drafts=[emitted[:-1]],
        hidden=None,
        span=max(len(p) for p in paths),
    )


def _path_through(tree: DraftTree, paths: list[list[int]], nodes: list[int]) -> list[int]:
    """A root-to-leaf path (as tokens) through the accepted nodes: the drafts the drafter
    proposed along the winning branch, rejected ones included."""
    accepted = [tree.tokens[i] for i in nodes]
    return next(p for p in paths if p[: len(accepted)] == accepted)
