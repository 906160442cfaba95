"""TurboQuantKV (mlx-vlm's TurboQuant caches, integer bits and the Split layout) as a state
machine against a NumPy reference.

A reference row is the row's valid tokens, each token every packed array of its key (norm,
indices; a split side's high norm and high indices too) and of its value laid side by side
as int64 (bit-exact). A forward runs mlx-vlm's own update_and_fetch on the cache the state
converts to (TurboQuantKVCache, or BatchTurboQuantKVCache for padded rows); the reference
appends what mlx-vlm's codecs, built here from the machine's (dim, bits, seed, channels),
make of the same raw keys and values (TurboQuant codes every token on its own, so a chunk
codes the same alone). Every row transform (tile, row_select, filter, merge, extend,
extract, snapshot) and uniform or ragged commits run in any order between forwards.

`HybridMachine` does the same for HybridQuantKVCache states (form "hybrid": one side
TurboQuant, the other mx.quantize's triple, the reference coding it with mx.quantize itself);
mlx-vlm's Hybrid cache has no left padding, so its forwards run only on unpadded rows.
"""

from __future__ import annotations

import tempfile
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule

pytest.importorskip("mlx_vlm")

from mlx_vlm import turboquant as tq

import kvstate as ks
from kvstate.adapters.vlm import from_mlx_vlm, to_mlx_vlm
from kvstate.kinds import record_forward
from kvstate.testing import turboquant_kv_states
from kvstate.turboquant import is_split, low_channels, split_sizes

from ._machine import RowMachine
from ._reference import Row, assert_rows_equal, committed, packed_tokens

_PARTS = ("norms", "indices", "high_norms", "high_indices", "scales", "biases")


def reference_codec(dim: int, side_bits: float, seed: int, high: tuple[int, ...] | None) -> Any:
    """mlx-vlm's codec for one side, built from mlx-vlm's own constructors (not kvstate's)."""
    if high is None:
        return tq._TurboQuantMSECodec(dim, int(side_bits), seed)
    low = low_channels(dim, high)
    return tq._SplitCodec.from_indices(dim, float(side_bits), "mse", seed, low, list(high))


def _coded(held: Any) -> list[mx.array]:
    """An mlx-vlm side state's arrays, (B, H, T, X) each (norms get a trailing axis)."""
    if isinstance(held, tq.TurboQuantSplitState):
        return _coded(held.low) + _coded(held.high)
    if isinstance(held, tq.TurboQuantMSEState):
        return [held.norms[..., None], held.indices]
    return list(held)  # mx.quantize's (packed, scales, biases)


class UniformCodec:
    """A Hybrid cache's uniform side, as mlx-vlm codes it: mx.quantize at (group, bits)."""

    def __init__(self, group_size: int, side_bits: int) -> None:
        self.group_size, self.bits = group_size, side_bits

    def quantize(self, x: mx.array) -> tuple[mx.array, ...]:
        return tuple(mx.quantize(x, group_size=self.group_size, bits=self.bits))


def side_arrays(state: ks.TurboQuantKV, side: str) -> list[mx.array]:
    found = [getattr(state, f"{side}_{part}") for part in _PARTS]
    return [a for a in found if a is not None]


def turboquant_rows(state: ks.TurboQuantKV) -> list[Row]:
    batch = ks.batch_size(state)
    if state.key_indices is None:
        assert state.length == 0
        return [Row(np.zeros((1, 0, 0)), np.zeros((1, 0, 0))) for _ in range(batch)]
    keys, values = side_arrays(state, "key"), side_arrays(state, "value")
    assert all(a.shape[2] >= state.length for a in keys + values), "buffer shorter than length"
    pads = [0] * batch if state.left_padding is None else np.array(state.left_padding).tolist()
    return [
        Row(
            packed_tokens(keys, b, pads[b], state.length),
            packed_tokens(values, b, pads[b], state.length),
        )
        for b in range(batch)
    ]


def vlm_forward(state: ks.TurboQuantKV, keys: mx.array, values: mx.array) -> ks.TurboQuantKV:
    """What an attention layer does to `state` running K new tokens on mlx-vlm's cache."""
    cache = to_mlx_vlm(state)
    cache.update_and_fetch(keys, values)
    return record_forward(from_mlx_vlm(cache), state, keys.shape[2])


class TurboQuantRows(RowMachine):
    """The rules and reference of both machines; each sets `dims`, `config`, `codecs` and
    `rng`, then calls `begin`."""

    def noise(self, shape: tuple[int, ...]) -> mx.array:
        return mx.array(self.rng.standard_normal(shape).astype(np.float32))

    def draw_state(self, label: str, batch: int | None = None) -> ks.TurboQuantKV:
        return self.data.draw(turboquant_kv_states(batch=batch, **self.config), label=label)

    def read_rows(self, state: Any) -> list[Row]:
        return turboquant_rows(state)

    def assert_rows(self) -> None:
        assert_rows_equal(turboquant_rows(self.state), self.rows, "TurboQuantKV")

    @rule(k=st.integers(1, 3))
    def forward(self, k: int) -> None:
        shape = (self.batch, self.config["heads"], k)
        keys, values = self.noise((*shape, self.dims[0])), self.noise((*shape, self.dims[1]))
        self.state = self.apply("forward", vlm_forward, self.state, keys, values)
        qk, qv = _coded(self.codecs[0].quantize(keys)), _coded(self.codecs[1].quantize(values))
        self.rows = [
            r.append(packed_tokens(qk, b, 0, k), packed_tokens(qv, b, 0, k))
            for b, r in enumerate(self.rows)
        ]
        self.pending = k

    @rule(data=st.data())
    def commit(self, data: Any) -> None:
        counts = self.commit_drawn(data)
        event(f"turboquant commit: {'ragged' if len(set(counts)) > 1 else 'uniform'}")
        self.rows, self.pending = committed(self.rows, counts, self.pending), 0

    @rule(k=st.integers(1, 3), data=st.data())
    def speculate(self, k: int, data: Any) -> None:
        """A verify forward of k draft tokens, then each row keeps its accepted prefix."""
        self.forward(k)
        self.commit(data)

    @rule()
    def save_load(self) -> None:
        """A save / load round trip: later forwards decode with codecs from the statics."""
        with tempfile.TemporaryDirectory() as where:
            path = f"{where}/tq.safetensors"
            ks.save(path, self.state)
            self.state = self.apply("save_load", ks.load, path)

    @invariant()
    def bookkeeping_matches(self) -> None:
        assert self.state.appended == self.pending
        pads = self.state.left_padding
        held = (
            [self.state.length - p for p in np.array(pads).tolist()] if pads is not None else None
        )
        assert (held or [self.state.length] * self.batch) == [r.length for r in self.rows]
        for side in ("key", "value"):  # the channels never change: every row's codec is one
            want = self.config[f"{side}_channels"]
            got = getattr(self.state, f"{side}_high_channels")
            assert (got is None) == (want is None)
            assert got is None or tuple(np.array(got).tolist()) == want


class TurboQuantMachine(TurboQuantRows):
    @initialize(
        data=st.data(),
        heads=st.integers(1, 2),
        dims=st.tuples(st.sampled_from([8, 12, 16]), st.sampled_from([8, 12, 16])),
        side_bits=st.tuples(st.sampled_from([2, 3, 2.5, 3.5]), st.sampled_from([2, 3, 2.5])),
        seed=st.integers(0, 3),
        padded=st.booleans(),
    )
    def start(
        self,
        data: Any,
        heads: int,
        dims: tuple[int, int],
        side_bits: tuple[float, float],
        seed: int,
        padded: bool,
    ) -> None:
        chosen = []
        for dim, b in zip(dims, side_bits, strict=True):
            if not is_split(b):
                chosen.append(None)
                continue
            order = data.draw(st.permutations(range(dim)), label="channel order")
            chosen.append(tuple(sorted(order[: split_sizes(dim, b)[1]])))
        self.dims = dims
        self.config = {
            "heads": heads,
            "key_dim": dims[0],
            "value_dim": dims[1],
            "key_bits": side_bits[0],
            "value_bits": side_bits[1],
            "key_channels": chosen[0],
            "value_channels": chosen[1],
            "seed": seed,
            "empty": False,  # a split side's channels come with its first tokens
        }
        self.codecs = (
            reference_codec(dims[0], side_bits[0], seed, chosen[0]),
            reference_codec(dims[1], side_bits[1], seed + 1, chosen[1]),
        )
        event(f"turboquant bits {side_bits}")
        self.rng = np.random.default_rng(data.draw(st.integers(0, 2**31), label="seed"))
        state = data.draw(turboquant_kv_states(padded=padded, **self.config), label="initial")
        self.begin(data, state)


TestTurboQuantMachine = TurboQuantMachine.TestCase


def _unpadded(machine: Any) -> bool:
    pads = machine.state.left_padding
    return pads is None or not any(np.array(pads).tolist())


class HybridMachine(TurboQuantRows):
    @initialize(
        data=st.data(),
        schemes=st.sampled_from([("turboquant", "uniform"), ("uniform", "turboquant")]),
        tq_bits=st.sampled_from([2, 3, 2.5, 3.5]),
        uniform_bits=st.sampled_from([2, 4, 8]),
        seed=st.integers(0, 3),
        padded=st.booleans(),
    )
    def start_hybrid(
        self,
        data: Any,
        schemes: tuple[str, str],
        tq_bits: float,
        uniform_bits: int,
        seed: int,
        padded: bool,
    ) -> None:
        self.dims = (32, 64)  # mx.quantize's groups (32) divide both
        side_bits = [tq_bits if s == "turboquant" else uniform_bits for s in schemes]
        chosen: list[tuple[int, ...] | None] = [None, None]
        codecs: list[Any] = []
        for i, (dim, scheme) in enumerate(zip(self.dims, schemes, strict=True)):
            if scheme == "uniform":
                codecs.append(UniformCodec(32, uniform_bits))
                continue
            if is_split(tq_bits):
                order = data.draw(st.permutations(range(dim)), label="channel order")
                chosen[i] = tuple(sorted(order[: split_sizes(dim, tq_bits)[1]]))
            codecs.append(reference_codec(dim, tq_bits, seed + i, chosen[i]))
        self.codecs = tuple(codecs)
        self.config = {
            "heads": 1,
            "key_dim": self.dims[0],
            "value_dim": self.dims[1],
            "key_bits": side_bits[0],
            "value_bits": side_bits[1],
            "key_channels": chosen[0],
            "value_channels": chosen[1],
            "form": "hybrid",
            "key_scheme": schemes[0],
            "value_scheme": schemes[1],
            "group_size": 32,
            "seed": seed,
            "empty": False,
        }
        event(f"hybrid {schemes} tq bits {tq_bits}")
        self.rng = np.random.default_rng(data.draw(st.integers(0, 2**31), label="seed"))
        state = data.draw(turboquant_kv_states(padded=padded, **self.config), label="initial")
        self.begin(data, state)

    def noise(self, shape: tuple[int, ...]) -> mx.array:
        # float16, as a model's keys: the uniform side's scales take the keys' dtype
        return mx.array(self.rng.standard_normal(shape).astype(np.float16))

    @precondition(_unpadded)
    @rule(k=st.integers(1, 3))
    def forward(self, k: int) -> None:
        super().forward(k)

    @precondition(_unpadded)
    @rule(k=st.integers(1, 3), data=st.data())
    def speculate(self, k: int, data: Any) -> None:
        super().speculate(k, data)

    @precondition(lambda self: not _unpadded(self))
    @rule()
    def padded_rows_are_refused(self) -> None:
        with pytest.raises(ks.StateError, match="no left padding"):
            to_mlx_vlm(self.state)


TestHybridMachine = HybridMachine.TestCase
