"""Re-running kept tokens from the state before a forward: the exact rollback for states
whose `commit_prefix` can be refused (a pooled window the forward completed)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from .. import capabilities, extract, merge
from ..kinds import Composite
from ._target import Target


def commit_may_be_refused(state: Any) -> bool:
    """Whether some part of `state` rolls back neither by a trim nor from checkpoints but from
    its own record of the forward, which a longer forward can outgrow (`PooledKV`: the kept
    tokens end inside a window the forward pooled), or cannot roll back its last forward.
    A property of the kinds: decided once per generation, whatever the prompt's length."""
    if isinstance(state, Composite):
        return any(commit_may_be_refused(p) for p in state.parts)
    caps = capabilities(state)
    return not caps.can_roll_back or not (caps.trimmable or caps.needs_checkpoints)


def run_kept(model: Target, before: Any, tokens: mx.array, kept: list[int]) -> Any:
    """`before` (the state a forward of `tokens` (B, T) started from) advanced by each row's
    first `kept[b]` tokens, through `model`: what decoding only those tokens gives.

    One forward when every row kept the same number; otherwise one forward per row from its
    extracted row, merged again (a ragged commit of one forward is what was refused)."""
    if len(set(kept)) == 1:
        return model(tokens[:, : kept[0]], before)[1]
    rows = [_advanced(model, extract(before, b), tokens[b : b + 1, :n]) for b, n in enumerate(kept)]
    return merge(rows)


def _advanced(model: Target, state: Any, tokens: mx.array) -> Any:
    return model(tokens, state)[1] if tokens.shape[1] else state
