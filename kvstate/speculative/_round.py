"""What one round of the generator gives back (`Round`), and what every round of one
generation does alike (`RoundPlan`). The words are the package glossary's
(`kvstate.speculative`)."""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx


class Round(NamedTuple):
    """The outcome of one round, for B rows (a tree round: B = 1), besides the committed
    state (each round function returns `(state, Round)`: a Round kept by the generator would
    otherwise hold the state while the next verify runs, and MLX would copy every KV buffer
    instead of writing into it).

    fed: (B, 1 + span) int32, the target's input: each row's last token, then its drafts
        (a tree round: the winning path's drafts, rejected ones included); what
        `Drafter.accept` takes.
    logits: (B, >= 1 + max(accepted), vocab), the target's logits after each fed token: the
        distribution of row b's token j is `logits[b, j]`.
    accepted: accepted[b], the drafts the target agreed with (0 .. drafted[b]).
    next_tokens: row b's bonus / next token, the target's own pick after its accepted
        drafts; in no state yet (the next round feeds it first).
    drafts: row b's emitted drafts are `drafts[b][: accepted[b]]`.
    hidden: (B, 1 + span, D) the target's final hidden states over `fed`, when the drafter
        uses them; else None.
    span: the drafts verified in this round, max(drafted[b]) (a tree round: the tree's
        depth); 0 for a plain step. Every row accepting `span` drafts grows the depth.
    """

    fed: mx.array
    logits: mx.array
    accepted: list[int]
    next_tokens: list[int]
    drafts: list[list[int]]
    hidden: mx.array | None
    span: int

    @property
    def tokens(self) -> list[list[int]]:
        """Row b's tokens of this round: its accepted drafts, then its next token."""
        return [
            [*d[:a], t]
            for d, a, t in zip(self.drafts, self.accepted, self.next_tokens, strict=True)
        ]

    @property
    def kept(self) -> list[int]:
        """kept[b] = accepted[b] + 1: row b's last token and its accepted drafts, the tokens
        of `fed` that stay in the state (what `commit_prefix` and `Drafter.accept` take)."""
        return [a + 1 for a in self.accepted]


class RoundPlan(NamedTuple):
    """What every round of one generation does alike, decided once from the target's state
    after the prefill (`filter` keeps the kinds) and from the drafter."""

    capture: bool  # the verify returns checkpoints: some part of the state needs them
    keep_before: bool  # a commit can be refused (pooled windows): keep the state before it
    hidden: bool  # the drafter uses the target's final hidden states (`uses_hidden`)
