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

With an exact tail (exact_latest R > 0) each reference token also carries its raw key and
value bits, known for the tokens a forward appended (and for those a drawn state's tail
holds): the tail must hold every row's latest min(row length, R + appended) tokens, bit for
bit, wherever the reference knows them (that is what a commit of any count needs).
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
from ._reference import (
    Row,
    assert_rows_equal,
    bits,
    cache_forward,
    committed,
    noise,
    packed_tokens,
)


def quantized_rows(state: ks.QuantizedKV) -> list[Row]:
    """Each row's tokens: packed columns, then (with an exact tail) raw bits and a known flag,
    known for the row's latest min(row length, exact_latest + appended) tokens."""
    batch = ks.batch_size(state)
    if state.keys is None or state.values is None:
        assert state.length == 0
        return [Row(np.zeros((1, 0, 0)), np.zeros((1, 0, 0))) for _ in range(batch)]
    for q in (state.keys, state.values):
        assert all(x.shape[2] >= state.length for x in q), "buffer shorter than the length"
    pads = [0] * batch if state.left_padding is None else np.array(state.left_padding).tolist()
    rows = []
    for b in range(batch):
        keys = packed_tokens(state.keys, b, pads[b], state.length)
        values = packed_tokens(state.values, b, pads[b], state.length)
        if state.exact_latest:
            keys, values = (
                np.concatenate([packed, _raw_of_tail(state, tail, b, pads[b])], axis=-1)
                for packed, tail in ((keys, state.tail_keys), (values, state.tail_values))
            )
        rows.append(Row(keys, values))
    return rows


def _raw_of_tail(state: ks.QuantizedKV, tail: mx.array, b: int, pad: int) -> np.ndarray:
    """(H, row length, D + 1): row b's raw bits from the tail and a known flag, for the
    latest min(row length, exact_latest + appended) tokens (which the tail must hold)."""
    held = state.length - pad
    known = min(held, state.exact_latest + state.appended)
    width = int(tail.shape[2])
    assert width >= known, f"the tail holds {width} positions; row {b} needs its last {known}"
    raw = bits(tail[b, :, width - known :]).astype(np.int64)
    heads, dim = raw.shape[0], raw.shape[2]
    out = np.zeros((heads, held, dim + 1), np.int64)
    out[:, held - known :, :dim] = raw
    out[:, held - known :, dim] = 1
    return out


def raw_tokens(x: mx.array, b: int) -> np.ndarray:
    """(H, K, D + 1): row b's raw bits of fresh keys or values (B, H, K, D), all known."""
    raw = bits(x[b]).astype(np.int64)
    return np.concatenate([raw, np.ones((*raw.shape[:2], 1), np.int64)], axis=-1)


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
        exact_latest=st.sampled_from([0, 2, 5]),
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
        exact_latest: int,
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
            "exact_latest": exact_latest,
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
        actual = quantized_rows(self.state)
        raw = self.raw_columns()
        if not raw:
            assert_rows_equal(actual, self.rows, "QuantizedKV")
            return
        assert_rows_equal(
            [_packed_part(r, raw) for r in actual],
            [_packed_part(r, raw) for r in self.rows],
            "QuantizedKV",
        )
        for b, (a, e) in enumerate(zip(actual, self.rows, strict=True)):
            if a.length == 0:
                continue
            for side, got, want, dim in (
                ("keys", a.keys, e.keys, raw[0]),
                ("values", a.values, e.values, raw[1]),
            ):
                got, want = got[..., -(dim + 1) :], want[..., -(dim + 1) :]
                both = (got[..., -1] == 1) & (want[..., -1] == 1)
                assert np.array_equal(got[both], want[both]), (
                    f"QuantizedKV: row {b}'s tail holds other raw {side} than the reference"
                )

    def raw_columns(self) -> tuple[int, int] | None:
        """(key dim, value dim) of the raw columns rows carry, or None without a tail."""
        c = self.config
        if not c["exact_latest"]:
            return None
        return (
            c["k_groups"] * c["group_size"] - c["pads"][0],
            c["v_groups"] * c["group_size"] - c["pads"][1],
        )

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
        tokens = [
            (packed_tokens(qk, b, 0, k), packed_tokens(qv, b, 0, k)) for b in range(self.batch)
        ]
        if c["exact_latest"]:
            tokens = [
                (
                    np.concatenate([pk, raw_tokens(keys, b)], -1),
                    np.concatenate([pv, raw_tokens(values, b)], -1),
                )
                for b, (pk, pv) in enumerate(tokens)
            ]
        self.rows = [r.append(*t) for r, t in zip(self.rows, tokens, strict=True)]
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


def _packed_part(row: Row, raw: tuple[int, int]) -> Row:
    """`row` without its raw columns (the packed tokens only)."""
    if row.length == 0:
        return row
    return Row(row.keys[..., : -(raw[0] + 1)], row.values[..., : -(raw[1] + 1)], row.ordered)


TestQuantizedMachine = QuantizedMachine.TestCase
