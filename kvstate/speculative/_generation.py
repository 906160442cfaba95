"""What `generate` returns: the rounds, and (with `keep_states=True`) each row's final state,
to continue from (`generate(..., states=...)`), save (`kvstate.save`) or inspect.

A row's final state holds its prompt (after the state it started from) and every token it
emitted, the last one (an end token too) included, as mlx-lm's prompt cache holds them after
`generate_step`: the prompt of a next turn follows it directly. It is a batch-1, unpadded
state (`kvstate.extract`), evaluated, with no pending forward to commit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import mlx.core as mx

from .. import StateError, extract, filter
from .. import eval as evaluate
from ..kinds import batch_size_of
from ._emit import Token
from ._target import Target

View = Callable[[], tuple[Any, list[int], list[int], list[int | None]]]
"""`() -> (state, positions, rows, pending)`: a suspended generation's live rows, as
`Finals.finish` takes them (see `Finals.hold`)."""


class Finals:
    """Each row's final state, recorded as rows end (`finish`), and a view of the rows
    still generating while the generation is suspended at a yield (`hold`), so that a
    generation stopped early still hands back every row's state so far."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.states: list[Any] = []
        self.view: View | None = None

    def begin(self, rows: int) -> None:
        """A generation of `rows` prompts starts (its arguments checked)."""
        self.states = [None] * rows

    def finish(
        self, state: Any, positions: list[int], rows: list[int], pending: list[int | None]
    ) -> None:
        """Rows `rows` (prompt indices), at `positions` of the batched `state`, ended;
        `pending[i]`: the token row i emitted that `state` does not hold yet (None: it holds
        all), run through the target here (one forward for all such rows)."""
        for row, final in zip(rows, final_states(self.target, state, positions, pending),
                              strict=True):  # fmt: skip
            self.states[row] = final

    def hold(self, view: View) -> None:
        """While suspended at a yield: `view()` gives the live rows. Released (`release`)
        before the generation runs on, so that no reference to its state outlives the
        yield (its next forward then writes the KV buffers in place)."""
        self.view = view

    def release(self) -> None:
        self.view = None

    def collect(self) -> list[Any]:
        """Every row's state: the ended rows' as recorded, the live rows' (a generation
        stopped early) from the view."""
        states = list(self.states)
        if self.view is not None:
            state, positions, rows, pending = self.view()
            for row, final in zip(rows, final_states(self.target, state, positions, pending),
                                  strict=True):  # fmt: skip
                states[row] = final
        return states


def final_states(
    target: Target, state: Any, positions: list[int], pending: list[int | None]
) -> list[Any]:
    """The rows at `positions` of `state`, each as a batch-1 unpadded evaluated state, with
    its `pending` token (None: none) run through `target` first."""
    out: dict[int, Any] = {}
    fed = [(p, t) for p, t in zip(positions, pending, strict=True) if t is not None]
    if fed:
        rows = [p for p, _ in fed]
        whole = rows == list(range(batch_size_of(state)))
        part = state if whole else filter(state, rows)
        _, after = target(mx.array([[t] for _, t in fed], mx.int32), part)
        for i, (p, _) in enumerate(fed):
            out[p] = extract(after, i)
    for p, t in zip(positions, pending, strict=True):
        if t is None:
            out[p] = extract(state, p)
    finals = [out[p] for p in positions]
    for final in finals:
        evaluate(final)
    return finals


class Counts:
    """A generation's drafts so far: `drafted` (verified: each round's drafts, a tree's
    nodes) and `accepted` (kept by the target), over every row."""

    def __init__(self) -> None:
        self.drafted = 0
        self.accepted = 0


class Generation(Iterator[list[Token]]):
    """The rounds of a generation (`generate`): iterate it for each round's tokens, as
    before. With `keep_states=True`, `states` then gives each row's final state (see the
    module docstring); a generation stopped early (a `break`) gives each row's state so far.
    """

    def __init__(
        self,
        rounds: Iterator[list[Token]],
        finals: Finals | None,
        counts: Counts | None = None,
        policy: Any = None,
    ) -> None:
        self._rounds = rounds
        self._policy = policy
        self._finals = finals
        self._counts = counts or Counts()
        self._started = False

    @property
    def drafted(self) -> int:
        """The drafts verified so far, every row's (0 without a drafter)."""
        return self._counts.drafted

    @property
    def accepted(self) -> int:
        """The drafts the target accepted so far, every row's."""
        return self._counts.accepted

    @property
    def policy(self) -> Any:
        """The drafting policy (`CostAwarePolicy`) choosing each round's drafts, with its
        estimates (`acceptance` per row, `cost_ratio(width)`, `last` decision); None for a
        fixed k (`adaptive=False`) or plain decoding."""
        return self._policy

    def __iter__(self) -> Generation:
        return self

    def __next__(self) -> list[Token]:
        self._started = True
        return next(self._rounds)

    def close(self) -> None:
        """Stop the generation (what a `for` loop's `break` leaves for the garbage
        collector): its rows' states stay available (the view of its live rows stays)."""
        close = getattr(self._rounds, "close", None)
        if close is not None:
            close()

    @property
    def states(self) -> list[Any]:
        """Each row's final state (batch 1, evaluated), in the order of the prompts: its
        prompt and every token it emitted so far."""
        if self._finals is None:
            raise StateError(
                "generate: the final states were not kept; pass keep_states=True to "
                "generate to continue from them"
            )
        if not self._started:
            raise StateError(
                "generate: no state yet: iterate the generation first (the states are "
                "those after its rounds)"
            )
        states = self._finals.collect()
        missing = [i for i, s in enumerate(states) if s is None]
        if missing:  # pragma: no cover - every row is recorded or live
            raise StateError(f"generate: rows {missing[:8]} have no state")
        return states
