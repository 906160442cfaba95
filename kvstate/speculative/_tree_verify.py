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

from .. import NotSupportedError, TokenError
from ..kinds import as_int
from ._sampling import Sampler
from ._target import Abilities, Target
from ._tree_accept import sample_tree, sampling_of
from ._tree_commit import commit_path
from ._trees import checked_tree, path_to, require_one_row


class TreeVerdict(NamedTuple):
    nodes: list[int]  # the accepted drafts, as tree indices from the root down
    accepted: int  # len(nodes)
    tokens: list[int]  # what to emit: the accepted drafts, then the target's next token
    state: Any  # batch 1: `last` and the accepted drafts committed
    logits: mx.array  # (accepted + 1, vocab): the target's logits at `last` and each accepted draft


def verify_tree(
    target: Target,
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
    `target` needs `tree_forward` (a `TreeTarget`: a wrapped model)."""
    require_one_row(state, "verify_tree")
    drafts, links = checked_tree(tokens, parents)
    sampling = sampling_of(sampler, key, "verify_tree")
    last = as_int(last, "verify_tree: last", TokenError)
    forward = Abilities.of(target).tree_forward
    if forward is None:
        raise NotSupportedError(
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
    committed = commit_path(verified, kept_positions, checkpoints)
    emitted = [*[drafts[i] for i in nodes], follow]
    return TreeVerdict(nodes, len(nodes), emitted, committed, logits[0, mx.array(kept_positions)])


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
