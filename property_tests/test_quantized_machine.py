"""QuantizedKV as a state machine against a NumPy reference, over every option: key and value
bits and group sizes of their own, zero-channel pads, rotations, left padding.

A reference row is the row's valid tokens, each token its key triple (packed words, scales,
biases) and value triple laid side by side as int64 (bit-exact). A forward runs the adapter's
`update_and_fetch` on the converted cache (mlx-lm's QuantizedKVCache for the mlx-lm form,
else kvstate's QuantizedStateCache); the reference appends the state's codec applied to the
same raw keys and values (quantization is per token, so a chunk encodes the same alone; the
codec itself is checked against NumPy in tests/test_quantized_grid.py). Rows of different
lengths batch with left padding, commits may be ragged (a ragged commit may reorder a row's
tokens: rows are then compared as multisets, as for DenseKV).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, rule

import kvstate as ks
from kvstate.quantization import Codec
from kvstate.testing import DTYPES, QUANT_BITS, ROTATION_KINDS, quantized_kv_states

from ._machine import RowMachine
from ._reference import Row, assert_rows_equal, cache_forward, committed, noise, packed_tokens


def quantized_rows(state: ks.QuantizedKV) -> list[Row]:
    batch = ks.batch_size(state)
    if state.keys is None or state.values is None:
        assert state.length == 0
        return [Row(np.zeros((1, 0, 0)), np.zeros((1, 0, 0))) for _ in range(batch)]
    for q in (state.keys, state.values):
        assert all(x.shape[2] >= state.length for x in q), "buffer shorter than the length"
    pads = [0] * batch if state.left_padding is None else np.array(state.left_padding).tolist()
    return [
        Row(
            packed_tokens(state.keys, b, pads[b], state.length),
            packed_tokens(state.values, b, pads[b], state.length),
        )
        for b in range(batch)
    ]


class QuantizedMachine(RowMachine):
    @initialize(
        data=st.data(),
        heads=st.integers(1, 2),
        key_bits=st.sampled_from(QUANT_BITS),
        value_bits=st.sampled_from(QUANT_BITS),
        group_size=st.sampled_from([32, 64]),
        rotation=st.sampled_from(ROTATION_KINDS),
        pads=st.tuples(st.sampled_from([0, 8]), st.sampled_from([0, 8])),
        dtype=st.sampled_from(DTYPES),
        padded=st.booleans(),
    )
    def start(
        self,
        data: Any,
        heads: int,
        key_bits: int,
        value_bits: int,
        group_size: int,
        rotation: str,
        pads: tuple[int, int],
        dtype: mx.Dtype,
        padded: bool,
    ) -> None:
        self.config = {
            "heads": heads,
            "key_bits": key_bits,
            "value_bits": value_bits,
            "group_size": group_size,
            "rotation": rotation,
            "seed": 2,
            "pads": pads,
            "dtype": dtype,
            "k_groups": 1,
            "v_groups": data.draw(st.integers(1, 2), label="v_groups"),
        }
        self.codecs = (
            Codec(key_bits, group_size, pads[0], rotation, 2),
            Codec(value_bits, group_size, pads[1], rotation, 2),
        )
        self.rng = np.random.default_rng(data.draw(st.integers(0, 2**31), label="seed"))
        state = data.draw(quantized_kv_states(padded=padded, **self.config), label="initial")
        self.begin(data, state)

    def draw_state(self, label: str, batch: int | None = None) -> ks.QuantizedKV:
        return self.data.draw(quantized_kv_states(batch=batch, **self.config), label=label)

    def read_rows(self, state: Any) -> list[Row]:
        return quantized_rows(state)

    def assert_rows(self) -> None:
        assert_rows_equal(quantized_rows(self.state), self.rows, "QuantizedKV")

    @rule(k=st.integers(1, 4))
    def forward(self, k: int) -> None:
        c = self.config
        shape = (self.batch, c["heads"], k)
        k_dim = c["k_groups"] * c["group_size"] - c["pads"][0]
        v_dim = c["v_groups"] * c["group_size"] - c["pads"][1]
        keys = noise(self.rng, (*shape, k_dim), c["dtype"])
        values = noise(self.rng, (*shape, v_dim), c["dtype"])
        self.state = self.apply("forward", cache_forward, self.state, keys, values)
        qk, qv = self.codecs[0].encode(keys), self.codecs[1].encode(values)
        self.rows = [
            r.append(packed_tokens(qk, b, 0, k), packed_tokens(qv, b, 0, k))
            for b, r in enumerate(self.rows)
        ]
        self.pending = k

    @rule(data=st.data())
    def commit(self, data: Any) -> None:
        counts = self.commit_drawn(data)
        event(
            f"quantized commit: {'ragged' if len(set(counts)) > 1 else 'uniform'}, batch {self.batch}"
        )
        self.rows, self.pending = committed(self.rows, counts, self.pending), 0

    @rule(k=st.integers(1, 4), data=st.data())
    def speculate(self, k: int, data: Any) -> None:
        """A verify forward of k draft tokens, then each row keeps its accepted prefix."""
        self.forward(k)
        self.commit(data)

    @invariant()
    def bookkeeping_matches(self) -> None:
        assert self.state.appended == self.pending
        lengths = [r.length for r in self.rows]
        pads = self.state.left_padding
        held = (
            [self.state.length - p for p in np.array(pads).tolist()] if pads is not None else None
        )
        assert (held or [self.state.length] * self.batch) == lengths


TestQuantizedMachine = QuantizedMachine.TestCase
