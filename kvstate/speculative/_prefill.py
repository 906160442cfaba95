"""The first forward of a generation: prompts of any lengths -> a batched state.

Prompts of one length run as one batched forward. Otherwise each prompt runs alone and the
states are merged (left-padded), each prompt's forward set evaluating as soon as it is built,
so the device works on it while the host builds the next one. Not a right-padded batch with `lengths=`: mlx-lm's nemotron_h mixers leave a wrong state in a
right-padded row (its own prepare / finalize give the same: BENCHMARKS.md, Findings).
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from .. import ModelState, merge, tree_flatten
from ._target import Target


def prefill(
    model: Target, prompts: Sequence[Sequence[int]], hidden: bool = False
) -> tuple[mx.array, ModelState, list[mx.array]]:
    """Run `prompts` through the wrapped `model` from empty states: each row's last logits
    (B, vocab), the batched state, and with `hidden` each prompt's final hidden states
    (1, n, D) (else an empty list)."""
    extra = {"hidden": True} if hidden else {}
    if len({len(p) for p in prompts}) == 1:
        batch = mx.array([list(p) for p in prompts])
        logits, state, *seen = model(batch, model.init_state(len(prompts)), **extra)
        hiddens = [seen[0][b : b + 1] for b in range(len(prompts))] if seen else []
        return logits[:, -1], state, hiddens
    lasts, states, hiddens = [], [], []
    for p in prompts:
        logits, state, *seen = model(mx.array([list(p)]), model.init_state(), **extra)
        lasts.append(logits[:, -1])
        states.append(state)
        hiddens += seen
        mx.async_eval(lasts[-1], *seen, *tree_flatten(state)[0])
    return mx.concatenate(lasts), merge(states), hiddens
