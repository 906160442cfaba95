"""RecurrentState (mlx-lm's ArraysCache) as a state machine against a NumPy reference.

A reference row is the row's arrays (bit-exact numpy, None while never written) plus its
`left_padding` / `lengths` bookkeeping. A forward is what an mlx-lm recurrent layer does to
its ArraysCache: assign new arrays (`cache[i] = ...`) and `advance(K)`; the per-token
arrays it went through are the checkpoints a capturing forward returns. The batch
semantics of the bookkeeping follow ArraysCache's merge / filter / extend / extract.
"""

from __future__ import annotations

from typing import Any

import attrs
import mlx.core as mx
import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule

import kvstate as ks
from kvstate.adapters import from_mlx_lm, to_mlx_lm
from kvstate.kinds import record_forward
from kvstate.testing import DTYPES, accepted_counts, recurrent_states

from ._machine import RowMachine
from ._reference import bits, noise


@attrs.frozen
class RRow:
    arrays: tuple[np.ndarray | None, ...]
    left_padding: int | None
    lengths: int | None


def recurrent_rows(state: ks.RecurrentState) -> list[RRow]:
    batch = ks.batch_size(state)
    arrays = [None if a is None else bits(a) for a in state.arrays]
    for a in arrays:
        assert a is None or a.shape[0] == batch, "arrays disagree on the batch size"

    def per_row(x: mx.array | None) -> list[int | None]:
        if x is None:
            return [None] * batch
        assert x.shape == (batch,), f"bookkeeping of shape {x.shape} for {batch} rows"
        return [int(v) for v in np.array(x).tolist()]

    lps, lns = per_row(state.left_padding), per_row(state.lengths)
    return [
        RRow(tuple(None if a is None else a[b] for a in arrays), lps[b], lns[b])
        for b in range(batch)
    ]


def _zero_fill(rows: list[RRow]) -> list[RRow]:
    """Batch-level arrays: where any row has entry e, rows without it get zeros (mlx-lm's
    ArraysCache merge/extend fill missing arrays with zeros)."""
    n = len(rows[0].arrays)
    likes = [next((r.arrays[e] for r in rows if r.arrays[e] is not None), None) for e in range(n)]
    return [
        attrs.evolve(
            r,
            arrays=tuple(
                a if a is not None or like is None else np.zeros_like(like)
                for a, like in zip(r.arrays, likes, strict=True)
            ),
        )
        for r in rows
    ]


def _fill_bookkeeping(parts: list[list[RRow]], field: str) -> list[int | None]:
    """ArraysCache.extend's `cat` for left_padding / lengths: zeros for a part without it,
    None when no part has it."""
    present = [p[0].__getattribute__(field) is not None for p in parts]
    if not any(present):
        return [None for p in parts for _ in p]
    return [
        getattr(r, field) if has else 0 for p, has in zip(parts, present, strict=True) for r in p
    ]


class RecurrentMachine(RowMachine):
    @initialize(
        data=st.data(),
        shapes=st.lists(
            st.lists(st.integers(1, 3), min_size=1, max_size=2).map(tuple), min_size=1, max_size=2
        ).map(tuple),
        dtype=st.sampled_from(DTYPES),
    )
    def start(self, data: Any, shapes: tuple, dtype: mx.Dtype) -> None:
        self.shapes, self.dtype = shapes, dtype
        self.rng = np.random.default_rng(data.draw(st.integers(0, 2**31), label="seed"))
        self.checkpoints: Any = None
        self.history: list[list[tuple]] = []
        self.begin(data, data.draw(self.strategy(), label="initial"))

    def strategy(self, batch: int | None = None) -> st.SearchStrategy[ks.RecurrentState]:
        return recurrent_states(batch=batch, shapes=self.shapes, dtype=self.dtype)

    def draw_state(self, label: str, batch: int | None = None) -> ks.RecurrentState:
        return self.data.draw(self.strategy(batch), label=label)

    def read_rows(self, state: Any) -> list[RRow]:
        return recurrent_rows(state)

    def take(self, indices: list[int]) -> list[RRow]:
        rows = [self.rows[i] for i in indices]
        empty = all(a is None for a in self.rows[0].arrays)
        bare = self.rows[0].left_padding is None and self.rows[0].lengths is None
        if empty and bare and len(indices) != 1:
            # An empty state carries its rows as zero left padding (no other batch axis).
            rows = [attrs.evolve(r, left_padding=0) for r in rows]
        return rows

    def gather_pending(self, indices: list[int]) -> None:
        if self.checkpoints is not None:
            index = mx.array(indices)
            self.checkpoints = tuple(c[index] for c in self.checkpoints)
            self.history = [self.history[i] for i in indices]

    def forget_pending(self) -> None:
        self.checkpoints = None

    def combine(self, parts: list[list[RRow]], kind: str) -> list[RRow]:
        rows = [r for p in parts for r in p]
        if kind == "extract":
            return [RRow(rows[0].arrays, None, None)]
        if kind == "merge":
            if all(a is None for r in rows for a in r.arrays):
                # ArraysCache.merge of empty caches records the rows as left padding.
                return [RRow(r.arrays, r.left_padding or 0, None) for r in rows]
            return [RRow(r.arrays, None, None) for r in _zero_fill(rows)]
        lps = _fill_bookkeeping(parts, "left_padding")
        lns = _fill_bookkeeping(parts, "lengths")
        bare = all(x is None for x in lps + lns)
        if bare and len(rows) != 1 and all(a is None for r in rows for a in r.arrays):
            lps = [0] * len(rows)  # empty rows are carried as zero left padding
        return [
            RRow(r.arrays, lp, ln) for r, lp, ln in zip(_zero_fill(rows), lps, lns, strict=True)
        ]

    def assert_rows(self) -> None:
        actual = recurrent_rows(self.state)
        assert len(actual) == len(self.rows)
        for b, (a, e) in enumerate(zip(actual, self.rows, strict=True)):
            assert a.left_padding == e.left_padding, f"row {b} left_padding"
            assert a.lengths == e.lengths, f"row {b} lengths"
            for i, (x, y) in enumerate(zip(a.arrays, e.arrays, strict=True)):
                assert (x is None) == (y is None), f"row {b} array {i}: None-ness differs"
                if x is not None:
                    assert np.array_equal(x, y), f"row {b} array {i} differs from the reference"

    # -- a recurrent layer's forward ------------------------------------------------------

    @rule(k=st.integers(1, 3))
    def forward(self, k: int) -> None:
        b = self.batch
        before = [
            mx.zeros((b, *shape), self.dtype) if a is None else a
            for a, shape in zip(self.state.arrays, self.shapes, strict=True)
        ]
        steps = [
            [noise(self.rng, (b, *shape), self.dtype) for shape in self.shapes] for _ in range(k)
        ]

        def run(state: ks.RecurrentState) -> ks.RecurrentState:
            cache = to_mlx_lm(state)
            for i, a in enumerate(steps[-1]):
                cache[i] = a
            cache.advance(k)
            return record_forward(from_mlx_lm(cache), state, k)

        self.state = self.apply("forward", run, self.state)
        self.checkpoints = tuple(
            mx.stack([before[i], *(s[i] for s in steps)], axis=1) for i in range(len(self.shapes))
        )
        every = [before, *steps]  # entry t: the arrays after t tokens
        as_bits = [[bits(a) for a in arrays] for arrays in every]
        self.history = [[tuple(a[row] for a in arrays) for arrays in as_bits] for row in range(b)]

        def advanced(x: int | None) -> int | None:
            return None if x is None else x - k

        self.rows = [
            RRow(self.history[row][k], advanced(r.left_padding), advanced(r.lengths))
            for row, r in enumerate(self.rows)
        ]
        self.pending = k

    @precondition(lambda self: self.pending > 0 and self.checkpoints is not None)
    @rule(data=st.data())
    def commit(self, data: Any) -> None:
        counts = self.commit_drawn(data, self.checkpoints)

        def unadvanced(x: int | None, c: int) -> int | None:
            return None if x is None else x + (self.pending - c)

        self.rows = [
            RRow(self.history[row][c], unadvanced(r.left_padding, c), unadvanced(r.lengths, c))
            for row, (r, c) in enumerate(zip(self.rows, counts, strict=True))
        ]
        self.pending = 0
        self.checkpoints = None

    @rule(k=st.integers(1, 3), data=st.data())
    def speculate(self, k: int, data: Any) -> None:
        """A capturing verify forward of k tokens, then each row keeps its accepted prefix."""
        self.forward(k)
        self.commit(data)

    @rule(data=st.data())
    def commit_without_checkpoints(self, data: Any) -> None:
        """Keeping everything needs no checkpoints; anything less is refused, state intact."""
        accepted = data.draw(accepted_counts(self.state), label="accepted")
        counts = [accepted] * self.batch if isinstance(accepted, int) else accepted
        if all(c == self.pending for c in counts):
            self.state = self.apply("commit_prefix", ks.commit_prefix, self.state, accepted)
            self.pending = 0
            self.checkpoints = None
            return
        with pytest.raises(ks.CheckpointRequiredError):
            ks.commit_prefix(self.state, accepted)
        self.witness.check()

    @invariant()
    def appended_matches(self) -> None:
        assert self.state.appended == self.pending


TestRecurrentMachine = RecurrentMachine.TestCase
