"""A base state machine for one state next to its NumPy reference rows.

The row transforms mean the same list operation for every kind (tile repeats rows,
row_select / filter pick them, merge / extend concatenate them, extract keeps one), so the
rules live here; a kind's machine says how to draw states, read a state's rows, run a
forward and commit, and how combining rows changes them (`combine`).

A pending forward (`self.pending`) survives the row transforms: row_select / tile / filter /
extract keep it (a machine gathers whatever it keeps for a later commit, such as checkpoints,
in `gather_pending`), merge / extend keep it when every input has the same one
(`combined_pending`), so a commit after any of them must still give the right rows.
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import kvstate as ks
from kvstate.kinds import appended_of
from kvstate.testing import accepted_counts

from ._reference import Witness

MAX_BATCH = 6


class RowMachine(RuleBasedStateMachine):
    """Subclasses set up `self.data`, `self.state`, `self.rows`, `self.pending` in an
    `@initialize` rule (call `self.begin`) and implement the hooks below."""

    def begin(self, data: Any, state: Any) -> None:
        self.data = data
        self.witness = Witness()
        self.state = self.witness.hold(state, "initial")
        self.last = "initial"
        self.rows = self.read_rows(state)
        self.pending = appended_of(state)

    # -- hooks ---------------------------------------------------------------------------

    def draw_state(self, label: str, batch: int | None = None) -> Any:
        raise NotImplementedError

    def read_rows(self, state: Any) -> list[Any]:
        raise NotImplementedError

    def combine(self, parts: list[list[Any]], kind: str) -> list[Any]:
        """Rows of `merge` / `extend` of states whose rows are `parts` (default: concat)."""
        return [r for p in parts for r in p]

    def assert_rows(self) -> None:
        raise NotImplementedError

    def take(self, indices: list[int]) -> list[Any]:
        """Rows of `take_rows` (tile, row_select, filter) at `indices` (default: a gather)."""
        return [self.rows[i] for i in indices]

    def gather_pending(self, indices: list[int]) -> None:
        """Rows were taken (tile, row_select, filter, extract): gather per-row records of the
        pending forward (checkpoints...) the same way. Default: nothing to gather."""

    def combined_pending(self, states: list[Any], pendings: list[int]) -> int:
        """The pending count after merge / extend of `states`: theirs if they agree, else 0.
        Whatever per-row record a machine keeps for a commit is gone (`forget_pending`)."""
        return pendings[0] if len(set(pendings)) == 1 else 0

    def forget_pending(self) -> None:
        """The per-row records of the pending forward are unknown (after merge / extend)."""

    # -- helpers -------------------------------------------------------------------------

    def commit_drawn(self, data: Any, *checkpoints: Any) -> list[int]:
        """Commit a drawn accepted count (one, or one per row) of the pending forward, with
        `checkpoints` if given; returns every row's count."""
        accepted = data.draw(accepted_counts(self.state), label="accepted")
        self.state = self.apply(
            "commit_prefix", ks.commit_prefix, self.state, accepted, *checkpoints
        )
        return [accepted] * self.batch if isinstance(accepted, int) else list(accepted)

    def partner(self, label: str, batch: int | None = None) -> Any:
        return self.witness.hold(self.draw_state(label, batch), label)

    def apply(self, what: str, fn: Any, *inputs: Any) -> Any:
        """Run a transform, check every state seen so far (its inputs included) is
        unchanged, and remember its output."""
        out = ks.eval(fn(*inputs))
        self.witness.check()
        self.last = what
        return self.witness.hold(out, what)

    @property
    def batch(self) -> int:
        return len(self.rows)

    def row_indices(self) -> st.SearchStrategy[Any]:
        b = self.batch
        index = st.integers(-b, b - 1)
        return st.one_of(index, st.lists(index, min_size=1, max_size=4))

    def can_take_rows(self) -> bool:
        """Kinds with no batch axis while empty (unpadded kinds) say False then."""
        return True

    def can_batch(self) -> bool:
        """merge / extend apply (a window with a `keep` prefix has no batched form)."""
        return True

    # -- rules ---------------------------------------------------------------------------

    @precondition(lambda self: self.batch <= MAX_BATCH // 2 and self.can_take_rows())
    @rule(n=st.integers(1, 3))
    def tile(self, n: int) -> None:
        self.state = self.apply("tile", ks.tile, self.state, n)
        self.took([i for i in range(self.batch) for _ in range(n)])

    def took(self, indices: list[int]) -> None:
        self.rows = self.take(indices)
        self.gather_pending(indices)

    @precondition(lambda self: self.can_take_rows())
    @rule(data=st.data())
    def row_select(self, data: Any) -> None:
        rows = data.draw(self.row_indices(), label="rows")
        self.state = self.apply("row_select", ks.row_select, self.state, rows)
        self.took([r % self.batch for r in ([rows] if isinstance(rows, int) else rows)])

    @precondition(lambda self: self.can_take_rows())
    @rule(data=st.data())
    def filter(self, data: Any) -> None:
        rows = data.draw(self.row_indices(), label="rows")
        self.state = self.apply("filter", ks.filter, self.state, rows)
        self.took([r % self.batch for r in ([rows] if isinstance(rows, int) else rows)])

    @precondition(lambda self: self.batch < MAX_BATCH and self.can_batch())
    @rule(data=st.data(), first=st.booleans())
    def merge(self, data: Any, first: bool) -> None:
        others = [self.partner("merge partner", batch=1)]
        if data.draw(st.booleans(), label="three"):
            others.append(self.partner("merge partner 2", batch=1))
        states = [self.state, *others] if first else [*others, self.state]
        parts = [self.read_rows(s) for s in states]
        pendings = [self.pending if s is self.state else appended_of(s) for s in states]
        self.state = self.apply("merge", ks.merge, states)
        self.rows = self.combine(parts, "merge")
        self.pending = self.combined_pending(states, pendings)
        self.forget_pending()

    @precondition(lambda self: self.batch < MAX_BATCH and self.can_batch())
    @rule(first=st.booleans())
    def extend(self, first: bool) -> None:
        other = self.partner("extend partner")
        pair = (self.state, other) if first else (other, self.state)
        parts = [self.read_rows(s) for s in pair]
        pendings = [self.pending if s is self.state else appended_of(s) for s in pair]
        self.state = self.apply("extend", ks.extend, *pair)
        self.rows = self.combine(parts, "extend")
        self.pending = self.combined_pending(list(pair), pendings)
        self.forget_pending()

    @rule(data=st.data())
    def extract(self, data: Any) -> None:
        row = data.draw(st.integers(-self.batch, self.batch - 1), label="row")
        index = row % self.batch
        self.state = self.apply("extract", ks.extract, self.state, row)
        self.rows = self.combine([[self.rows[row]]], "extract")
        self.gather_pending([index])

    @rule()
    def snapshot(self) -> None:
        self.state = self.apply("snapshot", ks.snapshot, self.state)

    # -- invariants ----------------------------------------------------------------------

    @invariant()
    def rows_match_reference(self) -> None:
        assert ks.batch_size(self.state) == self.batch
        self.assert_rows()

    @invariant()
    def nothing_seen_changed(self) -> None:
        self.witness.check()
