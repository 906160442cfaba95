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
from ._kv_quantization import KVQuantization
from ._target import Abilities, Progress, Target

PREFILL_STEP = 2048  # mlx-lm's generate_step default (`prefill_step_size`)


Fresh = Callable[[int], Any]
"""`fresh(batch)`: an empty state for `batch` rows (the target's `init_state`)."""


def prefill(
    model: Target,
    prompts: Sequence[Sequence[int]],
    hidden: bool = False,
    *,
    step: int = PREFILL_STEP,
    progress: Progress | None = None,
    states: Sequence[Any] | None = None,
    fresh: Fresh | None = None,
    quantization: KVQuantization | None = None,
) -> tuple[mx.array, ModelState, list[mx.array]]:
    """Run `prompts` through the wrapped `model`, each from its row of `states` (a batch-1
    state, or None: an empty one; None: every row empty): each row's last logits
    (B, vocab), the batched state, and with `hidden` each prompt's final hidden states
    (1, n, D) (else an empty list). `step`: positions per chunk (mlx-lm's
    `prefill_step_size`). `progress(processed, total)`: prompt tokens through the model (all
    rows together), 0 first and `total` last. `fresh(batch)`: the empty states (default
    `model.init_state`); `quantization`: kv_bits, checked after every forward (the chunks
    then run through the model's calls, `prefill_by_calls`, so that it runs between
    them)."""
    n = as_int(step, "prefill_step_size", StateError)
    if n < 1:
        raise StateError(f"prefill_step_size must be an int >= 1; got {step!r}")
    starts = list(states) if states is not None else [None] * len(prompts)
    batched = len({len(p) for p in prompts}) == 1 and all(s is None for s in starts)
    own = Abilities.of(model).prefill if quantization is None else None
    between = None
    if quantization is not None:  # the batch's check; rows prefilled apart: one each
        between = quantization.after if batched else quantization.check
    run = own or (lambda *a, **kw: prefill_by_calls(model, *a, between=between, **kw))
    empty = fresh or model.init_state
    extra = {"hidden": True} if hidden else {}
    total = sum(len(p) for p in prompts)
    if batched:
        batch = mx.array([list(p) for p in prompts])
        logits, state, *seen = run(batch, empty(len(prompts)), step=n, progress=progress, **extra)
        hiddens = [seen[0][b : b + 1] for b in range(len(prompts))] if seen else []
        return logits, state, hiddens
    if progress is not None:
        progress(0, total)
    lasts, rows, hiddens = [], [], []
    before = 0
    for p, start in zip(prompts, starts, strict=True):
        logits, state, *seen = run(
            mx.array([list(p)]),
            empty(1) if start is None else start,
            step=n,
            progress=None if progress is None else _after(progress, before, total),
            **extra,
        )
        lasts.append(logits)
        rows.append(state)
        hiddens += seen
        before += len(p)
    if quantization is not None and len({_kinds(r) for r in rows}) > 1:
        # Rows of one batch are of one kind: all quantized, once the longest is.
        rows = [quantization.everywhere(r) for r in rows]
    return mx.concatenate(lasts), rows[0] if len(rows) == 1 else merge(rows), hiddens


def _kinds(state: Any) -> tuple[str, ...]:
    """The kinds of `state`'s layers, in order (a layer of parts as its own kind name)."""
    return tuple(type(p).__name__ for p in getattr(state, "parts", (state,)))


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
    between: Callable[[Any], Any] | None = None,
) -> tuple[Any, ...]:
    """`PrefillTarget.prefill` through a target's plain calls: `tokens` (B, L) from `state`,
    positions 0..L-2 in chunks of `step` (each chunk's state evaluated and its logits
    dropped unevaluated), then the last position alone; `between(state)` after each of
    those forwards. Returns `(last logits (B, vocab), state[, hidden (B, L, D)])`,
    evaluated."""
    after = between or _same
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
        state = after(state)
        hiddens += seen
        mx.eval(*tree_flatten(state)[0], *seen)
        mx.clear_cache()
        done += chunk
        report(rows * done, total)
    logits, state, *seen = model(tokens[:, done:], state, **extra)
    state = after(state)
    last = logits[:, -1]
    joined = [mx.concatenate([*hiddens, *seen], axis=1)] if seen else []
    mx.eval(last, *tree_flatten(state)[0], *joined)
    report(total, total)
    return (last, state, *joined)


def _same(state: Any) -> Any:
    return state
