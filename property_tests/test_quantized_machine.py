"""QuantizedKV (mlx-lm's QuantizedKVCache) as a state machine against a NumPy reference.

A reference row is the row's valid (packed, scales, biases) for keys and values, in order.
A forward runs mlx-lm's quantizing `update_and_fetch` on the converted cache; the reference
appends `mx.quantize` of the same raw keys and values (quantization is per token, so a chunk
quantizes the same alone). Like mlx-lm's class the kind is unpadded: one length for all
rows, uniform commits only, merges of equal lengths only (each refusal is checked too).
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
from kvstate.testing import DTYPES, QUANT_BITS, quantized_kv_states

from ._machine import RowMachine
from ._reference import bits, cache_forward, noise

Triple = tuple[np.ndarray, np.ndarray, np.ndarray]


@attrs.frozen
class QRow:
    keys: Triple | None  # each (H, T, ...)
    values: Triple | None

    @property
    def length(self) -> int:
        return 0 if self.keys is None else int(self.keys[0].shape[1])


def _row_of(q: tuple[mx.array, ...], b: int, length: int) -> Triple:
    a, s, z = (bits(x[b, :, :length]) for x in q)
    return (a, s, z)


def quantized_rows(state: ks.QuantizedKV) -> list[QRow]:
    if state.keys is None or state.values is None:
        assert state.length == 0
        return [QRow(None, None)]
    for q in (state.keys, state.values):
        assert all(x.shape[2] >= state.length for x in q), "buffer shorter than the length"
    return [
        QRow(_row_of(state.keys, b, state.length), _row_of(state.values, b, state.length))
        for b in range(ks.batch_size(state))
    ]


def _cat(a: Triple | None, b: Triple) -> Triple:
    if a is None:
        return b
    x, y, z = (np.concatenate([u, v], axis=1) for u, v in zip(a, b, strict=True))
    return (x, y, z)


class QuantizedMachine(RowMachine):
    @initialize(
        data=st.data(),
        heads=st.integers(1, 2),
        bits_=st.sampled_from(QUANT_BITS),
        group_size=st.sampled_from([32, 64]),
        dtype=st.sampled_from(DTYPES),
    )
    def start(self, data: Any, heads: int, bits_: int, group_size: int, dtype: mx.Dtype) -> None:
        self.config = {
            "heads": heads,
            "bits": bits_,
            "group_size": group_size,
            "dtype": dtype,
            "k_groups": 1,
            "v_groups": data.draw(st.integers(1, 2), label="v_groups"),
        }
        self.rng = np.random.default_rng(data.draw(st.integers(0, 2**31), label="seed"))
        self.begin(data, data.draw(quantized_kv_states(**self.config), label="initial"))

    @property
    def length(self) -> int:
        return self.rows[0].length

    def draw_state(self, label: str, batch: int | None = None) -> ks.QuantizedKV:
        strategy = quantized_kv_states(batch=batch, length=self.length, **self.config)
        return self.data.draw(strategy, label=label)

    def read_rows(self, state: Any) -> list[QRow]:
        return quantized_rows(state)

    def can_take_rows(self) -> bool:
        return self.length > 0  # an empty QuantizedKV has no batch axis

    def assert_rows(self) -> None:
        actual = quantized_rows(self.state)
        assert len(actual) == len(self.rows)
        for b, (a, e) in enumerate(zip(actual, self.rows, strict=True)):
            assert a.length == e.length, f"row {b}: {a.length} tokens, reference {e.length}"
            if a.length:
                for name in ("keys", "values"):
                    for part, x, y in zip(
                        ("packed", "scales", "biases"),
                        getattr(a, name),
                        getattr(e, name),
                        strict=True,
                    ):
                        assert np.array_equal(x, y), f"row {b} {name} {part} differ"

    # merge / extend need a state to batch with (an empty QuantizedKV has no batch axis)
    @precondition(lambda self: self.length > 0 and self.batch < 6)
    @rule(data=st.data(), first=st.booleans())
    def merge(self, data: Any, first: bool) -> None:
        super().merge(data, first)

    @precondition(lambda self: self.length > 0 and self.batch < 6)
    @rule(first=st.booleans())
    def extend(self, first: bool) -> None:
        super().extend(first)

    @rule(k=st.integers(1, 4))
    def forward(self, k: int) -> None:
        c = self.config
        shape = (self.batch, c["heads"], k)
        keys = noise(self.rng, (*shape, c["k_groups"] * c["group_size"]), c["dtype"])
        values = noise(self.rng, (*shape, c["v_groups"] * c["group_size"]), c["dtype"])
        self.state = self.apply("forward", cache_forward, self.state, keys, values)
        qk = mx.quantize(keys, group_size=c["group_size"], bits=c["bits"])
        qv = mx.quantize(values, group_size=c["group_size"], bits=c["bits"])
        new = [(_row_of(qk, b, k), _row_of(qv, b, k)) for b in range(self.batch)]
        self.rows = [
            QRow(_cat(r.keys, nk), _cat(r.values, nv))
            for r, (nk, nv) in zip(self.rows, new, strict=True)
        ]
        self.pending = k

    @rule(data=st.data())
    def commit(self, data: Any) -> None:
        accepted = data.draw(st.integers(0, self.pending), label="accepted")
        self.state = self.apply("commit_prefix", ks.commit_prefix, self.state, accepted)
        keep = self.length - self.pending + accepted

        def cut(t: Triple | None) -> Triple | None:
            return None if t is None else (t[0][:, :keep], t[1][:, :keep], t[2][:, :keep])

        self.rows = [QRow(cut(r.keys), cut(r.values)) for r in self.rows]
        self.pending = 0

    @precondition(lambda self: self.batch > 1 and self.pending > 0)
    @rule(data=st.data())
    def ragged_commit_is_refused(self, data: Any) -> None:
        counts = data.draw(
            st.lists(st.integers(0, self.pending), min_size=self.batch, max_size=self.batch).filter(
                lambda c: len(set(c)) > 1
            ),
            label="ragged",
        )
        with pytest.raises(ks.CommitError):
            ks.commit_prefix(self.state, counts)
        self.witness.check()

    @precondition(lambda self: self.length > 0)
    @rule()
    def merge_of_other_length_is_refused(self) -> None:
        other = quantized_kv_states(batch=1, length=self.length + 1, **self.config)
        with pytest.raises(ks.ConfigMismatchError):
            ks.merge([self.state, self.witness.hold(self.data.draw(other), "other length")])
        self.witness.check()

    @invariant()
    def appended_matches(self) -> None:
        assert self.state.appended == self.pending
        assert self.state.length == self.length


TestQuantizedMachine = QuantizedMachine.TestCase
