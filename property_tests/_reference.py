"""NumPy reference models and checks shared by the property tests.

A reference row is what one batch row of a state *means*: its valid tokens (keys and values
as bit-exact numpy arrays, (H, T, D)) in attention order. The tests compare what kvstate
holds against rows kept here by plain numpy list operations, never against kvstate itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ChunkedKVCache

import kvstate as ks
from kvstate.adapters import from_mlx_lm, to_mlx_lm
from kvstate.kinds import record_forward
from kvstate.quantization import lanes
from kvstate.testing import assert_states_equal, frozen_copy

_BITS = {mx.float32: mx.uint32, mx.float16: mx.uint16, mx.bfloat16: mx.uint16}


def bits(a: mx.array) -> np.ndarray:
    """A numpy copy of `a` whose equality is bitwise (floats viewed as unsigned ints)."""
    view = _BITS.get(a.dtype)
    return np.array(a.view(view) if view is not None else a)


# ---------------------------------------------------------------------------------------
# No transform and no forward may ever change a state it was given.
# ---------------------------------------------------------------------------------------


class Witness:
    """Remembers every state handed to or returned by kvstate, with a frozen copy, and checks
    that none of them ever changes afterwards (transforms are pure; MLX arrays are not)."""

    def __init__(self) -> None:
        self.seen: list[tuple[Any, Any, str]] = []

    def hold(self, state: Any, what: str) -> Any:
        self.seen.append((state, frozen_copy(state), what))
        return state

    def check(self) -> None:
        for state, frozen, what in self.seen:
            assert_states_equal(state, frozen, what=f"{what} changed in place")


# ---------------------------------------------------------------------------------------
# Rows of a state
# ---------------------------------------------------------------------------------------


@attrs.frozen
class Row:
    """One row's valid tokens: keys (H, T, Dk), values (H, T, Dv), bit-exact; `ordered` is
    False once kvstate may hold them in another order (dense ragged commits move tokens;
    keys carry their RoPE, so attention does not care)."""

    keys: np.ndarray
    values: np.ndarray
    ordered: bool = True

    @property
    def length(self) -> int:
        return int(self.keys.shape[1])

    def take(self, n: int) -> Row:
        return Row(self.keys[:, :n], self.values[:, :n], self.ordered)

    def append(self, keys: np.ndarray, values: np.ndarray) -> Row:
        if self.length == 0:  # an empty row's head dims are unknown
            return Row(keys, values, self.ordered)
        return Row(
            np.concatenate([self.keys, keys], axis=1),
            np.concatenate([self.values, values], axis=1),
            self.ordered,
        )


def committed(rows: Sequence[Row], counts: Sequence[int], pending: int) -> list[Row]:
    """Rows after each keeps its own count of the last `pending` tokens. A ragged commit may
    reorder a row that kept fewer than the most (padded kinds move its oldest tokens into the
    hole), so such a row compares as a multiset from then on."""
    ragged = len(set(counts)) > 1
    out = []
    for r, c in zip(rows, counts, strict=True):
        kept = r.take(r.length - pending + c)
        out.append(Row(kept.keys, kept.values, kept.ordered and not (ragged and c < max(counts))))
    return out


def packed_tokens(arrays: Sequence[mx.array], b: int, lo: int, hi: int) -> np.ndarray:
    """Row b's positions lo..hi of a quantized side's arrays (packed words, scales, norms...)
    side by side as (H, T, X) int64, bit for bit."""
    return np.concatenate([bits(a[b, :, lo:hi]).astype(np.int64) for a in arrays], axis=-1)


def empty_row(heads: int, k_dim: int, v_dim: int, dtype: Any) -> Row:
    return Row(np.zeros((heads, 0, k_dim), dtype), np.zeros((heads, 0, v_dim), dtype))


def _sorted_tokens(keys: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Tokens as rows of one matrix (T, H*Dk + H*Dv), sorted: a multiset of tokens."""
    tokens = np.concatenate(
        [
            keys.transpose(1, 0, 2).reshape(keys.shape[1], -1),
            values.transpose(1, 0, 2).reshape(values.shape[1], -1),
        ],
        axis=1,
    )
    if tokens.shape[0] == 0:
        return tokens
    return tokens[np.lexsort(tokens.T[::-1])]


def assert_rows_equal(actual: Sequence[Row], expected: Sequence[Row], what: str = "") -> None:
    assert len(actual) == len(expected), (
        f"{what}: {len(actual)} rows, reference has {len(expected)}"
    )
    for b, (a, e) in enumerate(zip(actual, expected, strict=True)):
        assert a.length == e.length, (
            f"{what}: row {b} holds {a.length} tokens, reference {e.length}"
        )
        if a.length == 0:
            continue
        if e.ordered:
            assert np.array_equal(a.keys, e.keys), f"{what}: row {b} keys differ"
            assert np.array_equal(a.values, e.values), f"{what}: row {b} values differ"
        else:
            same = np.array_equal(
                _sorted_tokens(a.keys, a.values), _sorted_tokens(e.keys, e.values)
            )
            assert same, f"{what}: row {b} holds other tokens than the reference (as a multiset)"


def dense_rows(state: ks.DenseKV) -> list[Row]:
    """Each row's valid region [left_padding[b], length) of a DenseKV, read with numpy."""
    batch = ks.batch_size(state)
    if state.keys is None or state.values is None:
        assert state.length == 0, "a DenseKV without arrays must have length 0"
        return [Row(np.zeros((0, 0, 0)), np.zeros((0, 0, 0))) for _ in range(batch)]
    keys, values = bits(state.keys), bits(state.values)
    assert keys.shape[0] == values.shape[0] == batch, "keys/values/left_padding batch differ"
    assert keys.shape[2] >= state.length and values.shape[2] >= state.length
    if state.concatenate and state.left_padding is None:
        assert keys.shape[2] == state.length, "a concatenate state's buffer is exactly its length"
    pads = np.array(state.left_padding).tolist() if state.left_padding is not None else [0] * batch
    return [
        Row(keys[b, :, p : state.length], values[b, :, p : state.length])
        for b, p in enumerate(pads)
    ]


def _row_slices(a: mx.array | None, batch: int, lo: list[int], hi: int) -> list[Any]:
    if a is None:
        return [None] * batch
    b = bits(a)
    return [b[r, :, lo[r] : hi] for r in range(batch)]


def meaning(state: Any, *, history: bool = True) -> list[Any]:
    """What each row of a state means, as nested tuples of numpy arrays and ints, read with
    numpy from the fields: the valid tokens (in buffer order), positions, and with
    `history` what a later `commit_prefix` needs (`previous`, recurrent bookkeeping).

    Two states whose meanings are equal behave the same under every later forward and
    transform; their buffers may differ where no row looks (capacity, padding).
    """
    batch = ks.batch_size(state)
    if isinstance(state, ks.DenseKV):
        if state.keys is None:
            return [("dense", 0)] * batch
        pads = _pads(state.left_padding, batch)
        keys = _row_slices(state.keys, batch, pads, state.length)
        values = _row_slices(state.values, batch, pads, state.length)
        return [
            ("dense", k.shape[1], k, v) if k.shape[1] else ("dense", 0)
            for k, v in zip(keys, values, strict=True)
        ]
    if isinstance(state, ks.QuantizedKV):
        if state.keys is None or state.values is None or state.length == 0:
            return [("quantized", 0)] * batch  # (an empty state's padding has no tokens)
        pads = _pads(state.left_padding, batch)
        parts = [_row_slices(a, batch, pads, state.length) for a in (*state.keys, *state.values)]
        return [("quantized", state.length - pads[r], *(p[r] for p in parts)) for r in range(batch)]
    if isinstance(state, ks.TurboQuantKV):
        if state.key_indices is None or state.length == 0:
            return [("turboquant", 0)] * batch
        pads = _pads(state.left_padding, batch)
        fields = [  # a split side's high parts, a uniform side's scales / biases (else None)
            getattr(state, f"{side}_{part}")
            for side in ("key", "value")
            for part in ("norms", "indices", "high_norms", "high_indices", "scales", "biases")
        ]
        parts = [_row_slices(a, batch, pads, state.length) for a in fields if a is not None]
        return [
            ("turboquant", state.length - pads[r], *(p[r] for p in parts)) for r in range(batch)
        ]
    if isinstance(state, ks.ChunkedKV):
        # What the next forward sees: it first drops the front past chunk_size
        # (maybe_trim_front), so entries there are never read again.
        n = state.offset - state.start_position
        front = max(0, n - state.chunk_size)
        seen = n > front  # no entries: as if never written
        keys = _row_slices(state.keys if seen else None, batch, [front] * batch, n)
        values = _row_slices(state.values if seen else None, batch, [front] * batch, n)
        prev: list[Any] = [None] * batch
        if history and state.previous is not None:
            p = state.previous
            prev = meaning(p) if p.keys is not None else [("empty",)] * batch
        return [
            ("chunked", state.offset, state.start_position + front, keys[r], values[r], prev[r])
            for r in range(batch)
        ]
    if isinstance(state, ks.RecurrentState):
        arrays = [None if a is None else bits(a) for a in state.arrays]
        lps = _pads(state.left_padding, batch)  # None and zeros mean the same: no padding
        lns = np.array(state.lengths).tolist() if state.lengths is not None else [None] * batch
        return [
            (
                "recurrent",
                # mlx-lm's recurrent layers read a None array as zeros
                tuple(None if a is None or not a[r].any() else a[r] for a in arrays),
                *((lps[r], lns[r]) if history else ()),
            )
            for r in range(batch)
        ]
    if isinstance(state, ks.RotatingKV):
        return _rotating_meaning(state, batch, history)
    if isinstance(state, ks.QuantizedRotatingKV):
        # Three windows of one bookkeeping: the packed words, scales and biases.
        per_lane = [_rotating_meaning(w, batch, history) for w in lanes(state)]
        return [("quantized window", *(p[r] for p in per_lane)) for r in range(batch)]
    if isinstance(state, ks.PooledKV):
        return _pooled_meaning(state, batch, history)
    if isinstance(state, (ks.BufferedWindowKV, ks.StaticPrefixKV)):
        return _window_meaning(state, batch)
    if isinstance(state, (ks.ListState, ks.ModelState)):
        parts = state.states if isinstance(state, ks.ListState) else state.layers
        per_part = [meaning(p, history=history) for p in parts]
        return [tuple(p[r] for p in per_part) for r in range(batch)]
    raise NotImplementedError(type(state).__name__)


def _window_meaning(state: ks.BufferedWindowKV | ks.StaticPrefixKV, batch: int) -> list[Any]:
    """A buffered window: what the next query (at offset) can see, the last max_size - 1
    positions held. A static prefix: positions [0, offset) (decoders mask the rest)."""
    if isinstance(state, ks.BufferedWindowKV):
        held = state.offset - state.start_position
        seen = min(held, state.max_size - 1)
        tag: tuple[Any, ...] = ("buffered", state.offset, seen)
    else:
        held = seen = state.offset
        tag = ("static", state.offset, state.read_only)
    keys = _row_slices(state.keys if seen else None, batch, [held - seen] * batch, held)
    values = _row_slices(state.values if seen else None, batch, [held - seen] * batch, held)
    return [(*tag, keys[r], values[r]) for r in range(batch)]


def _pooled_meaning(state: ks.PooledKV, batch: int, history: bool) -> list[Any]:
    """Per row: its pooled tokens, the remainder window's raw inputs, the padding its next
    inputs carry; with `history`, the row before the pending forward."""
    from kvstate._pooled import rows_of

    prev: list[Any] = [None] * batch
    if history and state.previous is not None:
        prev = _pooled_meaning(state.previous, batch, False)
    found = []
    for b, (rem, pool, pad) in enumerate(rows_of(state, batch)):
        pooled = bits(state.pooled[b, :pool]) if pool and state.pooled is not None else None
        kv = gate = None
        if rem and state.buf_kv is not None and state.buf_gate is not None:
            kv, gate = bits(state.buf_kv[b, :rem]), bits(state.buf_gate[b, :rem])
        found.append(("pooled", state.ratio, pool, pooled, rem, kv, gate, pad, prev[b]))
    return found


def _pads(left_padding: mx.array | None, batch: int) -> list[int]:
    if left_padding is None:
        return [0] * batch
    return [int(v) for v in np.array(left_padding).tolist()]


def _rotating_meaning(state: ks.RotatingKV, batch: int, history: bool) -> list[Any]:
    """Each row's window as mlx-lm reads it (`window_rows`), cut to what any later forward
    can still attend to (`window_view`), with the row's RoPE position."""
    prev: list[Any] = [None] * batch
    if history and state.previous is not None:
        p = state.previous
        empty = p.keys is None and ks.batch_size(p) != batch
        prev = [("empty",)] * batch if empty else meaning(p)
    rows = []
    for b, (offset, k, v) in enumerate(window_rows(state)):
        if k is not None and v is not None:
            k, v = (
                window_view(k, state.keep, state.max_size),
                window_view(v, state.keep, state.max_size),
            )
        if k is not None and k.shape[1] == 0:  # no entries: as if never written
            k = v = None
        rows.append(("rotating", offset, k, v, prev[b]))
    return rows


def window_rows(state: ks.RotatingKV) -> list[tuple[int, Any, Any]]:
    """Per row: (RoPE position, keys (H, N, Dk), values) of every entry the window holds,
    oldest first, as mlx-lm reads them (its own `_temporal_order`, minus the row's left
    padding); None, None for an empty window."""
    batch = ks.batch_size(state)
    if state.left_padding is None:
        offsets = [state.offset] * batch
    else:
        assert state.offsets is not None
        offsets = [int(v) for v in np.array(state.offsets).tolist()]
    if state.keys is None or state.values is None:
        return [(offsets[b], None, None) for b in range(batch)]
    cache = to_mlx_lm(state)
    if state.left_padding is None:
        keys = bits(cache._temporal_order(cache.keys))
        values = bits(cache._temporal_order(cache.values))
        starts = [0] * batch
    else:
        cache._temporal_order()
        keys = bits(cache.keys[..., : cache._idx, :])
        values = bits(cache.values[..., : cache._idx, :])
        starts = [max(0, int(v)) for v in np.array(cache.left_padding).tolist()]
    return [(offsets[b], keys[b, :, starts[b] :], values[b, :, starts[b] :]) for b in range(batch)]


def window_view(entries: np.ndarray, keep: int, max_size: int) -> np.ndarray:
    """(H, N, D) oldest first -> what a later forward can attend to (see above)."""
    limit = max_size - 1
    if entries.shape[1] <= limit:
        return entries
    return np.concatenate([entries[:, :keep], entries[:, entries.shape[1] - (limit - keep) :]], 1)


def assert_same(a: Any, b: Any, where: str = "") -> None:
    """Recursive equality of `meaning` values: numpy arrays bitwise, the rest with ==."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        assert isinstance(a, np.ndarray) and isinstance(b, np.ndarray), f"{where}: array vs not"
        assert a.shape == b.shape, f"{where}: shapes {a.shape} != {b.shape}"
        assert np.array_equal(a, b), f"{where}: arrays differ"
        return
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        assert len(a) == len(b), f"{where}: lengths {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
        return
    assert a == b, f"{where}: {a!r} != {b!r}"


# ---------------------------------------------------------------------------------------
# A forward at the cache level: mlx-lm's own update_and_fetch is the oracle.
# ---------------------------------------------------------------------------------------


def cache_forward(state: Any, keys: mx.array, values: mx.array) -> Any:
    """What a model's attention layer does to `state` when it runs K new tokens:
    to mlx-lm cache objects, `update_and_fetch(keys (B, H, K, Dk), values)`, and back."""
    cache = to_mlx_lm(state)
    if isinstance(cache, ChunkedKVCache):
        cache.maybe_trim_front()  # what llama4's chunked attention does before each update
    cache.update_and_fetch(keys, values)
    return record_forward(from_mlx_lm(cache), state, keys.shape[2])


def noise(rng: np.random.Generator, shape: tuple[int, ...], dtype: mx.Dtype) -> mx.array:
    return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)
