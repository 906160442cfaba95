"""A drafter that proposes from the target's last hidden state: MTP-style draft heads.

Position i of a draft head takes the target's final hidden state at i - 1 (zeros at the
first position) and token i, and predicts token i + 1, returning its own hidden state,
which the next draft step takes instead of the target's (DeepSeek-V3's multi-token
prediction, chained). So the head's state covers the same positions as the target's, and a
head that ignores the hidden states and runs the target itself drafts exactly what the
target would decode.
"""

from __future__ import annotations

from typing import Any, Protocol

import mlx.core as mx

from .. import StateError, commit_prefix, extend, filter, merge
from .. import eval as eval_state
from ..kinds import as_int
from . import _values as values
from ._checks import (
    checked_depth,
    checked_kept,
    checked_last,
    checked_prompts,
    checked_rows,
    checked_sampler,
)
from ._drafter import Drafted, Proposal
from ._prefill import PREFILL_STEP
from ._sampling import Sampler, draw_from


class DraftHead(Protocol):
    """What MTPDrafter asks of a head (`kvstate.adapters.MTPHead` is a ready-made one)."""

    def init_state(self, batch_size: int = 1) -> Any:
        """An empty state (a kvstate state) for `batch_size` rows."""
        ...

    def __call__(
        self, hidden: mx.array, tokens: mx.array, state: Any, *, capture: bool = False
    ) -> tuple[Any, ...]:
        """hidden (B, K, D), tokens (B, K) from `state` -> (logits (B, K, V), hidden
        (B, K, D), state), with the checkpoints for `commit_prefix` appended when `capture`."""
        ...


class MTPDrafter:
    """Drafts k tokens per row with a draft head fed from the target's final hidden states.

    Each proposal runs the head k times, one token at a time: first on the target's hidden
    state at the row's last kept token and the row's `last` token, then on its own hidden
    state and its own draft. After the verify, the head's state keeps the first step (its
    inputs were the target's) and catches up on the accepted drafts with the target's hidden
    states from the verify (one forward; a capturing one and a ragged `commit_prefix` when
    rows kept different counts), so every kept position saw the target's hidden state.

    `uses_hidden = True` tells the generator to pass the target's hidden states to `start`
    and `accept`. `seed`: the key of its draws when it is started without one (driven by
    hand); `generate` hands it a key split from the generator's seed.
    """

    uses_hidden = True
    prefills = True  # the generator passes its prefill_step_size to `start`

    def __init__(self, head: DraftHead, seed: int = 0) -> None:
        if isinstance(head, type) or not (
            callable(head) and callable(getattr(head, "init_state", None))
        ):
            raise StateError(
                f"MTPDrafter: head must be a draft head (callable, with init_state: the "
                f"DraftHead protocol, e.g. kvstate.adapters.MTPHead(model)); got a "
                f"{type(head).__name__}"
            )
        self.head = head
        self.key = mx.random.key(values.seed(seed, "MTPDrafter: seed"))
        self.state: Any = None  # every kept position but the last token's
        self.pending: mx.array | None = None  # (B, 1, D): the target's hidden at the last kept
        self._first_step: Any = None  # the state after a proposal's first step

    def start(
        self,
        prompts: list[list[int]],
        hidden: list[mx.array] | None = None,
        *,
        key: mx.array | None = None,
        prefill_step_size: int = PREFILL_STEP,
    ) -> None:
        """`hidden`: the target's hidden states over each prompt, (1, L, D) per row; `key`:
        the key of this generation's draws (the generator's, see `Drafter.start`; None: keep
        drawing from its own seed). The head runs over each prompt in chunks of
        `prefill_step_size` positions, each chunk's state evaluated as it is built (its logits
        are never used, so never computed)."""
        where = "MTPDrafter.start"
        prompts = checked_prompts(prompts, None, where)
        _check_hidden(prompts, hidden, where)
        if key is not None:
            self.key = values.prng_key(key, f"{where}: key")
        self.state, self.pending = self._prefilled(prompts, hidden, prefill_step_size, where)
        self._first_step = None

    def add_rows(
        self,
        prompts: list[list[int]],
        hidden: list[mx.array] | None = None,
        *,
        prefill_step_size: int = PREFILL_STEP,
    ) -> None:
        """New rows after the current ones, whose `prompts` the target prefilled, with the
        target's hidden states over each (1, L, D) (a batch that admits rows between
        rounds): the head runs over them as in `start` and their states join (`extend`).
        Between rounds only (after `accept`); `start` when none were started."""
        where = "MTPDrafter.add_rows"
        if self.pending is None:
            self.start(prompts, hidden, prefill_step_size=prefill_step_size)
            return
        if self._first_step is not None:
            raise StateError(
                f"{where}: the last proposal was never accepted; add rows between rounds "
                "(after accept)"
            )
        prompts = checked_prompts(prompts, None, where)
        state, pending = self._prefilled(prompts, hidden, prefill_step_size, where)
        self.state = extend(self.state, state)
        self.pending = mx.concatenate([self.pending, pending], axis=0)

    def _prefilled(
        self, prompts: list[list[int]], hidden: Any, prefill_step_size: Any, where: str
    ) -> tuple[Any, mx.array]:
        """The head's state over `prompts` (one row each) from the target's `hidden`
        states over them, and each row's pending hidden state (B, 1, D)."""
        _check_hidden(prompts, hidden, where)
        step = as_int(prefill_step_size, f"{where}: prefill_step_size", StateError)
        if step < 1:
            raise StateError(f"{where}: prefill_step_size must be an int >= 1; got {step!r}")
        states, pending = [], []
        for prompt, h in zip(prompts, hidden, strict=True):
            before = mx.concatenate([mx.zeros_like(h[:, :1]), h[:, :-1]], axis=1)
            ids, state = mx.array([prompt]), self.head.init_state()
            for at in range(0, len(prompt), step):
                state = self.head(before[:, at : at + step], ids[:, at : at + step], state)[2]
                eval_state(state)
            states.append(state)
            pending.append(h[:, -1:])
        merged = states[0] if len(states) == 1 else merge(states)
        return merged, mx.concatenate(pending, axis=0)

    def propose(self, last: list[int], k: int, sampler: Sampler) -> Proposal:
        if self.pending is None:
            raise StateError("MTPDrafter.propose: call start first")
        where = "MTPDrafter.propose"
        checked_depth(k, where)
        checked_sampler(sampler, where)
        last = checked_last(last, self.pending.shape[0], None, where)
        hidden, state = self.pending, self.state
        y = mx.array(last, mx.int32)[:, None]
        tokens, probs = [], []
        for step in range(k):
            logits, hidden, state = self.head(hidden, y, state)
            if step == 0:
                self._first_step = state
            q = sampler.probs(logits[:, -1])
            self.key, key = mx.random.split(self.key)
            y = draw_from(sampler, q, key)[:, None]
            tokens.append(y)
            probs.append(q[:, None])
        drafted = mx.concatenate(tokens, axis=1)
        distributions = None if sampler.greedy else mx.concatenate(probs, axis=1)
        return Drafted(drafted, [k] * len(last), distributions, logits.shape[-1])

    def accept(self, fed: mx.array, kept: list[int], hidden: mx.array | None = None) -> None:
        """`hidden`: the target's hidden states (B, 1 + span, D) over `fed` (B, 1 + span)."""
        if hidden is None or self.pending is None:
            raise StateError("MTPDrafter.accept: needs the target's hidden states over `fed`")
        rows = self.pending.shape[0]
        kept = checked_kept(fed, kept, rows, values.INT32_LIMIT, "MTPDrafter.accept")
        if not (isinstance(hidden, mx.array) and hidden.shape[:2] == fed.shape):
            raise StateError(
                f"MTPDrafter.accept: hidden must be the target's hidden states over fed, "
                f"{tuple(fed.shape)} + (D,); got "
                f"{tuple(hidden.shape) if isinstance(hidden, mx.array) else type(hidden).__name__}"
            )
        n = fed.shape[1]
        # behind[b]: the kept tokens row b's head state has yet to see.
        if self._first_step is not None:  # (pending, last) is in it: the drafts remain
            state, behind = self._first_step, [c - 1 for c in kept]
            inputs, tokens = hidden[:, : n - 1], fed[:, 1:]
        else:  # a round without a proposal (a plain step)
            state, behind = self.state, kept
            inputs = mx.concatenate([self.pending, hidden[:, : n - 1]], axis=1)
            tokens = fed
        self._first_step = None
        most = max(behind)
        if most > 0 and len(set(behind)) == 1:
            state = self.head(inputs[:, :most], tokens[:, :most], state)[2]
        elif most > 0:
            _, _, verified, checkpoints = self.head(
                inputs[:, :most], tokens[:, :most], state, capture=True
            )
            state = commit_prefix(verified, behind, checkpoints)  # each row's kept tokens
        self.state = state
        at = mx.array([c - 1 for c in kept])[:, None, None]
        self.pending = mx.take_along_axis(hidden, at, axis=1)

    def keep_rows(self, rows: list[int]) -> None:
        count = 0 if self.pending is None else self.pending.shape[0]
        rows = checked_rows(rows, count, "MTPDrafter.keep_rows")
        self.state = filter(self.state, rows)
        if self.pending is not None:
            self.pending = self.pending[mx.array(rows)]


def _check_hidden(prompts: list[list[int]], hidden: Any, where: str) -> None:
    """`hidden`: the target's hidden states over each prompt, (1, L, D) per prompt."""
    if not (isinstance(hidden, (list, tuple)) and len(hidden) == len(prompts)):
        got = f"{len(hidden)} of them" if isinstance(hidden, (list, tuple)) else repr(hidden)
        raise StateError(
            f"{where}: needs the target's hidden states per prompt (hidden=[(1, L, D) per "
            f"prompt], {len(prompts)} of them); got {got:.60}"
        )
    bad = [
        i
        for i, (p, h) in enumerate(zip(prompts, hidden, strict=True))
        if not (isinstance(h, mx.array) and h.ndim == 3 and h.shape[:2] == (1, len(p)))
    ]
    if bad:
        shapes = [tuple(hidden[i].shape) if isinstance(hidden[i], mx.array) else None for i in bad]
        raise StateError(
            f"{where}: hidden[{bad[0]}] must be (1, L, D) over its prompt of L tokens; got "
            f"{shapes[:4]} for prompts {bad[:4]}"
        )
