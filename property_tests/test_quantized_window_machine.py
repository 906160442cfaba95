"""QuantizedRotatingKV (quantized sliding windows) as a state machine against the NumPy
reference of the sliding-window machine (test_rotating_machine): a row is its token history,
here the history of the keys and values as quantized and dequantized by the state's codec,
and the window must hold, dequantized, exactly what a window of that history holds. Forwards
run kvstate's QuantizedRotatingCache (three of mlx-lm's own window caches: packed words,
scales, biases), commits roll back across the wrap, and every row transform of the machine
base runs on the quantized state.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
from hypothesis import strategies as st
from hypothesis.stateful import initialize, rule

import kvstate as ks
from kvstate.quantization import dequantized, key_codec, value_codec
from kvstate.testing import ROTATION_KINDS, quantized_rotating_kv_states

from ._reference import bits, cache_forward, noise, window_rows
from .test_rotating_machine import RotatingMachine, held, histories


class QuantizedWindowMachine(RotatingMachine):
    @initialize(
        data=st.data(),
        heads=st.integers(1, 2),
        dims=st.sampled_from([(8, 8), (8, 16)]),
        dtype=st.sampled_from([mx.float32, mx.float16]),
        max_size=st.integers(2, 5),
        keep=st.sampled_from([0, 0, 0, 1]),
        padded=st.booleans(),
        key_bits=st.sampled_from([3, 4, 8]),
        value_bits=st.sampled_from([2, 4, 6]),
        rotation=st.sampled_from(ROTATION_KINDS),
    )
    def start(self, data, heads, dims, dtype, max_size, keep, padded, key_bits, value_bits,
              rotation):  # fmt: skip
        self.config = {
            "heads": heads,
            "k_dim": dims[0],
            "v_dim": dims[1],
            "dtype": dtype,
            "max_size": max_size,
            "keep": 0 if padded else keep,
            "key_bits": key_bits,
            "value_bits": value_bits,
            "group_size": 32,
            "rotation": rotation,
            "seed": 1,
        }
        self.rng = np.random.default_rng(data.draw(st.integers(0, 2**31), label="seed"))
        initial = data.draw(quantized_rotating_kv_states(padded=padded, **self.config), "initial")
        self.config["keep"] = initial.keep
        self.begin(data, initial)

    def draw_state(self, label: str, batch: int | None = None) -> Any:
        return self.data.draw(quantized_rotating_kv_states(batch=batch, **self.config), label=label)

    def read_rows(self, state: Any) -> list[Any]:
        return histories(dequantized(state))

    def assert_rows(self) -> None:
        assert isinstance(self.state, ks.QuantizedRotatingKV)
        plain, self.state = self.state, dequantized(self.state)
        try:
            super().assert_rows()
        finally:
            self.state = plain

    @rule(k=st.integers(1, 4))
    def forward(self, k: int) -> None:
        c = self.config
        keys = noise(self.rng, (self.batch, c["heads"], k, c["k_dim"]), c["dtype"])
        values = noise(self.rng, (self.batch, c["heads"], k, c["v_dim"]), c["dtype"])
        self.state = self.apply("forward", cache_forward, self.state, keys, values)
        # What the window holds of them: their codec's round trip (pads set by now).
        kc, vc = key_codec(self.state), value_codec(self.state)
        new_k, new_v = bits(kc.decode(kc.encode(keys))), bits(vc.decode(vc.encode(values)))
        self.rows = [h.append(new_k[b], new_v[b]) for b, h in enumerate(self.rows)]
        self.pending = k

    @rule(k=st.integers(1, 4), data=st.data())
    def speculate(self, k: int, data: Any) -> None:
        before = [held(x) for _, x, _ in window_rows(dequantized(self.state))]
        self.forward(k)
        self.commit(data)
        top = self.config["max_size"]
        rows = window_rows(dequantized(self.state)) if self.rejected else ()
        for b, (_, keys, _) in enumerate(rows):
            assert held(keys) <= max(top, before[b]), f"row {b} holds {held(keys)} entries"

    def can_take_rows(self) -> bool:
        empty = self.state.keys is None and self.state.left_padding is None
        return not (empty and self.config["keep"])


TestQuantizedWindowMachine = QuantizedWindowMachine.TestCase
