"""Draft trees as lists: `tokens[i]` is a draft whose parent is draft `parents[i]` (-1: a
root, following the row's last token), parents listed before their children. Checking one,
building one from candidate paths, and walking it: what drafters and tree rounds share."""

from __future__ import annotations

from collections.abc import Sequence

from .. import NotSupportedError, TokenError, batch_size
from ..kinds import as_ints
from ._drafter import DraftTree
from ._values import ids


def tree_of_paths(paths: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
    """Candidate continuations -> the draft tree (tokens, parents) that shares their common
    prefixes (a trie, nodes in first-seen order). `paths`: a list of lists of ids (none:
    the empty tree)."""
    if isinstance(paths, (str, bytes)) or not isinstance(paths, (list, tuple)):
        raise TokenError(f"tree_of_paths: paths must be a list of lists of ids; got {paths!r:.60}")
    paths = [ids(p, f"tree_of_paths: paths[{i}]", None) for i, p in enumerate(paths)]
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


def path_to(parents: Sequence[int], node: int) -> list[int]:
    """The nodes from a root down to `node` (parents listed first, -1 marks a root)."""
    path = [node]
    while parents[path[-1]] != -1:
        path.append(parents[path[-1]])
    return path[::-1]


def root_to_leaf_paths(tree: DraftTree) -> list[list[int]]:
    """Every root-to-leaf path of the tree as its tokens, leaves in tree order."""
    has_child = set(tree.parents)
    leaves = [i for i in range(len(tree.tokens)) if i not in has_child]
    return [[tree.tokens[n] for n in path_to(tree.parents, leaf)] for leaf in leaves]


def require_one_row(state: object, where: str) -> None:
    """Tree verification runs over one sequence: NotSupportedError for a batched state."""
    rows = batch_size(state)
    if rows != 1:
        raise NotSupportedError(f"{where}: takes a batch-1 state; got {rows} rows")
