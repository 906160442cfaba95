"""A prompt being prefilled, a chunk at a time, between the rounds of the running rows.

Its positions run in chunks that end at fixed block boundaries (multiples of `block`
tokens from the prompt's start, whatever prefix the cache served), then at the last-but-one
position, then the last position alone: as mlx-lm's `generate_step` prefills a prompt
shorter than its chunk (all but the last token, then the last), and with the states at block
boundaries the same for every prompt that shares those tokens, so the prefix cache can keep
them. A chunk's state is evaluated before the step goes on (a chunk's activations are
freed before the next), its logits never computed (MLX is lazy; only the last position's
are used).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from .. import eval as eval_state
from ..speculative import Target
from ._params import Request


class Prefilling:
    """Request `request`'s prompt, from position `done` (the tokens the prefix cache served)
    with `state` (batch 1, over those tokens) once `begin` gave them (its first chunk is
    due: the cache then serves what the prompts before it kept). `advance` runs chunks;
    once `complete`, `logits` (1, vocab) are the last position's and `state` holds the
    whole prompt.

    `snapshots` collects (n, state over the first n tokens) worth keeping in the prefix
    cache as they are passed: block boundaries and the last-but-one position (`exact`: the
    cache keeps whole states only), or the whole prompt (`exact` False: a dense state cut
    to any prefix serves them all). With `hidden` the target's final hidden states over the
    prompt are collected (an MTP drafter's input)."""

    def __init__(self, request: Request, *, block: int, exact: bool, hidden: bool) -> None:
        self.request = request
        self.tokens = request.prompt
        self.state: Any = None
        self.done = 0
        self.begun = False
        self.block = block
        self.exact = exact
        self.hidden = hidden
        self.hiddens: list[mx.array] = []
        self.logits: mx.array | None = None
        self.snapshots: list[tuple[int, Any]] = []

    def begin(self, state: Any, done: int) -> None:
        """Start from `state` over the prompt's first `done` tokens."""
        self.state, self.done, self.begun = state, done, True

    @property
    def complete(self) -> bool:
        return self.logits is not None

    @property
    def remaining(self) -> int:
        return len(self.tokens) - self.done

    def advance(self, target: Target, budget: int) -> int:
        """Run chunks of at most `budget` positions in all; the positions run."""
        ran = 0
        last = len(self.tokens) - 1
        while not self.complete and ran < budget:
            start = self.done
            if start < last:
                boundary = (start // self.block + 1) * self.block
                end = min(boundary, last, start + budget - ran)
                self._forward(target, end, keep_logits=False)
                if self.exact and (end % self.block == 0 or end == last):
                    self.snapshots.append((end, self.state))
            else:
                self._forward(target, last + 1, keep_logits=True)
                if not self.exact:
                    self.snapshots.append((last + 1, self.state))
            ran += self.done - start
        return ran

    def _forward(self, target: Target, end: int, *, keep_logits: bool) -> None:
        ids = mx.array([self.tokens[self.done : end]], mx.int32)
        extra = {"hidden": True} if self.hidden else {}
        logits, self.state, *seen = target(ids, self._take(), **extra)
        self.hiddens += seen
        if keep_logits:
            self.logits = logits[:, -1]
            mx.eval(self.logits, *seen)
        else:
            mx.eval(*seen)
        eval_state(self.state)
        self.done = end

    def _take(self) -> Any:
        """The state, handed over to the forward (no reference kept here while it runs)."""
        state, self.state = self.state, None
        return state

    def hidden_states(self) -> mx.array:
        """(1, L, D): the target's final hidden states over the whole prompt."""
        return mx.concatenate(self.hiddens, axis=1)
