"""The first forward of a generation: prompts of any lengths -> a batched state, as mlx-lm's
`generate_step` prefills (chunks of `step` positions, each evaluated as it is built; the
output projection at each row's last position only).

A target with `prefill` (`PrefillTarget`: a wrapped model) runs its own; any other target
gets the same schedule through its calls (`prefill_by_calls`). Prompts of one length run as
one batched prefill. Otherwise each prompt runs alone and the states are merged
(left-padded). Not a right-padded batch with `lengths=`: mlx-lm's nemotron_h mixers leave a
wrong state in a right-padded row (its own prepare / finalize give the same: BENCHMARKS.md,
Findings).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx

from .. import ModelState, StateError, merge, tree_flatten
from ..kinds import as_int
from ._target import Abilities, Progress, Target

PREFILL_STEP = 2048  # mlx-lm's generate_step default (`prefill_step_size`)


def prefill(
    model: Target,
    prompts: Sequence[Sequence[int]],
    hidden: bool = False,
    *,
    step: int = PREFILL_STEP,
    progress: Progress | None = None,
) -> tuple[mx.array, ModelState, list[mx.array]]:
    """Run `prompts` through the wrapped `model` from empty states: each row's last logits
    (B, vocab), the batched state, and with `hidden` each prompt's final hidden states
    (1, n, D) (else an empty list). `step`: positions per chunk (mlx-lm's
    `prefill_step_size`). `progress(processed, total)`: prompt tokens through the model (all
    rows together), 0 first and `total` last."""
    n = as_int(step, "prefill_step_size", StateError)
    if n < 1:
        raise StateError(f"prefill_step_size must be an int >= 1; got {step!r}")
    run = Abilities.of(model).prefill or (lambda *a, **kw: prefill_by_calls(model, *a, **kw))
    extra = {"hidden": True} if hidden else {}
    total = sum(len(p) for p in prompts)
    if len({len(p) for p in prompts}) == 1:
        batch = mx.array([list(p) for p in prompts])
        logits, state, *seen = run(
            batch, model.init_state(len(prompts)), step=n, progress=progress, **extra
        )
        hiddens = [seen[0][b : b + 1] for b in range(len(prompts))] if seen else []
        return logits, state, hiddens
    if progress is not None:
        progress(0, total)
    lasts, states, hiddens = [], [], []
    before = 0
    for p in prompts:
        logits, state, *seen = run(
            mx.array([list(p)]),
            model.init_state(),
            step=n,
            progress=None if progress is None else _after(progress, before, total),
            **extra,
        )
        lasts.append(logits)
        states.append(state)
        hiddens += seen
        before += len(p)
    return mx.concatenate(lasts), merge(states), hiddens


def _after(progress: Progress, before: int, total: int) -> Progress:
    """One row's progress as the batch's: `before` tokens of earlier rows are done (its own
    0 is not reported again)."""

    def report(processed: int, _: int) -> None:
        if processed:
            progress(before + processed, total)

    return report


def prefill_by_calls(
    model: Target,
    tokens: mx.array,
    state: Any,
    *,
    step: int = PREFILL_STEP,
    progress: Progress | None = None,
    hidden: bool = False,
) -> tuple[Any, ...]:
    """`PrefillTarget.prefill` through a target's plain calls: `tokens` (B, L) from `state`,
    positions 0..L-2 in chunks of `step` (each chunk's state evaluated and its logits
    dropped unevaluated), then the last position alone. Returns `(last logits (B, vocab),
    state[, hidden (B, L, D)])`, evaluated."""
    rows, width = tokens.shape
    total = rows * width
    report: Callable[[int, int], None] = progress or (lambda processed, total: None)
    report(0, total)
    extra = {"hidden": True} if hidden else {}
    hiddens: list[mx.array] = []
    done = 0
    while width - done > 1:
        chunk = min(step, width - 1 - done)
        _, state, *seen = model(tokens[:, done : done + chunk], state, **extra)
        hiddens += seen
        mx.eval(*tree_flatten(state)[0], *seen)
        mx.clear_cache()
        done += chunk
        report(rows * done, total)
    logits, state, *seen = model(tokens[:, done:], state, **extra)
    last = logits[:, -1]
    joined = [mx.concatenate([*hiddens, *seen], axis=1)] if seen else []
    mx.eval(last, *tree_flatten(state)[0], *joined)
    report(total, total)
    return (last, state, *joined)
