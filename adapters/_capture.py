"""The capturing forward: `logits, state, checkpoints = wrapped(tokens, state, capture=True)`.

Approach (correct for any model, whatever its recurrent layers compute):

1. Run the K tokens as one forward, exactly as `capture=False` does: the logits and the new
   state are the very values a plain verify forward gives (KV layers appended K tokens,
   window kinds keep `previous`, every part has `appended=K`).
2. Replay tokens 0..K-2 one at a time from the state before the verify, keeping only the
   recurrent arrays after each token (the rest of each replayed state is dropped at once, so
   MLX can update the replay's KV buffers in place instead of copying them every step).
3. Stack, per recurrent array, [before, after 1, ..., after K-1, after K] along axis 1:
   (B, K+1, ...). Entry K is the verify forward's own array, so accepting all K tokens gives
   exactly the plain forward's state; entries 1..K-1 come from single-token steps, which is
   how an un-speculated decode would have computed them.

Cost: one K-token forward plus K-1 single-token forwards (nothing extra when K = 1), and one
copy of the KV buffers when the caller keeps the state it passed in. An array that is None
before the verify (a layer never run) is checkpointed as zeros, which is what every mlx-lm
recurrent layer reads None as.

Checkpoints mirror the state: a tuple per layer of a ModelState, a tuple per part of a
ListState, a tuple of (B, K+1, ...) arrays per RecurrentState (None where the state's array
is None), and None for every non-recurrent part.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import mlx.core as mx

from kvstate import ListState, ModelState, RecurrentState

if TYPE_CHECKING:
    from ._wrap import WrappedModel


def recurrent_arrays(state: Any) -> Any:
    """The recurrent arrays of a state, in the checkpoints' structure (None elsewhere)."""
    if isinstance(state, ModelState):
        return tuple(recurrent_arrays(s) for s in state.layers)
    if isinstance(state, ListState):
        return tuple(recurrent_arrays(s) for s in state.states)
    if isinstance(state, RecurrentState):
        return state.arrays
    return None


def _stack(steps: list[Any], final: Any) -> Any:
    """Stack per-step structures (from `recurrent_arrays`) along a new axis 1."""
    if final is None:
        return None
    if isinstance(final, tuple):
        return tuple(_stack([s[i] for s in steps], f) for i, f in enumerate(final))
    # An array: None before the first forward means zeros to every recurrent layer.
    filled = [mx.zeros_like(final) if s is None else s.astype(final.dtype) for s in steps]
    return mx.stack(filled, axis=1)


def forward_capturing(
    wrapped: WrappedModel, tokens: mx.array, state: ModelState
) -> tuple[mx.array, ModelState, Any]:
    """A verify forward of `tokens` (B, K) that also returns recurrent checkpoints.

    Returns `(logits (B, K, vocab), new_state, checkpoints)`; pass `checkpoints` to
    `commit_prefix(new_state, accepted, checkpoints)`.
    """
    logits, final = wrapped.forward(tokens, state)
    steps = [recurrent_arrays(state)]
    current = state
    for t in range(tokens.shape[1] - 1):
        _, current = wrapped.forward(tokens[:, t : t + 1], current)
        steps.append(recurrent_arrays(current))
    del current  # only the recurrent arrays are kept; the replayed KV buffers are not
    last = recurrent_arrays(final)
    steps.append(last)
    return logits, final, _stack(steps, last)
