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
    """A row's tokens of one round, up to its budget and through its first eos."""
    kept = tokens[: max_tokens - emitted]
    for j, t in enumerate(kept):
        if t.token in eos:
            return kept[: j + 1]
    return kept


def finish(
    tokens: list[Token],
    counts: list[int],
    max_tokens: int,
    eos: Sequence[int],
    rows: list[int] | None = None,
) -> list[bool]:
    """Count each row's emitted tokens; which rows are done (budget reached or eos)."""
    position = {row: i for i, row in enumerate(rows)} if rows is not None else None
    done = [False] * len(counts)
    for t in tokens:
        i = position[t.row] if position is not None else t.row
        counts[i] += 1
        done[i] = done[i] or t.token in eos
    return [d or c >= max_tokens for d, c in zip(done, counts, strict=True)]
