"""RotatingKV (sliding windows: RotatingKVCache, BatchRotatingKVCache) as a state machine
against a NumPy reference.

A reference row is the row's token history (keys and values, oldest first) and its RoPE
position. What a window must hold is then a function of the history alone: the `keep`
prefix and the newest max_size - 1 - keep tokens, which is everything any later forward
can attend to (`window_view`). Forwards run mlx-lm's own `update_and_fetch` on the
converted cache (rings wrap, multi-token forwards over-fill, single tokens overwrite); a
commit must give back exactly the window of the history with the rejected tokens removed,
even after the verify pushed entries out of the window.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule

import kvstate as ks
from kvstate.testing import DTYPES, rotating_kv_states

from ._machine import RowMachine
from ._reference import assert_same, bits, cache_forward, meaning, noise, window_rows, window_view


@attrs.frozen
class History:
    keys: np.ndarray | None  # (H, T, Dk) oldest first; None: nothing yet
    values: np.ndarray | None
    offset: int  # RoPE position of the next token

    def append(self, k: np.ndarray, v: np.ndarray) -> History:
        if self.keys is None or self.values is None:
            return History(k, v, self.offset + k.shape[1])
        return History(
            np.concatenate([self.keys, k], 1),
            np.concatenate([self.values, v], 1),
            self.offset + k.shape[1],
        )

    def drop(self, n: int) -> History:
        if n == 0 or self.keys is None or self.values is None:
            return History(self.keys, self.values, self.offset - n)
        t = self.keys.shape[1] - n
        keys, values = (self.keys[:, :t], self.values[:, :t]) if t else (None, None)
        return History(keys, values, self.offset - n)


def held(keys: np.ndarray | None) -> int:
    return 0 if keys is None else int(keys.shape[1])


def histories(state: ks.RotatingKV) -> list[History]:
    """A drawn state's rows as histories: every entry it holds is all the past that matters;
    after a multi-token forward, what the window held before it (`previous`) plus the new
    entries, since the forward may have pushed some out that a rollback needs."""
    now = window_rows(state)
    if state.previous is None or state.appended <= 1:
        return [History(k, v, offset) for offset, k, v in now]
    n = state.appended
    before = histories(state.previous)
    if len(before) != len(now):  # an empty `previous` stands for every row
        before = before * len(now)
    return [h.append(k[:, -n:], v[:, -n:]) for h, (_, k, v) in zip(before, now, strict=True)]


class RotatingMachine(RowMachine):
    @initialize(
        data=st.data(),
        heads=st.integers(1, 2),
        dims=st.sampled_from([(2, 2), (2, 4)]),
        dtype=st.sampled_from(DTYPES),
        max_size=st.integers(2, 5),
        keep=st.sampled_from([0, 0, 0, 1]),
        padded=st.booleans(),
    )
    def start(self, data, heads, dims, dtype, max_size, keep, padded):
        self.config = {
            "heads": heads,
            "k_dim": dims[0],
            "v_dim": dims[1],
            "dtype": dtype,
            "max_size": max_size,
            "keep": 0 if padded else keep,  # mlx-lm's batched window has no keep prefix
        }
        self.rng = np.random.default_rng(data.draw(st.integers(0, 2**31), label="seed"))
        initial = data.draw(rotating_kv_states(padded=padded, **self.config), "initial")
        self.config["keep"] = initial.keep  # several empty rows come batched, keep 0
        self.begin(data, initial)

    def draw_state(self, label: str, batch: int | None = None) -> ks.RotatingKV:
        return self.data.draw(rotating_kv_states(batch=batch, **self.config), label=label)

    def read_rows(self, state: Any) -> list[History]:
        return histories(state)

    def combined_pending(self, states: list[Any], pendings: list[int]) -> int:
        """A merged window keeps the shared pending forward unless one that overwrote a slot
        would hide it, or it is longer than the window (see `_keeping_pending`)."""
        n = super().combined_pending(states, pendings)
        if n > self.config["max_size"] or not all(ks.capabilities(s).can_roll_back for s in states):
            return 0
        return n

    def can_batch(self) -> bool:
        return self.config["keep"] == 0

    def can_take_rows(self) -> bool:
        empty = self.state.keys is None and self.state.left_padding is None
        return not (empty and self.config["keep"])

    def assert_rows(self) -> None:
        keep, top = self.config["keep"], self.config["max_size"]
        actual = meaning(self.state, history=False)
        assert len(actual) == len(self.rows)
        for b, (row, h) in enumerate(zip(actual, self.rows, strict=True)):
            assert row[1] == h.offset, f"row {b}: RoPE position {row[1]}, reference {h.offset}"
            want_k = None if h.keys is None else window_view(h.keys, keep, top)
            want_v = None if h.values is None else window_view(h.values, keep, top)
            if want_k is not None and want_k.shape[1] == 0:
                want_k = want_v = None
            assert_same(row[2:4], (want_k, want_v), f"row {b} window")

    @rule(k=st.integers(1, 4))
    def forward(self, k: int) -> None:
        c = self.config
        keys = noise(self.rng, (self.batch, c["heads"], k, c["k_dim"]), c["dtype"])
        values = noise(self.rng, (self.batch, c["heads"], k, c["v_dim"]), c["dtype"])
        self.state = self.apply("forward", cache_forward, self.state, keys, values)
        new_k, new_v = bits(keys), bits(values)
        self.rows = [h.append(new_k[b], new_v[b]) for b, h in enumerate(self.rows)]
        self.pending = k

    @rule(data=st.data())
    def commit(self, data: Any) -> None:
        counts = self.commit_drawn(data)
        self.rows = [h.drop(self.pending - c) for h, c in zip(self.rows, counts, strict=True)]
        self.rejected = self.pending - min(counts)
        self.pending = 0

    @rule(k=st.integers(1, 4), data=st.data())
    def speculate(self, k: int, data: Any) -> None:
        """A verify forward of k draft tokens, then each row keeps its accepted prefix."""
        before = [held(k) for _, k, _ in window_rows(self.state)]
        self.forward(k)
        self.commit(data)
        # A rolled-back window holds no more than the window before the verify or mlx-lm's
        # after one-token steps (max_size): over-filling to max_size + k - 1 entries is the
        # verify forward's own, and a rollback that kept it would hold stale entries.
        top = self.config["max_size"]
        for b, (_, keys, _) in enumerate(window_rows(self.state) if self.rejected else ()):
            assert held(keys) <= max(top, before[b]), f"row {b} holds {held(keys)} entries"

    @precondition(lambda self: self.pending == 1 and not ks.capabilities(self.state).can_roll_back)
    @rule()
    def rejecting_an_overwriting_token_is_refused(self) -> None:
        """The slot a one-token forward overwrote is gone: the error says to use the state
        passed to that forward, and the state is left intact."""
        with pytest.raises(ks.CommitError, match="overwrote"):
            ks.commit_prefix(self.state, 0)
        self.witness.check()

    @invariant()
    def appended_matches(self) -> None:
        assert self.state.appended == self.pending


TestRotatingMachine = RotatingMachine.TestCase
