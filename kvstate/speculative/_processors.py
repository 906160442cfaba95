"""Logits processors, as mlx-lm's `generate_step(logits_processors=...)` takes them: callables
`processor(tokens, logits) -> logits`, `tokens` (T,) the ids of the row so far (its history
and prompt, then what it emitted, through the token the logits follow) and `logits` (1,
vocab) one position's; applied in order before the sampler (and before the log-probabilities
a Token carries), as mlx-lm applies them. `mlx_lm.sample_utils.make_logits_processors`
(repetition, presence and frequency penalties, logit bias) gives such a list.

With speculation every verified position is processed with the tokens before it (the row's
history, then its last token and drafts up to that position), so the acceptance rule, greedy
or sampled, compares the drafts against the processed distributions, exactly as a plain
decode would draw. A processor must therefore be a function of its two arguments: it is
called once per row and position, drafts the target then rejects included.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import mlx.core as mx

Processor = Callable[[mx.array, mx.array], mx.array]


class Processors:
    """The processors of a generation and each live row's tokens so far (on the device)."""

    def __init__(self, processors: Sequence[Processor], histories: list[list[int]]) -> None:
        self.processors = list(processors)
        self.tokens = [mx.array(h, mx.int32) for h in histories]

    def _apply(self, tokens: mx.array, logits: mx.array) -> mx.array:
        for processor in self.processors:
            logits = processor(tokens, logits)
        return logits

    def first(self, logits: mx.array) -> mx.array:
        """The prefill's last logits (B, vocab), each row's after its tokens so far."""
        return mx.concatenate(
            [self._apply(t, logits[b : b + 1]) for b, t in enumerate(self.tokens)], axis=0
        )

    def step(self, logits: mx.array, fed: mx.array) -> mx.array:
        """A plain step's logits (B, vocab) after `fed` (B,) (unread: no sync), which joins
        each row's tokens."""
        fed = fed.astype(mx.int32)
        self.tokens = [mx.concatenate([t, fed[b : b + 1]]) for b, t in enumerate(self.tokens)]
        return self.first(logits)

    def verify(self, logits: mx.array, fed: mx.array) -> mx.array:
        """A verify's logits (B, T, vocab) over `fed` (B, T): position j of row b processed
        after the row's tokens and fed[b, :j + 1]. The tokens do not change (`commit`)."""
        rows = []
        for b, t in enumerate(self.tokens):
            seen = mx.concatenate([t, fed[b].astype(mx.int32)])
            n = t.shape[0]
            rows.append(
                mx.concatenate(
                    [
                        self._apply(seen[: n + j + 1], logits[b, j : j + 1])
                        for j in range(fed.shape[1])
                    ],
                    axis=0,
                )
            )
        return mx.stack(rows)

    def commit(self, fed: mx.array, kept: list[int]) -> None:
        """Row b keeps fed[b, :kept[b]] (its last token and accepted drafts)."""
        fed = fed.astype(mx.int32)
        self.tokens = [mx.concatenate([t, fed[b, : kept[b]]]) for b, t in enumerate(self.tokens)]

    def keep(self, rows: list[int]) -> None:
        """Only the rows at positions `rows` stay, in this order."""
        self.tokens = [self.tokens[i] for i in rows]
