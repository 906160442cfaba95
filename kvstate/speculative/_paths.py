"""Tree verification as a batch of paths: `tile` one sequence's state to P rows, verify P
candidate continuations in one forward, `row_select` the winner and commit its prefix.

Exact for greedy decoding: the winner is the path whose drafts the target agrees with longest,
and its committed state is the one a linear verify of that path gives. (Exact sampling over
several candidate paths needs a multi-draft acceptance rule; not offered here.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, cast

import mlx.core as mx

from .. import distributed
from .._errors import StateError, TokenError
from .._transforms import batch_size, commit_prefix, row_select, tile
from .._tree import tree_map


class PathVerdict(NamedTuple):
    path: int  # the index of the winning candidate
    accepted: int  # how many of its drafts the target accepted
    tokens: list[int]  # what to emit: the accepted drafts, then the target's next token
    state: Any  # batch 1: the last token and the accepted drafts committed


def verify_paths(target: Any, state: Any, last: int, paths: Sequence[Sequence[int]]) -> PathVerdict:
    """Verify candidate continuations `paths` (each a list of draft ids, lengths may differ)
    of a batch-1 `state` whose next input is `last`, in one forward of P rows (memory: P
    copies of the state while it runs). Greedy: the longest agreeing prefix wins."""
    if batch_size(state) != 1:
        raise StateError(f"verify_paths: takes a batch-1 state; got {batch_size(state)} rows")
    if not paths or any(len(p) == 0 for p in paths):
        raise TokenError("verify_paths: give at least one path, each with at least one draft")
    width = max(len(p) for p in paths)
    rows = [[last, *p, *[0] * (width - len(p))] for p in paths]
    logits, verified, checkpoints = target(
        mx.array(rows, mx.int32), tile(state, len(paths)), capture=True
    )
    best = logits.argmax(-1)  # (P, width + 1): the target's pick after each input token
    drafts = mx.array(rows, mx.int32)[:, 1:]
    lengths = mx.array([len(p) for p in paths])
    agree = (best[:, :width] == drafts) & (mx.arange(width)[None] < lengths[:, None])
    accepted = mx.cumprod(agree.astype(mx.int32), axis=1).sum(1)
    counts = cast(list[int], accepted.tolist())
    group = distributed.group_of(target)  # a split model: every rank must pick the same path
    if group is not None:
        counts = distributed.agree(counts, group, what="verify_paths: the accepted counts")
    winner = max(range(len(paths)), key=lambda p: counts[p])  # the first of the longest
    count = counts[winner]
    chosen = row_select(verified, winner)
    picked = tree_map(lambda c: c[winner : winner + 1], checkpoints)
    kept = commit_prefix(chosen, count + 1, picked)
    follow = cast(list[int], best[winner].tolist())
    return PathVerdict(winner, count, [*paths[winner][:count], follow[count]], kept)
