"""Tree verification as a batch of paths: `tile` one sequence's state to P rows, verify P
candidate continuations in one forward, `row_select` the winner and commit its prefix.

Greedy: the winner is the path whose drafts the target agrees with longest, and its committed
state is the one a linear verify of that path gives. With a sampler: exact speculative
sampling over the candidates' trie (`tree_of_paths`; recursive rejection sampling,
`_tree_accept`), each trie node reading the logits of the first path that contains it; the
winner is the first path containing the deepest accepted node.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, cast

import mlx.core as mx

from .. import commit_prefix, distributed, row_select, tile, tree_map
from ._checks import checked_paths, checked_target, checked_token
from ._sampling import Sampler
from ._target import Target
from ._tree_accept import sample_tree, sampling_of
from ._trees import require_one_row, tree_of_paths


class PathVerdict(NamedTuple):
    path: int  # the index of the winning candidate
    accepted: int  # how many of its drafts the target accepted
    tokens: list[int]  # what to emit: the accepted drafts, then the target's next token
    state: Any  # batch 1: the last token and the accepted drafts committed
    logits: mx.array  # (accepted + 1, vocab): the target's logits at `last` and each accepted draft


def verify_paths(
    target: Target,
    state: Any,
    last: int,
    paths: Sequence[Sequence[int]],
    *,
    sampler: Sampler | None = None,
    key: mx.array | None = None,
) -> PathVerdict:
    """Verify candidate continuations `paths` (each a list of draft ids, lengths may differ)
    of a batch-1 `state` whose next input is `last`, in one forward of P rows (memory: P
    copies of the state while it runs). Greedy (no sampler, or a greedy one): the longest
    agreeing prefix wins. With a sampler: exact speculative sampling over the paths' trie,
    drawing from `key` (the global PRNG if None)."""
    vocab = checked_target(target, "verify_paths").vocab_size
    require_one_row(state, "verify_paths")
    last = checked_token(last, "verify_paths: last", vocab)
    paths = checked_paths(paths, vocab, "verify_paths")
    sampling = sampling_of(sampler, key, "verify_paths")
    span = max(len(p) for p in paths)
    rows = [[last, *p, *[0] * (span - len(p))] for p in paths]
    logits, verified, checkpoints = target(
        mx.array(rows, mx.int32), tile(state, len(paths)), capture=True
    )
    group = distributed.group_of(target)  # a split model: every rank must pick the same path
    if sampling is None:
        winner, accepted, follow = _greedy(logits, rows, paths, group)
    else:
        winner, accepted, follow = _sampled(logits, paths, sampling, key)
        if group is not None:
            winner, accepted, follow = distributed.agree(
                [winner, accepted, follow], group, what="verify_paths: the sampled path"
            )
    chosen = row_select(verified, winner)
    picked = tree_map(lambda c: c[winner : winner + 1], checkpoints)
    committed = commit_prefix(chosen, accepted + 1, picked)  # kept: the last token too
    emitted = [*paths[winner][:accepted], follow]
    return PathVerdict(winner, accepted, emitted, committed, logits[winner, : accepted + 1])


def _greedy(
    logits: mx.array, rows: list[list[int]], paths: Sequence[Sequence[int]], group: Any
) -> tuple[int, int, int]:
    """(winner, accepted, next token): the first of the longest agreeing prefixes."""
    span = len(rows[0]) - 1  # the longest path's drafts
    best = logits.argmax(-1)  # (P, span + 1): the target's pick after each input token
    drafts = mx.array(rows, mx.int32)[:, 1:]
    lengths = mx.array([len(p) for p in paths])
    agree = (best[:, :span] == drafts) & (mx.arange(span)[None] < lengths[:, None])
    agreed = mx.cumprod(agree.astype(mx.int32), axis=1).sum(1)
    accepted = cast(list[int], agreed.tolist())  # per path
    if group is not None:
        accepted = distributed.agree(accepted, group, what="verify_paths: the accepted counts")
    winner = max(range(len(paths)), key=lambda p: accepted[p])  # the first of the longest
    follow = cast(list[int], best[winner].tolist())
    return winner, accepted[winner], follow[accepted[winner]]


def _sampled(
    logits: mx.array, paths: Sequence[Sequence[int]], sampler: Sampler, key: mx.array | None
) -> tuple[int, int, int]:
    """(winner, accepted, next token) by sampling over the paths' trie. Trie node i reads the
    logits of the first path containing it (shared prefixes give the same logits up to
    rounding), at the column after its token; the winner is the first path containing the
    deepest accepted node, so its row holds the logits the final token was drawn from."""
    tokens, parents = tree_of_paths(paths)
    node_of = {(p, t): i for i, (p, t) in enumerate(zip(parents, tokens, strict=True))}
    row_of = [-1] * len(tokens)
    column_of = [0] * len(tokens)  # the input column of the node's token (1: the first draft)
    for r, path in enumerate(paths):
        at = -1
        for c, t in enumerate(path):
            at = node_of[at, int(t)]
            if row_of[at] == -1:
                row_of[at], column_of[at] = r, c + 1
    rows = mx.array([0, *row_of])
    columns = mx.array([0, *column_of])
    nodes, follow = sample_tree(sampler.probs(logits[rows, columns]), tokens, parents, sampler, key)
    return (row_of[nodes[-1]] if nodes else 0), len(nodes), follow
