"""PooledKV (mlx-vlm's PoolingCache / BatchPoolingCache) as a state machine against a NumPy
reference: each row is its pooled tokens, the raw (kv, gate) tokens of its incomplete
window and the left padding its next inputs carry. A forward runs mlx-vlm's own cache
(`accumulate_windows`, a gated-sum pool of every complete window, `update_and_fetch`); the
reference feeds the same tokens to the rows (padding first, then windows of `ratio`
pooled by the same gated sum in NumPy). A commit of c tokens is the row before the forward
fed its first c inputs; counts kvstate cannot honour (the kept window was pooled) must be
refused and leave the state intact. The row transforms come from `RowMachine`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule

pytest.importorskip("mlx_vlm")

import mlx.core as mx

import kvstate as ks
from kvstate._pooled import rows_of
from kvstate.adapters.vlm import from_mlx_vlm, to_mlx_vlm
from kvstate.kinds import record_forward
from kvstate.testing import pooled_kv_states

from ._machine import RowMachine
from ._reference import noise

DIM = 4  # kv, gate and pooled dims: the gated sum pools kv with its gate


def gated_sum(window: tuple[tuple[np.ndarray, np.ndarray], ...]) -> np.ndarray:
    kv = np.stack([k for k, _ in window]).astype(np.float32)
    gate = np.stack([g for _, g in window]).astype(np.float32)
    return (kv / (1 + np.exp(-gate))).sum(axis=0)


@dataclass(frozen=True)
class Row:
    pooled: tuple[np.ndarray, ...]
    tail: tuple[tuple[np.ndarray, np.ndarray], ...]  # raw (kv, gate) of the incomplete window
    pad: int = 0  # padding the next inputs carry
    before: Row | None = None  # the row before the pending forward
    inputs: tuple[tuple[np.ndarray, np.ndarray], ...] = ()  # that forward's inputs

    def feed(self, inputs: tuple[tuple[np.ndarray, np.ndarray], ...], ratio: int) -> Row:
        skip = min(self.pad, len(inputs))
        tail, pooled = self.tail + inputs[skip:], self.pooled
        while len(tail) >= ratio:
            pooled, tail = (*pooled, gated_sum(tail[:ratio])), tail[ratio:]
        return Row(pooled, tail, self.pad - skip)


def forward(cache: Any, kv: mx.array, gate: mx.array, ratio: int) -> Any:
    ready_kv, ready_gate, _ = cache.accumulate_windows(kv, gate, 0)
    batch, usable, _ = ready_kv.shape
    pooled = (ready_kv * mx.sigmoid(ready_gate)).reshape(batch, usable // ratio, ratio, DIM)
    cache.update_and_fetch(pooled.sum(axis=2))
    return cache


class PooledMachine(RowMachine):
    @initialize(data=st.data(), ratio=st.integers(2, 4), batched=st.booleans())
    def start(self, data: Any, ratio: int, batched: bool) -> None:
        self.ratio = ratio
        self.config = {"ratio": ratio, "kv_dim": DIM, "pooled_dim": DIM, "dtype": mx.float32}
        self.rng = np.random.default_rng(data.draw(st.integers(0, 2**31), label="seed"))
        initial = data.draw(pooled_kv_states(batched=batched, appended=0, **self.config))
        self.begin(data, initial)

    def draw_state(self, label: str, batch: int | None = None) -> ks.PooledKV:
        strategy = pooled_kv_states(batch=batch, appended=0, **self.config)
        return self.data.draw(strategy, label=label)

    def read_rows(self, state: Any) -> list[Row]:
        batch = ks.batch_size(state)
        found = []
        for b, (rem, pool, pad) in enumerate(rows_of(state, batch)):
            pooled = tuple(np.array(state.pooled[b, i]) for i in range(pool))
            tail = tuple(
                (np.array(state.buf_kv[b, i]), np.array(state.buf_gate[b, i])) for i in range(rem)
            )
            found.append(Row(pooled, tail, pad))
        return found

    def combine(self, parts: list[list[Row]], kind: str) -> list[Row]:
        rows = [r for p in parts for r in p]
        if kind != "extract":
            return rows
        # An extracted row takes unpadded inputs; a forward that consumed its padding is
        # settled (kept whole).
        row = rows[0]
        if row.before is not None and row.before.pad:
            row = replace(row, before=None, inputs=())
            self.pending = 0  # (the one side effect of a hook: extract settled the forward)
        return [replace(row, pad=0)]

    def forget_pending(self) -> None:
        if self.pending == 0:
            self.rows = [replace(r, before=None, inputs=()) for r in self.rows]

    def assert_rows(self) -> None:
        actual = self.read_rows(self.state)
        assert len(actual) == len(self.rows)
        for b, (got, want) in enumerate(zip(actual, self.rows, strict=True)):
            where = f"row {b}"
            assert (len(got.pooled), len(got.tail), got.pad) == (
                len(want.pooled),
                len(want.tail),
                want.pad,
            ), where
            for i, (p, q) in enumerate(zip(got.pooled, want.pooled, strict=True)):
                np.testing.assert_allclose(
                    p, q, rtol=1e-5, atol=1e-6, err_msg=f"{where} pooled {i}"
                )
            for i, ((k, g), (k2, g2)) in enumerate(zip(got.tail, want.tail, strict=True)):
                np.testing.assert_array_equal(k, k2, err_msg=f"{where} tail kv {i}")
                np.testing.assert_array_equal(g, g2, err_msg=f"{where} tail gate {i}")

    @rule(k=st.integers(1, 5))
    def forward(self, k: int) -> None:
        ratio = self.ratio
        kv = noise(self.rng, (self.batch, k, DIM), mx.float32)
        gate = noise(self.rng, (self.batch, k, DIM), mx.float32)
        before = self.state

        def run(state: ks.PooledKV) -> ks.PooledKV:
            cache = forward(to_mlx_vlm(state), kv, gate, ratio)
            return record_forward(from_mlx_vlm(cache), state, k)

        self.state = self.apply("forward", run, before)
        kv_np, gate_np = np.array(kv), np.array(gate)
        self.rows = [
            replace(row.feed(inputs, ratio), before=row, inputs=inputs)
            for row, inputs in (
                (r, tuple((kv_np[b, t], gate_np[b, t]) for t in range(k)))
                for b, r in enumerate(self.rows)
            )
        ]
        self.pending = k

    @rule(data=st.data())
    def commit(self, data: Any) -> None:
        counts = self.commit_drawn(data)
        ratio = self.ratio
        self.rows = [
            r if r.before is None else r.before.feed(r.inputs[:c], ratio)
            for r, c in zip(self.rows, counts, strict=True)
        ]
        self.pending = 0

    @rule(k=st.integers(2, 6), data=st.data())
    def speculate(self, k: int, data: Any) -> None:
        """A verify forward, then each row keeps a prefix of it (or, where the kept window
        was pooled, the refusal is checked and the whole forward kept)."""
        self.forward(k)
        if not ks.capabilities(self.state).can_roll_back:
            self.a_count_into_a_pooled_window_is_refused()
        self.commit(data)

    @precondition(lambda self: self.pending and not ks.capabilities(self.state).can_roll_back)
    @rule()
    def a_count_into_a_pooled_window_is_refused(self) -> None:
        refused = 0
        for c in range(self.pending):
            try:
                ks.commit_prefix(self.state, c)
            except ks.CommitError as err:
                assert "pooled its raw tokens" in str(err)
                refused += 1
        assert refused, "can_roll_back is False, so some count must be refused"
        self.witness.check()

    @invariant()
    def appended_matches(self) -> None:
        assert self.state.appended == self.pending


TestPooledMachine = PooledMachine.TestCase
