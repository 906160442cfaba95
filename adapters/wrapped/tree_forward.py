"""The wrapped model's tree forward: T tokens whose parents form a tree, over ONE copy of the
prefix, in one forward of the model (the instruments that make the model follow the tree:
`instruments.tree`)."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import ExitStack
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from kvstate import ModelState
from kvstate.kinds import record_forward, trusted

from ..caches.registry import from_cache, to_cache
from ..instruments.buckets import AUTO, Bucketing, bucketing
from ..instruments.capture import Mixer, recording
from ..instruments.tree import Tree, attention_caches, check_followed, following, tree_checkpoints
from .forward import per_recurrent


def tree_run(
    model: nn.Module,
    tokens: mx.array,
    state: ModelState,
    parents: Sequence[int],
    mixers: list[tuple[nn.Module, Mixer]],
    ropes: list[nn.Module],
    policy: Bucketing = AUTO,
) -> tuple[mx.array, ModelState, Any]:
    """Run `tokens` (1, T) as a tree with `parents` (checked) from `state` (batch 1), the
    model's `mixers` and `ropes` (`rope_modules`): (logits (1, T, vocab), state with all T
    tokens appended, checkpoints by position). `policy`: where the key length is bucketed."""
    tree = Tree(parents)
    caches = [to_cache(layer) for layer in state.layers]
    attention = attention_caches(caches)
    width = tokens.shape[1]
    with ExitStack() as scope:
        if policy.enabled(width):  # first: the tree mask extends the bucketed one (CUDA)
            scope.enter_context(bucketing(caches))
        scope.enter_context(following(tree, ropes, attention))
        records = scope.enter_context(recording(mixers, caches))
        for record in records:
            record.tree = tree
        logits = model(tokens, cache=caches)
    check_followed(tree, attention, ropes, records)
    pairs = zip(caches, state.layers, strict=True)
    new = trusted(ModelState)(
        tuple(record_forward(from_cache(c, width), b, width) for c, b in pairs)
    )
    made = iter(records)
    checkpoints = per_recurrent(state, new, lambda b, a: tree_checkpoints(next(made), b, a))
    return logits, new, checkpoints
