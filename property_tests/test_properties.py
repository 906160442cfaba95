"""Algebraic properties of the transforms, for every kind of state (composites included).

Rows are compared through `meaning` (each row's valid tokens, positions and rollback
history, read with numpy), so a property holds or fails on what the rows mean, not on
where in a buffer the implementation chose to put them.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import attrs
import mlx.core as mx
import numpy as np
from hypothesis import assume, given
from hypothesis import strategies as st

import kvstate as ks
from kvstate import tree_flatten
from kvstate.adapters import from_mlx_lm, to_mlx_lm
from kvstate.kinds import appended_of
from kvstate.testing import (
    DTYPES,
    QUANT_BITS,
    ROTATION_KINDS,
    accepted_counts,
    assert_states_equal,
    chunked_kv_states,
    dense_kv_states,
    layer_states,
    list_states,
    model_states,
    quantized_kv_states,
    recurrent_checkpoints,
    recurrent_states,
    rotating_kv_states,
    turboquant_kv_states,
)
from kvstate.testing._window import window_update

from ._reference import (
    Witness,
    _sorted_tokens,
    assert_same,
    bits,
    cache_forward,
    meaning,
    noise,
)

# ---------------------------------------------------------------------------------------
# Strategies
# ---------------------------------------------------------------------------------------


def any_state() -> st.SearchStrategy[Any]:
    """A state of any kind: a layer state, a ListState or a ModelState of mixed layers."""
    return st.one_of(
        layer_states(),
        list_states(layer_states),
        model_states(layer_states),
    )


def parts(state: Any) -> list[Any]:
    if isinstance(state, ks.kinds.Composite):
        return [p for s in state.parts for p in parts(s)]
    return [state]


def takes_rows(state: Any) -> bool:
    """Unpadded kinds (chunked, buffered windows, static prefixes) have no batch axis while empty; an empty window
    with `keep` has no batched form to take several rows into."""

    def one(p: Any) -> bool:
        if isinstance(p, (ks.ChunkedKV, ks.BufferedWindowKV, ks.StaticPrefixKV)):
            return p.keys is not None
        if isinstance(p, (ks.RotatingKV, ks.QuantizedRotatingKV)):
            return not (p.keep and p.keys is None)
        return True

    return all(one(p) for p in parts(state))


def batches(state: Any) -> bool:
    """merge / extend accept it (with a copy of itself): rows to batch, no `keep` prefix
    (a window with one has no batched form: it is not `batchable`)."""
    keep = any(
        isinstance(p, (ks.RotatingKV, ks.QuantizedRotatingKV)) and not ks.capabilities(p).batchable
        for p in parts(state)
    )
    return takes_rows(state) and not keep


@st.composite
def same_config_rows(draw: Any) -> list[Any]:
    """2..4 single-row states of one kind and configuration that `merge` accepts."""
    n = draw(st.integers(2, 4), label="n")
    kinds = ["dense", "quantized", "chunked", "recurrent", "rotating", "turboquant"]
    kind = draw(st.sampled_from(kinds), label="kind")
    dtype = draw(st.sampled_from(DTYPES))
    if kind == "dense":
        config = {"heads": draw(st.integers(1, 2)), "k_dim": 4, "v_dim": 2, "dtype": dtype}
        return [draw(dense_kv_states(batch=1, **config)) for _ in range(n)]
    if kind == "quantized":
        length = draw(st.integers(1, 6))
        config = {"bits": draw(st.sampled_from(QUANT_BITS)), "group_size": 32, "dtype": dtype}
        config |= {"heads": 1, "k_groups": 1, "v_groups": 1, "length": length}
        config |= {"rotation": draw(st.sampled_from(ROTATION_KINDS)), "seed": 1, "pads": (0, 8)}
        config |= {"exact_latest": draw(st.sampled_from([0, 2]))}
        return [draw(quantized_kv_states(batch=1, **config)) for _ in range(n)]
    if kind == "turboquant":
        config = {"heads": 1, "key_dim": 12, "value_dim": 8, "key_bits": 3, "value_bits": 2}
        config |= {"seed": 1, "padded": False, "empty": False}
        return [draw(turboquant_kv_states(batch=1, **config)) for _ in range(n)]
    if kind == "chunked":
        config = {"chunk_size": 4, "heads": 1, "k_dim": 2, "v_dim": 2, "dtype": dtype}
        config |= {"start": draw(st.integers(0, 3)), "held": draw(st.integers(1, 4))}
        config |= {"appended": draw(st.integers(0, 2)), "empty": False}
        return [draw(chunked_kv_states(batch=1, **config)) for _ in range(n)]
    if kind == "rotating":
        config = {"heads": 1, "k_dim": 2, "v_dim": 4, "dtype": dtype, "keep": 0}
        config |= {"max_size": draw(st.integers(2, 5))}
        return [draw(rotating_kv_states(batch=1, **config)) for _ in range(n)]
    shapes = draw(st.lists(st.tuples(st.integers(1, 3)), min_size=1, max_size=2).map(tuple))
    return [draw(recurrent_states(batch=1, shapes=shapes, dtype=dtype)) for _ in range(n)]


def indices(batch: int, min_size: int = 1) -> st.SearchStrategy[list[int]]:
    return st.lists(st.integers(-batch, batch - 1), min_size=min_size, max_size=4)


# ---------------------------------------------------------------------------------------
# Row algebra
# ---------------------------------------------------------------------------------------


@given(state=any_state(), n=st.integers(1, 3), data=st.data())
def test_row_select_of_tile_is_the_row(state, n, data):
    """row_select(tile(s, n), i*n + j) == row_select(s, i) for every copy j."""
    assume(takes_rows(state))
    witness = Witness()
    witness.hold(state, "input")
    tiled = ks.tile(state, n)
    assert ks.batch_size(tiled) == ks.batch_size(state) * n
    i = data.draw(st.integers(0, ks.batch_size(state) - 1), label="i")
    j = data.draw(st.integers(0, n - 1), label="j")
    assert_same(meaning(ks.row_select(tiled, i * n + j)), meaning(ks.row_select(state, i)))
    assert_same(meaning(tiled), [r for r in meaning(state) for _ in range(n)])
    witness.check()


@given(xs=same_config_rows(), data=st.data())
def test_extract_of_merge_is_the_input(xs, data):
    """extract(merge(xs), i) == xs[i] on the valid region (merge pads, extract unpads)."""
    witness = Witness()
    for x in xs:
        witness.hold(x, "input")
    merged = ks.merge(xs)
    assert ks.batch_size(merged) == len(xs)
    i = data.draw(st.integers(0, len(xs) - 1), label="i")
    assert_same(meaning(ks.extract(merged, i), history=False), meaning(xs[i], history=False))
    witness.check()


@given(state=any_state(), data=st.data())
def test_filter_composes(state, data):
    """filter(filter(s, a), b) == filter(s, [a[j] for j in b])."""
    assume(takes_rows(state))
    a = data.draw(indices(ks.batch_size(state)), label="a")
    b = data.draw(indices(len(a)), label="b")
    witness = Witness()
    witness.hold(state, "input")
    twice = ks.filter(ks.filter(state, a), b)
    once = ks.filter(state, [a[j] for j in b])
    assert_same(meaning(twice), meaning(once))
    assert_same(meaning(once), [meaning(state)[a[j]] for j in b])
    witness.check()


@given(a=same_config_rows(), data=st.data())
def test_extend_is_merge_of_the_rows(a, data):
    """extend(merge(xs[:k]), merge(xs[k:])) holds the rows of xs in order."""
    k = data.draw(st.integers(1, len(a) - 1), label="k")
    extended = ks.extend(ks.merge(a[:k]), ks.merge(a[k:]))
    expected = [meaning(x, history=False)[0] for x in a]
    assert_same(meaning(extended, history=False), expected)


# ---------------------------------------------------------------------------------------
# commit_prefix after a verify == decoding only the accepted prefix (KV kinds, cache level)
# ---------------------------------------------------------------------------------------


def kv_state() -> st.SearchStrategy[Any]:
    return st.one_of(
        dense_kv_states(empty=False, concatenate=False),
        dense_kv_states(),
        quantized_kv_states(),
        chunked_kv_states(),
        rotating_kv_states(),
    )


def head_dims(state: Any) -> tuple[int, int, int, mx.Dtype]:
    """(heads, Dk, Dv, dtype) a forward into `state` must have."""
    if isinstance(state, ks.QuantizedKV):
        if state.keys is None or state.values is None:
            return 1, state.key_group_size, state.value_group_size, mx.float32
        k, v = state.keys, state.values
        dk = k[1].shape[3] * state.key_group_size - state.key_pad
        dv = v[1].shape[3] * state.value_group_size - state.value_pad
        return k[0].shape[1], dk, dv, k[1].dtype
    if state.keys is None:
        return 2, 4, 4, mx.float16
    return state.keys.shape[1], state.keys.shape[3], state.values.shape[3], state.keys.dtype


@given(state=kv_state(), k=st.integers(1, 4), follow=st.integers(1, 3), data=st.data())
def test_commit_after_verify_equals_decoding_the_prefix(state, k, follow, data):
    """Verify K tokens then keep `a` == decode only those `a`; and the two stay equal
    under a further forward (what a kind keeps for later, a window's front, counts too)."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31), label="seed"))
    batch = ks.batch_size(state)
    heads, dk, dv, dtype = head_dims(state)
    keys, values = (
        noise(rng, (batch, heads, k, dk), dtype),
        noise(rng, (batch, heads, k, dv), dtype),
    )
    witness = Witness()
    witness.hold(state, "input")
    verified = witness.hold(cache_forward(state, keys, values), "verified")
    a = data.draw(accepted_counts(verified, ragged=False), label="accepted")
    committed = witness.hold(ks.commit_prefix(verified, a), "committed")
    base = ks.commit_prefix(state, appended_of(state))
    direct = cache_forward(base, keys[:, :, :a], values[:, :, :a]) if a else base
    assert committed.appended == 0
    assert_same(meaning(committed, history=False), meaning(direct, history=False))
    more_k = noise(rng, (batch, heads, follow, dk), dtype)
    more_v = noise(rng, (batch, heads, follow, dv), dtype)
    after_commit = cache_forward(committed, more_k, more_v)
    after_direct = cache_forward(direct, more_k, more_v)
    assert_same(meaning(after_commit, history=False), meaning(after_direct, history=False))
    witness.check()


@given(state=dense_kv_states(empty=False), k=st.integers(1, 4), data=st.data())
def test_ragged_dense_commit_keeps_each_rows_prefix(state, k, data):
    """A ragged commit keeps row b's first accepted[b] tokens (as a multiset: it may move
    them inside the buffer) and its RoPE position (row length) is exactly right."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31), label="seed"))
    batch, heads = ks.batch_size(state), state.keys.shape[1]
    dk, dv, dtype = state.keys.shape[3], state.values.shape[3], state.keys.dtype
    keys, values = (
        noise(rng, (batch, heads, k, dk), dtype),
        noise(rng, (batch, heads, k, dv), dtype),
    )
    verified = cache_forward(state, keys, values)
    accepted = data.draw(accepted_counts(verified, ragged=True), label="accepted")
    committed = ks.commit_prefix(verified, accepted)
    counts = [accepted] * batch if isinstance(accepted, int) else accepted
    before = meaning(state)
    for b, (row, c) in enumerate(zip(meaning(committed), counts, strict=True)):
        exp_k = np.concatenate([before[b][2], bits(keys)[b, :, :c]], axis=1)
        exp_v = np.concatenate([before[b][3], bits(values)[b, :, :c]], axis=1)
        assert row[1] == exp_k.shape[1], f"row {b}: length {row[1]}, expected {exp_k.shape[1]}"
        assert np.array_equal(_sorted_tokens(row[2], row[3]), _sorted_tokens(exp_k, exp_v))


@given(state=recurrent_states(), data=st.data())
def test_recurrent_commit_takes_each_rows_checkpoint(state, data):
    """commit_prefix(s, a, checkpoints) holds checkpoint entry a[b] in row b."""
    checkpoints = data.draw(recurrent_checkpoints(state), label="checkpoints")
    accepted = data.draw(accepted_counts(state), label="accepted")
    counts = [accepted] * ks.batch_size(state) if isinstance(accepted, int) else accepted
    committed = ks.commit_prefix(state, accepted, checkpoints)
    for b, c in enumerate(counts):
        for i, (a, cp) in enumerate(zip(committed.arrays, checkpoints, strict=True)):
            if cp is None:
                assert a is None
            else:
                assert np.array_equal(bits(a)[b], bits(cp)[b, c]), f"row {b} array {i}"


# ---------------------------------------------------------------------------------------
# Round trips
# ---------------------------------------------------------------------------------------


def assert_identical(a: Any, b: Any) -> None:
    """Field for field: same classes and statics, every array bitwise equal with its dtype
    and shape, and the statics of the same Python types (True is not 1)."""
    assert_states_equal(a, b)
    assert repr(tree_flatten(a)[1]) == repr(tree_flatten(b)[1])


@given(state=any_state(), meta=st.dictionaries(st.text(max_size=5), st.text(max_size=5)))
def test_save_load_round_trip_is_identity(state, meta):
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "state.safetensors")
        ks.save(path, state, metadata=meta)
        loaded, got = ks.load(path, return_metadata=True)
    assert_identical(loaded, state)
    assert got == meta


def forgetful(state: Any) -> Any:
    """What an mlx-lm cache object cannot carry: the last forward's count and the state
    before it (`appended`, `previous`) stay with the state."""
    if isinstance(state, ks.kinds.Composite):
        return ks.kinds.with_parts(state, tuple(forgetful(s) for s in state.parts))
    changes: dict[str, Any] = {"appended": 0}
    if hasattr(state, "previous"):
        changes["previous"] = None
    return attrs.evolve(state, **changes)


def in_mlx_lm(state: Any) -> Any:
    """What mlx-lm's classes cannot tell apart: it has no SimpleKVCache (mlx-vlm's), so a
    DenseKV in that form comes back as the ConcatenateKVCache form holding the same arrays."""
    if isinstance(state, ks.kinds.Composite):
        return ks.kinds.with_parts(state, tuple(in_mlx_lm(s) for s in state.parts))
    return attrs.evolve(state, simple=False) if isinstance(state, ks.DenseKV) else state


@given(state=any_state())
def test_adapters_round_trip_is_identity(state):
    """from_mlx_lm(to_mlx_lm(s)) == s field for field (bitwise), and shares no array
    object with s (a model's in-place write into a cache must not reach the state)."""
    caches = to_mlx_lm(state)
    back = from_mlx_lm(caches)
    assert_identical(back, in_mlx_lm(forgetful(state)))
    ids = {id(a) for a in tree_flatten(state)[0]}
    assert not ids & {id(a) for a in tree_flatten(back)[0]}


# ---------------------------------------------------------------------------------------
# Purity: no transform ever changes its input
# ---------------------------------------------------------------------------------------


@given(state=any_state(), data=st.data())
def test_no_transform_changes_its_input_and_every_output_passes_check(state, data):
    """Purity, and consistency by construction: whatever a transform returns passes
    `kvstate.check` (the check the transforms skip to stay fast)."""
    ks.check(state)  # the strategies draw consistent states
    witness = Witness()
    witness.hold(state, "input")
    batch = ks.batch_size(state)
    outputs = [ks.snapshot(state)]
    if batches(state):
        outputs += [ks.merge([state, state]), ks.extend(state, state)]
    if takes_rows(state):  # (else these refuse: an empty unpadded kind has no batch axis)
        outputs += [
            ks.tile(state, data.draw(st.integers(1, 3))),
            ks.row_select(state, data.draw(indices(batch))),
            ks.filter(state, data.draw(indices(batch))),
            ks.extract(state, data.draw(st.integers(-batch, batch - 1))),
        ]
    accepted = data.draw(accepted_counts(state), label="accepted")
    outputs.append(ks.commit_prefix(state, accepted, _checkpoints(state, data)))
    caches = to_mlx_lm(state)
    outputs.append(from_mlx_lm(caches))
    for out in outputs:
        ks.check(ks.eval(out))
    witness.check()


def _checkpoints(state: Any, data: Any) -> Any:
    """Checkpoints that fit `state`: per recurrent part, drawn; None elsewhere."""
    if isinstance(state, ks.RecurrentState):
        return data.draw(recurrent_checkpoints(state))
    if isinstance(state, ks.kinds.Composite):
        return tuple(_checkpoints(s, data) for s in state.parts)
    return None


# ---------------------------------------------------------------------------------------
# The strategies themselves
# ---------------------------------------------------------------------------------------


@given(state=rotating_kv_states(), n=st.integers(1, 4), data=st.data())
def test_window_strategy_mirrors_mlx_lm(state, n, data):
    """The strategies' own window forward (kvstate's core cannot import mlx-lm) is mlx-lm's
    RotatingKVCache / BatchRotatingKVCache update, field for field; so every window the
    strategy builds (from empty, forward by forward) is one mlx-lm could hold."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31), label="seed"))
    heads, dk, dv, dtype = head_dims(state)
    batch = ks.batch_size(state)
    keys, values = (
        noise(rng, (batch, heads, n, dk), dtype),
        noise(rng, (batch, heads, n, dv), dtype),
    )
    assert_identical(
        window_update(state, keys, values), forgetful(cache_forward(state, keys, values))
    )


# ---------------------------------------------------------------------------------------
# Regressions: bugs these properties found (fixed; the cases stay covered).
# ---------------------------------------------------------------------------------------


def test_extend_of_empty_recurrent_states_keeps_every_row():
    empty = ks.RecurrentState((None, None))
    assert ks.batch_size(ks.extend(empty, empty)) == 2


def test_extract_of_a_row_without_entries_is_an_empty_window():
    rng = np.random.default_rng(0)
    one = cache_forward(
        ks.RotatingKV(max_size=2),
        noise(rng, (1, 1, 1, 2), mx.float32),
        noise(rng, (1, 1, 1, 2), mx.float32),
    )
    pending = ks.RotatingKV(left_padding=mx.array([1]), offsets=mx.array([-1]), max_size=2)
    row = ks.extract(ks.extend(pending, one), 0)
    assert row.offset >= 0
    ks.eval(ks.merge([row, one]))
