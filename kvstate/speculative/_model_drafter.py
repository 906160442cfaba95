"""A draft model as a drafter: any wrapped model with the target's vocabulary."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from .._transforms import commit_prefix, filter, merge
from ._drafter import Proposal
from ._sampling import Sampler


class ModelDrafter:
    """Drafts k tokens per row with a smaller model, one token at a time, and keeps the draft
    model's state in step with the target's: after each verify it runs the tokens the target
    verified through the draft model (one capturing forward) and commits the ones the target
    kept, so hybrid and recurrent draft models roll back exactly too.

    `draft`: a wrapped model (`kvstate.adapters.wrap(model)`), called as
    `logits, state = draft(tokens, state)` and `draft(tokens, state, capture=True)`.
    """

    def __init__(self, draft: Any, seed: int = 0) -> None:
        self.draft = draft
        self.state: Any = None
        self.key = mx.random.key(seed)

    def start(self, prompts: list[list[int]]) -> None:
        states = [self.draft(mx.array([p]), self.draft.init_state())[1] for p in prompts]
        self.state = states[0] if len(states) == 1 else merge(states)

    def propose(self, last: list[int], k: int, sampler: Sampler) -> Proposal:
        state, y = self.state, mx.array(last, mx.int32)[:, None]
        tokens, probs = [], []
        for _ in range(k):
            logits, state = self.draft(y, state)
            q = sampler.probs(logits[:, -1])
            self.key, key = mx.random.split(self.key)
            y = sampler.sample(q, key)[:, None]
            tokens.append(y)
            probs.append(q[:, None])
        # The proposing states are dropped: `accept` catches the kept state up in one forward.
        drafted = mx.concatenate(tokens, axis=1)
        distributions = None if sampler.greedy else mx.concatenate(probs, axis=1)
        return Proposal(drafted, [k] * len(last), distributions)

    def accept(self, fed: mx.array, kept: list[int]) -> None:
        if fed.shape[1] == 1:
            self.state = self.draft(fed, self.state)[1]
            return
        _, verified, checkpoints = self.draft(fed, self.state, capture=True)
        self.state = commit_prefix(verified, kept, checkpoints)

    def keep_rows(self, rows: list[int]) -> None:
        self.state = filter(self.state, rows)
