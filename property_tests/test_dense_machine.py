"""DenseKV (KVCache, BatchKVCache, ConcatenateKVCache) as a state machine against a NumPy
reference: a list of rows, each the row's valid (key, value) tokens.

Forwards go through mlx-lm's own `update_and_fetch` on the converted cache objects; every
transform is checked row by row against plain numpy list operations, and every state ever
seen is checked to be unchanged (bitwise) after everything that followed.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, rule
from mlx_lm.models.cache import BatchKVCache

import kvstate as ks
from kvstate.adapters import to_mlx_lm
from kvstate.testing import DTYPES, dense_kv_states

from ._machine import RowMachine
from ._reference import (
    assert_rows_equal,
    bits,
    cache_forward,
    committed,
    dense_rows,
    noise,
)


class DenseMachine(RowMachine):
    """One DenseKV evolving under forwards and every transform, next to its reference rows."""

    @initialize(
        data=st.data(),
        heads=st.integers(1, 2),
        k_dim=st.sampled_from([2, 4]),
        v_dim=st.sampled_from([2, 4]),
        dtype=st.sampled_from(DTYPES),
        padded=st.booleans(),
    )
    def start(self, data, heads, k_dim, v_dim, dtype, padded):
        self.config = {"heads": heads, "k_dim": k_dim, "v_dim": v_dim, "dtype": dtype}
        self.rng = np.random.default_rng(data.draw(st.integers(0, 2**31), label="seed"))
        # The drawn state *defines* the reference's start.
        self.begin(data, data.draw(dense_kv_states(padded=padded, **self.config), label="initial"))

    def draw_state(self, label, batch=None):
        return self.data.draw(dense_kv_states(batch=batch, **self.config), label=label)

    def read_rows(self, state):
        return dense_rows(state)

    def assert_rows(self):
        assert_rows_equal(dense_rows(self.state), self.rows, "DenseKV")

    @rule(k=st.integers(1, 4))
    def forward(self, k):
        c = self.config
        keys = noise(self.rng, (self.batch, c["heads"], k, c["k_dim"]), c["dtype"])
        values = noise(self.rng, (self.batch, c["heads"], k, c["v_dim"]), c["dtype"])
        self.state = self.apply("forward", cache_forward, self.state, keys, values)
        new_k, new_v = bits(keys), bits(values)
        self.rows = [r.append(new_k[b], new_v[b]) for b, r in enumerate(self.rows)]
        self.pending = k

    @rule(data=st.data())
    def commit(self, data):
        counts = self.commit_drawn(data)
        event(
            f"commit: {'ragged' if len(set(counts)) > 1 else 'uniform'}, rejects {self.pending - min(counts)}"
        )
        self.rows, self.pending = committed(self.rows, counts, self.pending), 0

    @rule(k=st.integers(1, 4), data=st.data())
    def speculate(self, k, data):
        """A verify forward of k draft tokens, then each row keeps its accepted prefix."""
        self.forward(k)
        self.commit(data)

    @rule(data=st.data())
    def filter(self, data):
        super().filter(data)
        # filter drops the left padding every kept row shares (mlx-lm's BatchKVCache.filter)
        if self.state.left_padding is not None and self.state.keys is not None:
            assert min(np.array(self.state.left_padding).tolist()) == 0, "shared padding kept"

    @invariant()
    def bookkeeping_matches_mlx_lm(self):
        """mlx-lm's reading of the state (offsets = RoPE positions) agrees with the rows."""
        assert self.state.appended == self.pending
        cache = to_mlx_lm(self.state)
        lengths = [r.length for r in self.rows]
        if isinstance(cache, BatchKVCache):
            assert np.array(cache.offset).tolist() == lengths
            assert np.array(cache.left_padding).tolist() == [cache._idx - n for n in lengths]
        else:
            assert [cache.offset] * self.batch == lengths


TestDenseMachine = DenseMachine.TestCase


def test_forward_equals_mlx_lm_keys_and_values():
    """Sanity for the oracle itself: mlx-lm's keys_and_values after the same updates."""
    rng = np.random.default_rng(0)
    state = ks.DenseKV()
    chunks = []
    for k in (3, 1, 2):
        keys, values = noise(rng, (1, 2, k, 4), mx.float32), noise(rng, (1, 2, k, 4), mx.float32)
        state = cache_forward(state, keys, values)
        chunks.append(bits(keys))
    expected = np.concatenate(chunks, axis=2)[0]
    assert np.array_equal(dense_rows(state)[0].keys, expected)
