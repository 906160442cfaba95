"""What a generator emits: tokens with their log-probabilities, each row cut at its budget and
its first end token."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import mlx.core as mx


class Token(NamedTuple):
    """One emitted token of row `row` (its index in the prompts), with the target's
    log-probabilities over the vocabulary at its position (mlx-lm's `logprobs`)."""

    row: int
    token: int
    logprobs: mx.array
    from_draft: bool


def logprobs_of(logits: mx.array) -> mx.array:
    logits = logits.astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def cut(tokens: list[Token], emitted: int, max_tokens: int, eos: Sequence[int]) -> list[Token]:
    """A row's tokens of one round, after `emitted` so far: up to `max_tokens` in all and
    through its first eos."""
    within = tokens[: max_tokens - emitted]
    for j, t in enumerate(within):
        if t.token in eos:
            return within[: j + 1]
    return within


def kept_drafts(drafts: Sequence[int], accepted: int, room: int, eos: Sequence[int]) -> int:
    """The accepted drafts a row keeps: at most `room` (the tokens it may still emit) and
    through its first end token. Its emitted tokens are then `drafts[:kept]` and, when
    `kept == accepted` and there is room, its next token."""
    kept = min(accepted, room)
    if eos:
        for j, t in enumerate(drafts[:kept]):
            if t in eos:
                return j + 1
    return kept


def finish(
    tokens: list[Token],
    emitted: list[int],
    max_tokens: int,
    eos: Sequence[int],
    rows: list[int] | None = None,
) -> list[bool]:
    """Add the round's `tokens` to `emitted[b]` (row b's tokens out so far, b the position
    of the row in `rows`: its prompt index when None); which rows are done (`max_tokens`
    reached, or eos)."""
    position = {row: i for i, row in enumerate(rows)} if rows is not None else None
    done = [False] * len(emitted)
    for t in tokens:
        i = position[t.row] if position is not None else t.row
        emitted[i] += 1
        done[i] = done[i] or t.token in eos
    return [d or e >= max_tokens for d, e in zip(done, emitted, strict=True)]
