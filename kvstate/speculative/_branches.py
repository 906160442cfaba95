"""A draft model's token tree: which first tokens to branch on, and which branch the target
kept. `ModelDrafter.propose_tree` drafts one row per branch; this is its bookkeeping."""

from __future__ import annotations

from typing import Any, NamedTuple

import mlx.core as mx

from .. import ShapeError
from ._sampling import Sampler


class Branches(NamedTuple):
    """A tree proposal of a batch-1 draft state: one draft row per branch."""

    after: Any  # (B rows) after the pending draft, the last token and drafts 1..depth-1
    paths: list[list[int]]  # the proposed paths (the depth drafts of each row worth a branch)
    rows: list[int]  # the draft row of each path
    pending: mx.array | None  # (1, 1) the last round's kept final draft, fed first
    depth: int  # the drafts of each path


def first_picks(
    logits: mx.array, n: int, sampler: Sampler, key: mx.array
) -> tuple[mx.array, mx.array | None]:
    """`n` distinct first tokens from one row's `logits` (vocab,), as (n,) int32 ids.

    Greedy: the n most likely, most likely first (branch 0 is the linear draft). Sampling:
    n draws without replacement from the sampler's distribution (Gumbel top-n), with their
    probabilities (n,) so that tokens it gives no mass can be dropped. The target treats
    tree drafts as point masses: any choice made without the target keeps sampling exact.
    """
    vocab = logits.shape[-1]
    if n > vocab:
        raise ShapeError(f"ModelDrafter: {n} branches but a vocabulary of {vocab}; use fewer")
    if sampler.greedy:
        return mx.argsort(-logits)[:n].astype(mx.int32), None
    q = sampler.probs(logits)
    scores = mx.log(q) + mx.random.gumbel(q.shape, key=key)
    ids = mx.argsort(-scores)[:n].astype(mx.int32)
    return ids, q[ids]


def matching_path(branches: Branches, drafts: list[int]) -> int | None:
    """The first proposed path that starts with `drafts` (the kept ones), or None."""
    n = len(drafts)
    return next((i for i, p in enumerate(branches.paths) if p[:n] == drafts), None)
