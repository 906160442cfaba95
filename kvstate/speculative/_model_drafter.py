"""A draft model as a drafter: any wrapped model with the target's vocabulary."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from .._transforms import commit_prefix, filter, merge
from ._drafter import Proposal
from ._sampling import Sampler


class ModelDrafter:
    """Drafts k tokens per row with a smaller model, one token at a time, and keeps the draft
    model's state in step with the target's.

    After the verify, if every row kept the same number of tokens and that number reaches
    the drafts the model already ran through (k of k + 1: the last token and all drafts but
    the final one), the proposing state is the kept state as it is (the final draft, when
    kept, is fed at the start of the next proposal). Otherwise the kept tokens run through
    the draft model again from the state before the proposal: one plain forward when every
    row kept the same number, one capturing forward and a ragged `commit_prefix` when rows
    differ, so hybrid and recurrent draft models stay exact too.

    `draft`: a wrapped model (`kvstate.adapters.wrap(model)`).
    """

    def __init__(self, draft: Any, seed: int = 0) -> None:
        self.draft = draft
        self.key = mx.random.key(seed)
        self.state: Any = None  # holds every token the target kept, but `pending`
        self.pending: mx.array | None = None  # (B, 1) a kept final draft not yet fed
        self._proposal: tuple[Any, mx.array, mx.array | None, int] | None = None

    def start(self, prompts: list[list[int]]) -> None:
        states = [self.draft(mx.array([p]), self.draft.init_state())[1] for p in prompts]
        self.state = states[0] if len(states) == 1 else merge(states)
        self.pending, self._proposal = None, None

    def propose(self, last: list[int], k: int, sampler: Sampler) -> Proposal:
        prefix = self.pending
        y = mx.array(last, mx.int32)[:, None]
        if prefix is not None:
            y = mx.concatenate([prefix, y], axis=1)
        state, tokens, probs = self.state, [], []
        for _ in range(k):
            logits, state = self.draft(y, state)
            q = sampler.probs(logits[:, -1])
            self.key, key = mx.random.split(self.key)
            y = sampler.sample(q, key)[:, None]
            tokens.append(y)
            probs.append(q[:, None])
        self._proposal = (state, y, prefix, k)  # after the last token and drafts 1..k-1
        drafted = mx.concatenate(tokens, axis=1)
        distributions = None if sampler.greedy else mx.concatenate(probs, axis=1)
        return Proposal(drafted, [k] * len(last), distributions)

    def accept(self, fed: mx.array, kept: list[int]) -> None:
        proposal, self._proposal, self.pending = self._proposal, None, None
        uniform = len(set(kept)) == 1
        if proposal is not None and uniform and kept[0] >= proposal[3]:
            state, final_draft, _, k = proposal
            self.state = state
            if kept[0] == k + 1:
                self.pending = final_draft
            return
        prefix = None if proposal is None else proposal[2]
        width = max(kept)
        tokens = fed[:, :width]
        if prefix is not None:  # fed at the start of the proposal, never kept in self.state
            tokens = mx.concatenate([prefix, tokens], axis=1)
            kept = [n + 1 for n in kept]
        if uniform:
            self.state = self.draft(tokens, self.state)[1]
            return
        _, verified, checkpoints = self.draft(tokens, self.state, capture=True)
        self.state = commit_prefix(verified, kept, checkpoints)

    def keep_rows(self, rows: list[int]) -> None:
        self.state = filter(self.state, rows)
        if self.pending is not None:
            self.pending = self.pending[mx.array(rows)]
