"""A prompt's forward the way mlx-lm's `generate_step` runs it: in chunks, each evaluated as it
is built, the output projection at the last position only.

All positions but the last run in chunks of `step` tokens (mlx-lm's `prefill_step_size`).
After each chunk its state (and, with `projections`, its final hidden states) is evaluated
and its logits are dropped unevaluated: MLX computes nothing that only they need, so the
output projection never runs over the chunk, and the chunk's activations are freed before
the next chunk is built. The last position then runs as a one-token forward, the only one
whose logits are computed. That is mlx-lm's schedule (`prompt[:-1]` in chunks, `mx.eval` of
the caches, `mx.clear_cache`, then the last token), so it asks nothing of the model's
structure: every architecture takes it, the final hidden states included (recorded at the
output projection's input, `instruments.hidden`, which sees the input even though the
projection itself is never evaluated).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import mlx.core as mx
import mlx.nn as nn

from kvstate import ModelState, StateError, tree_flatten
from kvstate.kinds import as_int

from ..caches.registry import to_cache
from ..instruments.buckets import Bucketing
from ..instruments.hidden import Projection
from .forward import run
from .tokens import nan_where, poisoned

PREFILL_STEP = 2048  # mlx-lm's generate_step default (`prefill_step_size`)

Progress = Callable[[int, int], None]
"""`progress(processed, total)`: prompt tokens (rows x positions) through the model so far."""

# A chunk of up to `step` tokens is no verify: its keys are not bucketed (on CUDA the
# buckets serve a verify's ever-new key length; a chunk attends with mlx-lm's own causal
# mask, as in generate_step).
_CHUNKS = Bucketing(force=False)


class Prefilled(NamedTuple):
    logits: mx.array  # (B, vocab) at the last position, evaluated
    state: ModelState  # adopted (see `Adopt`), evaluated
    hidden: mx.array | None  # (B, L, D) with projections, evaluated
    caches: list[Any]  # the last forward's cache objects, holding `state`


Adopt = Callable[..., ModelState]
"""`adopt(state, *outputs)`: the wrapped model's `adopt` (vouch, mark a split model's rank)."""

ModelAt = Callable[[int, int, bool], nn.Module]
"""`model_at(start, end, last)`: what runs positions start..end-1 (`last`: the final
one-token forward), called as `model(tokens, cache=caches) -> logits`."""


def checked_step(step: Any) -> int:
    """`step` as an int >= 1, or a StateError."""
    n = as_int(step, "prefill: step (prefill_step_size)", StateError)
    if n < 1:
        raise StateError(f"prefill: step (prefill_step_size) must be an int >= 1; got {step!r}")
    return n


def chunked(
    model_at: ModelAt,
    ids: mx.array,
    bad: mx.array | None,
    state: ModelState,
    *,
    step: int,
    progress: Progress | None,
    adopt: Adopt,
    convert: Callable[[Any], Any] = to_cache,
    caches: list[Any] | None = None,
    projections: list[Projection] | None = None,
) -> Prefilled:
    """Run checked `ids` (B, L) from `state` in chunks of `step` positions, then the last
    position alone (see the module docstring). `bad` (B, L): ids outside the vocabulary
    (None: none): a row with any gets NaN last logits (its state holds id 0 there; discard
    it). `caches`: cache objects already holding `state` (else opened with `convert`).
    `progress(processed, total)` is called with 0 first, after every chunk and with the
    total once everything is evaluated; processed counts rows x positions."""
    rows, width = ids.shape
    total = rows * width
    report = progress or _silent
    report(0, total)
    hiddens: list[mx.array] = []
    done = 0
    while width - done > 1:
        n = min(step, width - 1 - done)
        out = run(
            model_at(done, done + n, False),
            ids[:, done : done + n],
            state,
            convert=convert,
            projections=projections,
            caches=caches,
            policy=_CHUNKS,
        )
        state, caches = out.state, out.caches
        if out.hidden is not None:
            hiddens.append(out.hidden)
        del out  # with it the chunk's logits: never evaluated, never computed
        mx.eval(*tree_flatten(state)[0], *hiddens[-1:])
        mx.clear_cache()  # as generate_step: the chunk's buffers go back to the system
        done += n
        report(rows * done, total)
    out = run(
        model_at(done, width, True),
        ids[:, done:],
        state,
        convert=convert,
        projections=projections,
        caches=caches,
        policy=_CHUNKS,
    )
    del state
    logits = out.logits[:, -1]
    if bad is not None:
        logits = nan_where(bad.any(axis=1), logits)
    hidden = None
    if out.hidden is not None:
        hidden = poisoned(mx.concatenate([*hiddens, out.hidden], axis=1), bad)
    new = adopt(out.state, logits)
    mx.eval(logits, *tree_flatten(new)[0], *([] if hidden is None else [hidden]))
    report(total, total)
    assert out.caches is not None
    return Prefilled(logits, new, hidden, out.caches)


def _silent(processed: int, total: int) -> None:
    pass
