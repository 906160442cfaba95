"""Prompts being prefilled, several per forward, between the rounds of the running rows.

A prompt's positions but the last run in chunks that end at fixed block boundaries
(multiples of `block` tokens from the prompt's start, whatever prefix the cache served) and
at the last-but-one position; the last position then runs as a one-token forward, whose
logits draw the first token: as mlx-lm's `generate_step` prefills a prompt shorter than its
chunk (all but the last token, then the last), with the states at block boundaries the same
for every prompt that shares those tokens, so the prefix cache can keep them.

Up to `rows` prompts prefill together (`PrefillGroup`), as mlx-lm's `BatchGenerator`
prefills up to 8: their states are one batched state (left padding), and each step runs

1. one forward over every prompt still before its last position: each its own next chunk,
   right-padded to the longest with `lengths=` (the wrapped model's right-padded batch, as
   `BatchGenerator.prompt` runs it; the state comes back left-padded). A model whose
   mixers leave a wrong state in a right-padded row (mlx-lm's nemotron_h: BENCHMARKS.md,
   Findings), and a target without `lengths=`, take no padding: every prompt then runs the
   same number of positions, the shortest next chunk's;
2. one one-token forward over every prompt that reached its last position (the rows that
   reached it in 1 and those that start there), whose logits draw each first token.

No pad token enters a row's state and a row's positions are its prompt's: each row's logits
and state are those of its prompt prefilled alone, within rounding. A forward's chunks are
capped together at the step's budget of prompt positions (`Engine(prefill_chunk=)`), the
running rows' stall bound. A chunk's state is evaluated before the step goes on (its
activations are freed before the next), its logits never computed (MLX is lazy).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from .. import eval as eval_state
from .. import extend, extract, merge
from .. import filter as filter_rows
from ..speculative import Target
from ._params import Request

# mlx-lm's mixers whose state in a right-padded row is not the row's alone (BENCHMARKS.md,
# Findings 4: nemotron_h's ssm update ignores the cache's lengths).
_WRONG_RIGHT_PADDING = frozenset({"nemotron_h"})


def pads_exactly(target: Target, empty: Callable[[], Any]) -> bool:
    """Whether `target` takes a right-padded batch (`lengths=`) on the states `empty()`
    gives that leaves every row's state as its own prompt's alone: a target that takes
    `lengths=`, not a model known to get it wrong, and a probe forward of two rows runs
    (some caches, TurboQuant's, have no right padding)."""
    try:
        takes = "lengths" in inspect.signature(target.__call__).parameters
    except (TypeError, ValueError):
        return False
    model = getattr(target, "model", None)
    kind = getattr(getattr(model, "args", None), "model_type", None)
    kind = kind or getattr(model, "model_type", None)
    if not takes or kind in _WRONG_RIGHT_PADDING:
        return False
    try:
        probe = target(mx.array([[0, 0], [0, 0]], mx.int32), merge([empty(), empty()]),
                       lengths=[2, 1])  # type: ignore[call-arg]  # fmt: skip
        eval_state(probe[1])
    except Exception:  # the model's or its caches' own code: take no padding
        return False
    return True


class Prefilling:
    """Request `request`'s prompt, from position `done` (the tokens the prefix cache served)
    once `begin` gave them (its first chunk is due: the cache then serves what the prompts
    before it kept); `start` is the batch-1 state it starts from until it joins a group.
    Once `complete`, `logits` (1, vocab) are the last position's.

    `snapshots` collects (n, state over the first n tokens) worth keeping in the prefix
    cache as they are passed: block boundaries and the last-but-one position (`exact`: the
    cache keeps whole states only), or the whole prompt (`exact` False: a dense state cut
    to any prefix serves them all). With `hidden` the target's final hidden states over the
    prompt are collected (an MTP drafter's input)."""

    def __init__(self, request: Request, *, block: int, exact: bool, hidden: bool) -> None:
        self.request = request
        self.tokens = request.prompt
        self.start: Any = None
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
        self.start, self.done, self.begun = state, done, True

    @property
    def last(self) -> int:
        """The last position (run alone)."""
        return len(self.tokens) - 1

    @property
    def complete(self) -> bool:
        return self.logits is not None

    @property
    def chunk(self) -> int:
        """The positions of its next chunk (0: only the last position is left)."""
        boundary = (self.done // self.block + 1) * self.block
        return min(boundary, self.last) - self.done

    def hidden_states(self) -> mx.array:
        """(1, L, D): the target's final hidden states over the whole prompt."""
        return mx.concatenate(self.hiddens, axis=1)


class PrefillGroup:
    """The prompts prefilling together before their last positions (`prompts`, in batch
    order) and their batched `state` (None when there are none). `pads`: chunks of
    different lengths run right-padded in one forward (see `pads_exactly`)."""

    def __init__(self, *, pads: bool, hidden: bool) -> None:
        self.prompts: list[Prefilling] = []
        self.state: Any = None
        self.pads = pads
        self.hidden = hidden

    def __len__(self) -> int:
        return len(self.prompts)

    def add(self, prompts: list[Prefilling]) -> None:
        """Append begun `prompts` (their `start` states) after the current ones."""
        if not prompts:
            return
        added = _batched([p.start for p in prompts])
        for p in prompts:
            p.start = None
        self.state = added if self.state is None else extend(self._take(), added)
        self.prompts += prompts

    def drop(self, gone: set[int]) -> None:
        """Drop the prompts of the requests whose ids are in `gone`."""
        keep = [i for i, p in enumerate(self.prompts) if p.request.id not in gone]
        if len(keep) < len(self.prompts):
            self._keep(keep)

    def advance(self, target: Target, budget: int, *, first: bool) -> tuple[int, Any, list[Any]]:
        """One forward of every prompt's next chunk, the chunks capped so that they and the
        last positions due after them run at most `budget` positions (the `first` forward
        of a step runs one position each at least; a later one none when that does not
        fit). Returns the positions run and the state and prompts that reached their last
        positions (out of the group; None, [] for none)."""
        chunks = [p.chunk for p in self.prompts]
        ends = [p.done + c == p.last for p, c in zip(self.prompts, chunks, strict=True)]
        width = _width(chunks, ends, budget, self.pads)
        if width == 0:
            if not first:
                return 0, None, []
            width = 1
        takes = [min(c, width) for c in chunks]
        ids = mx.array([list(p.tokens[p.done : p.done + n]) + [0] * (width - n)
                        for p, n in zip(self.prompts, takes, strict=True)], mx.int32)  # fmt: skip
        extra: dict[str, Any] = {"hidden": True} if self.hidden else {}
        if len(set(takes)) > 1:
            extra["lengths"] = takes
        _, state, *seen = target(ids, self._take(), **extra)
        eval_state(state)
        mx.eval(*seen)
        for b, (p, n) in enumerate(zip(self.prompts, takes, strict=True)):
            if seen:
                p.hiddens.append(seen[0][b : b + 1, :n])
            p.done += n
            if p.exact and (p.done % p.block == 0 or p.done == p.last):
                p.snapshots.append((p.done, extract(state, b)))
        self.state = state
        reached = [b for b, p in enumerate(self.prompts) if p.done == p.last]
        if not reached:
            return sum(takes), None, []
        out = state if len(reached) == len(self.prompts) else filter_rows(state, reached)
        prompts = [self.prompts[b] for b in reached]
        self._keep([b for b, p in enumerate(self.prompts) if p.done < p.last])
        return sum(takes), out, prompts

    def _keep(self, keep: list[int]) -> None:
        if not keep:
            self.prompts, self.state = [], None
            return
        state = self._take()
        self.state = state if len(keep) == len(self.prompts) else filter_rows(state, keep)
        self.prompts = [self.prompts[b] for b in keep]

    def _take(self) -> Any:
        """The state, handed over (no reference kept here while a forward runs)."""
        state, self.state = self.state, None
        return state


def last_positions(target: Target, state: Any, prompts: list[Prefilling], hidden: bool) -> Any:
    """The one-token forward of `prompts`' last positions from their batched `state`: each
    prompt's `logits` set (and its last hidden state collected); the state over the whole
    prompts, evaluated. Whole-prompt snapshots (`exact` False) are taken."""
    ids = mx.array([[p.tokens[-1]] for p in prompts], mx.int32)
    logits, state, *seen = target(ids, state, **({"hidden": True} if hidden else {}))
    last = logits[:, -1]
    mx.eval(last, *seen)
    eval_state(state)
    for b, p in enumerate(prompts):
        p.logits = last[b : b + 1]
        if seen:
            p.hiddens.append(seen[0][b : b + 1])
        p.done = len(p.tokens)
        if not p.exact:
            p.snapshots.append((p.done, state if len(prompts) == 1 else extract(state, b)))
    return state


def joined(states: list[Any]) -> Any:
    """One batched state of `states` (each batched or batch-1), rows in order."""
    out = states[0]
    for s in states[1:]:
        out = extend(out, s)
    return out


def _batched(states: list[Any]) -> Any:
    return states[0] if len(states) == 1 else merge(states)


def _width(chunks: list[int], ends: list[bool], budget: int, pads: bool) -> int:
    """The forward's width: the largest w (0: none) whose chunks `min(c, w)` and the last
    positions they reach (a chunk run whole whose `ends`: it ends at the last-but-one
    position) fit `budget`; without `pads`, at most the shortest chunk."""

    def cost(w: int) -> int:
        return sum(min(c, w) + (e and c <= w) for c, e in zip(chunks, ends, strict=True))

    low, high = 1, max(chunks) if pads else min(chunks)
    if cost(high) <= budget:
        return high
    if cost(low) > budget:
        return 0
    while low < high:  # cost grows with w: the largest w within budget
        mid = (low + high + 1) // 2
        low, high = (mid, high) if cost(mid) <= budget else (low, mid - 1)
    return low
