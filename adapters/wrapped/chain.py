"""`WrappedModel.chain`: one forward, then one-token forwards each fed a pick of the last
logits, on the model's own cache objects, read back into a state once.

What a drafter does with a draft model: `m(tokens, state)`, then `m(pick(logits), state)`
k - 1 times. Each wrapped call pays its host work (fit check, id check, reading every layer
back into a new state, vouching, keeping the caches), where mlx-lm's speculative loop just
calls the model on its caches. The chain pays it once per chain; its result (logits, picks
and state) is the result of that sequence of calls.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any, Protocol

import mlx.core as mx
import mlx.nn as nn

from kvstate import ModelState, ShapeError, TokenError
from kvstate.distributed import Placement
from kvstate.kinds import as_int

from ..instruments.buckets import Bucketing, bucketing
from .forward import open_caches, own_stamp, read_back
from .kept_caches import KeptCaches
from .tokens import ID_DTYPES, guarded, nan_where

Pick = Callable[[mx.array], mx.array]


class Chained(Protocol):
    """What a chain needs of the wrapped model it runs (`WrappedModel` is one)."""

    model: nn.Module
    placement: Placement | None
    bucketing: Bucketing
    kept: KeptCaches

    @property
    def vocab_size(self) -> int: ...

    def __call__(self, tokens: Any, state: ModelState) -> Any: ...

    def check_fits(self, state: Any) -> None: ...

    def checked_tokens(
        self, tokens: Any, state: ModelState
    ) -> tuple[mx.array, mx.array | None]: ...

    def adopt(self, state: ModelState, *outputs: mx.array) -> ModelState: ...


def chain(
    m: Chained, tokens: Any, state: ModelState, steps: int, pick: Pick
) -> tuple[mx.array, mx.array, ModelState]:
    """Run `tokens` (B, T) from `state`, then `steps - 1` one-token forwards, each fed
    `pick(last-position logits (B, vocab) of the previous forward)`; pick once more after
    the last forward.

    `pick` returns (B,) or (B, 1) integer ids (it may sample, `mx.async_eval` its ids, ...).
    Returns `(logits (B, steps, vocab) of each forward's last position, picks (B, steps),
    state)`, the state exactly as `m(tokens, state)` and the `m(pick, state)` calls give it
    (its last forward stamped, vouched for, its caches kept for the next plain forward).
    As in `m(...)`: an id outside the vocabulary (in `tokens`' last column, or a pick)
    gives NaN logits for the forward it was fed to, and the row's state must be discarded.
    `pick` sees the logits before that poisoning.

    The chain drops its reference to `state` once the caches are open: a caller that hands
    over its last one (`m.chain(t, self.take(), ...)`) lets MLX write the steps into the
    buffers in place instead of copying them (when they are evaluated during the chain).
    """
    n = _steps(steps)
    if m.placement is not None:
        # A split model's forwards are evaluated one by one (their collectives in order):
        # the calls themselves are exact.
        return _by_calls(m, tokens, state, n, pick)
    m.check_fits(state)
    ids, bad = m.checked_tokens(tokens, state)
    rows, width = ids.shape
    caches = m.kept.take(state)
    if caches is None:
        caches = open_caches(m.model, state)
    # Only kinds with their own `record_forward` read the layers before the forward: holding
    # no other layer leaves the state's buffers to the caches, updated in place by MLX.
    # After one-token forwards these are the layers before the chain, not before its last
    # forward: mlx-lm's kinds that have one (windows, cache lists) record nothing of it for
    # a one-token forward but its structure (mlx-vlm's pooled caches do: they go by calls).
    befores = [layer if own_stamp(layer) else None for layer in state.layers]
    del state
    policy = m.bucketing
    kernel_model = m.model if policy.kernel else None
    with bucketing(caches, kernel_model) if policy.enabled(width) else nullcontext():
        logits = m.model(ids, cache=caches)
    vocab = m.vocab_size
    lasts, picks, outside = [], [], []
    for step in range(n):
        last = logits[:, -1]
        lasts.append(last)
        y = _column(pick(last), rows)
        picks.append(y)
        if step + 1 < n:
            fed, bad_pick = guarded(y, vocab)  # the pick is the caller's: never unchecked
            outside.append(bad_pick)
            logits = m.model(fed, cache=caches)
    new = m.adopt(read_back(caches, befores, width if n == 1 else 1))
    m.kept.keep(new, caches)
    stacked = mx.stack(lasts, axis=1)
    if bad is not None or outside:  # one where for the chain: (B, n) ids each forward was fed
        first = mx.zeros((rows, 1), mx.bool_) if bad is None else bad[:, -1:]
        stacked = nan_where(mx.concatenate([first, *outside], axis=1), stacked)
    return stacked, _joined(picks), new


def _column(y: Any, rows: int) -> mx.array:
    """A pick as (B, 1) ids, refused unless it is B integer ids."""
    if type(y) is mx.array and y.dtype in ID_DTYPES:
        if y.shape == (rows, 1):
            return y
        if y.shape == (rows,):
            return y[:, None]
    shape = getattr(y, "shape", None)
    raise TokenError(
        f"chain: pick must return an mx.array of {rows} integer ids, shape ({rows},) or "
        f"({rows}, 1); got {type(y).__name__} {getattr(y, 'dtype', '')} of shape {shape}"
    )


def _joined(picks: list[mx.array]) -> mx.array:
    return picks[0] if len(picks) == 1 else mx.concatenate(picks, axis=1)


def chain_by_calls(
    m: Chained, tokens: Any, state: ModelState, steps: int, pick: Pick
) -> tuple[mx.array, mx.array, ModelState]:
    """`chain` as the sequence of wrapped calls it stands for (what an mlx-vlm model's chain
    is: its forwards go through its own `__call__`)."""
    return _by_calls(m, tokens, state, _steps(steps), pick)


def _steps(steps: Any) -> int:
    n = as_int(steps, "chain: steps", ShapeError)
    if n < 1:
        raise ShapeError(f"chain: steps must be an int >= 1; got {steps!r}")
    return n


def _by_calls(
    m: Chained, tokens: Any, state: ModelState, n: int, pick: Pick
) -> tuple[mx.array, mx.array, ModelState]:
    """The chain as the sequence of wrapped calls it stands for."""
    logits, state = m(tokens, state)
    rows = logits.shape[0]
    lasts, picks = [], []
    for step in range(n):
        last = logits[:, -1]
        lasts.append(last)
        picks.append(_column(pick(last), rows))
        if step + 1 < n:
            logits, state = m(picks[-1], state)
    return mx.stack(lasts, axis=1), _joined(picks), state
