"""DenseKV (KVCache, BatchKVCache, ConcatenateKVCache) as a state machine against a NumPy
reference: a list of rows, each the row's valid (key, value) tokens.

Forwards go through mlx-lm's own `update_and_fetch` on the converted cache objects; every
transform is checked row by row against plain numpy list operations, and every state ever
seen is checked to be unchanged (bitwise) after everything that followed.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from mlx_lm.models.cache import BatchKVCache

import kvstate as ks
from adapters import to_mlx_lm
from kvstate.testing import DTYPES, accepted_counts, dense_kv_states

from ._reference import (
    Row,
    Witness,
    assert_rows_equal,
    bits,
    cache_forward,
    dense_rows,
    noise,
)

MAX_BATCH = 6


class DenseMachine(RuleBasedStateMachine):
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
        self.data = data
        self.config = {"heads": heads, "k_dim": k_dim, "v_dim": v_dim, "dtype": dtype}
        self.witness = Witness()
        self.rng = np.random.default_rng(data.draw(st.integers(0, 2**31), label="seed"))
        self.state = self.witness.hold(
            data.draw(dense_kv_states(padded=padded, **self.config), label="initial"), "initial"
        )
        self.rows = dense_rows(self.state)  # the drawn state *defines* the reference's start
        self.pending = self.state.appended

    # -- helpers -------------------------------------------------------------------------

    def other_state(self, label: str, batch=None) -> ks.DenseKV:
        s = self.data.draw(dense_kv_states(batch=batch, **self.config), label=label)
        return self.witness.hold(s, label)

    def apply(self, what: str, fn, *inputs):
        """Run a transform, then check its inputs are unchanged and hold its output."""
        out = ks.eval(fn(*inputs))
        self.witness.check()
        return self.witness.hold(out, what)

    @property
    def batch(self) -> int:
        return len(self.rows)

    # -- rules ---------------------------------------------------------------------------

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
        accepted = data.draw(accepted_counts(self.state), label="accepted")
        counts = [accepted] * self.batch if isinstance(accepted, int) else accepted
        self.state = self.apply("commit_prefix", ks.commit_prefix, self.state, accepted)
        ragged = len(set(counts)) > 1
        rows = []
        for r, c in zip(self.rows, counts, strict=True):
            kept = r.take(r.length - self.pending + c)
            moved = ragged and c < max(counts)  # a ragged commit may reorder this row
            rows.append(Row(kept.keys, kept.values, kept.ordered and not moved))
        self.rows, self.pending = rows, 0

    @precondition(lambda self: self.batch <= MAX_BATCH // 2)
    @rule(n=st.integers(1, 3))
    def tile(self, n):
        self.state = self.apply("tile", ks.tile, self.state, n)
        self.rows = [r for r in self.rows for _ in range(n)]

    @rule(data=st.data())
    def row_select(self, data):
        rows = data.draw(self.row_indices(), label="rows")
        self.state = self.apply("row_select", ks.row_select, self.state, rows)
        self.rows = [self.rows[i] for i in ([rows] if isinstance(rows, int) else rows)]

    @rule(data=st.data())
    def filter(self, data):
        rows = data.draw(self.row_indices(), label="rows")
        self.state = self.apply("filter", ks.filter, self.state, rows)
        self.rows = [self.rows[i] for i in ([rows] if isinstance(rows, int) else rows)]

    def row_indices(self):
        b = self.batch
        index = st.integers(-b, b - 1)
        return st.one_of(index, st.lists(index, min_size=1, max_size=min(4, MAX_BATCH)))

    @precondition(lambda self: self.batch < MAX_BATCH)
    @rule(data=st.data(), first=st.booleans())
    def merge(self, data, first):
        other = self.other_state("merge partner", batch=1)
        extra = [self.other_state("merge partner 2", batch=1)] if data.draw(st.booleans()) else []
        states = [self.state, other, *extra] if first else [other, *extra, self.state]
        self.state = self.apply("merge", ks.merge, states)
        ours, theirs = self.rows, [r for s in [other, *extra] for r in dense_rows(s)]
        self.rows = ours + theirs if first else theirs + ours
        self.pending = 0

    @precondition(lambda self: self.batch < MAX_BATCH)
    @rule(first=st.booleans())
    def extend(self, first):
        other = self.other_state("extend partner", batch=None)
        pair = (self.state, other) if first else (other, self.state)
        self.state = self.apply("extend", ks.extend, *pair)
        ours, theirs = self.rows, dense_rows(other)
        self.rows = ours + theirs if first else theirs + ours
        self.pending = 0

    @rule(data=st.data())
    def extract(self, data):
        row = data.draw(st.integers(-self.batch, self.batch - 1), label="row")
        self.state = self.apply("extract", ks.extract, self.state, row)
        self.rows = [self.rows[row]]
        self.pending = 0

    @rule()
    def snapshot(self):
        self.state = self.apply("snapshot", ks.snapshot, self.state)

    # -- invariants ----------------------------------------------------------------------

    @invariant()
    def rows_match_reference(self):
        assert ks.batch_size(self.state) == self.batch
        assert_rows_equal(dense_rows(self.state), self.rows, "DenseKV")

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

    @invariant()
    def nothing_seen_changed(self):
        self.witness.check()


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
