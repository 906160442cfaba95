"""`kvstate.check` and the places that run it (load, tree_unflatten, from_mlx_lm): a state built
from outside that does not agree with itself is refused, every problem named by its path."""

from __future__ import annotations

import re

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache

import kvstate as ks
from kvstate import kinds
from kvstate.adapters import from_mlx_lm

K = mx.zeros((2, 2, 8, 4))


def problems_of(state, values=True) -> str:
    with pytest.raises(ks.ShapeError) as info:
        ks.check(state, values=values)
    return str(info.value)


def test_keys_values_and_padding_of_different_batches_are_all_reported():
    """This state used to build, then row_select(s, [2]) returned memory never written."""
    state = kinds.trusted(ks.DenseKV)(K, mx.zeros((3, 2, 8, 4)), mx.zeros((3,), mx.int32), length=4)
    message = problems_of(state)
    assert "keys (2, 2, 8, 4) and values (3, 2, 8, 4) disagree in batch" in message


Q4 = tuple(mx.quantize(mx.zeros((1, 1, 4, 64)), bits=4))

# Each case builds a state with `new(cls)`: `kinds.trusted` (no construction check), so that
# `check` sees it, or the class itself. `at_construction`: the constructor refuses it too
# (a shape-only problem); the others need the values (left padding past the length) or hold a
# part made unchecked, which only `check`, walking the whole tree, reaches.
CASES = [
    (lambda new: new(ks.DenseKV)(K, K, length=10**30), "length: 1000000000000000000000000000000 is out of range", True),
    (lambda new: new(ks.DenseKV)(K, K, length=4, appended=10**9), "appended: 1000000000 is out of range", True),
    (lambda new: new(ks.DenseKV)(K, K, length=4.0), "length: must be an int; got 4.0", True),
    (lambda new: new(ks.DenseKV)(K, K, length=True), "length: must be an int; got True", True),
    (lambda new: new(ks.DenseKV)(K, None, length=0), "keys and values must both be arrays or both None", True),
    (lambda new: new(ks.DenseKV)(K[0], K[0], length=0), "keys: must have 4 dims", True),
    (lambda new: new(ks.DenseKV)(K.astype(mx.int32), K, length=0), "keys: must be floating point", True),
    (lambda new: new(ks.DenseKV)(K, K, mx.zeros((2,)), length=4), "left_padding: must be a 1-d integer array", True),
    (lambda new: new(ks.DenseKV)(K, K, mx.zeros((3,), mx.int32), length=4), "left_padding: has 3 rows", True),
    (lambda new: new(ks.DenseKV)(K, K, mx.array([0, 5]), length=4), r"left_padding: entries \[5\]", False),
    (
        lambda new: new(ks.DenseKV)(K, K, mx.zeros((2,), mx.int32), length=4, concatenate=True),
        "concatenate: the ConcatenateKVCache form has no left_padding",
        True,
    ),
    (lambda new: new(ks.RotatingKV)(K, K, max_size=0), "max_size: 0 is out of range", True),
    (lambda new: new(ks.RotatingKV)(K, K, max_size=8, index=9), "index: 9 is out of range", True),
    (lambda new: new(ks.RotatingKV)(K, K, max_size=8, keep=9), "keep: 9 is out of range", True),
    (lambda new: new(ks.RotatingKV)(K, K, mx.zeros((2,), mx.int32), max_size=8), "needs per-row offsets", True),
    (lambda new: new(ks.RotatingKV)(K, K, max_size=8, rotated=True), "only the batched form", True),
    (
        lambda new: new(ks.RotatingKV)(K, K, previous=ks.RotatingKV(max_size=4), max_size=8),
        "previous: max_size and keep must be the state's own",
        True,
    ),
    (lambda new: new(ks.ChunkedKV)(K, K, chunk_size=4, offset=2, start_position=3), "start_position: 3", True),
    (lambda new: new(ks.ChunkedKV)(K, K, chunk_size=4, offset=20), r"offset - start_position: 20", True),
    (lambda new: new(ks.ChunkedKV)(chunk_size=0), "chunk_size: 0 is out of range", True),
    (lambda new: new(ks.ChunkedKV)(K, K, chunk_size=4, offset=5, start_position=2, appended=4), "appended: 4", True),
    (lambda new: new(ks.BufferedWindowKV)(K, K, max_size=8, offset=2, start_position=3), "start_position: 3", True),
    (lambda new: new(ks.BufferedWindowKV)(K, K, max_size=8, offset=9), r"offset - start_position: 9", True),
    (lambda new: new(ks.BufferedWindowKV)(K, K, max_size=8, offset=3, appended=4), "appended: 4", True),
    (
        lambda new: new(ks.QuantizedKV)(Q4, Q4, length=4, key_bits=8),
        "8 words per row, but 1 groups of 64 at 8 bits pack into 16",
        True,
    ),
    (lambda new: new(ks.QuantizedKV)(length=3), "length: 3 is out of range", True),
    (lambda new: new(ks.QuantizedKV)(value_bits=7), "value_bits: 7 is not one of", True),
    (
        lambda new: new(ks.RecurrentState)((mx.zeros((2, 3)), mx.zeros((3, 3)))),
        r"arrays: batch sizes \[2, 3\] differ",
        True,
    ),
    (
        lambda new: new(ks.RecurrentState)((mx.zeros((2, 3)),), mx.zeros((3,), mx.int32)),
        "left_padding: has 3",
        True,
    ),
    (lambda new: new(ks.RecurrentState)([mx.zeros((2, 3))]), "arrays: must be a tuple", True),
    (
        lambda new: new(ks.ModelState)((ks.DenseKV(K, K, length=4), ks.DenseKV(K[:1], K[:1], length=4))),
        r"layers\[1\]: batch 1, but other parts have 2",
        True,
    ),
    (
        lambda new: new(ks.ModelState)((ks.DenseKV(K, K, length=4, appended=1), ks.DenseKV(K, K, length=4))),
        r"the parts' last forward appended \[0, 1\] tokens",
        True,
    ),
    (
        lambda new: new(ks.ModelState)((kinds.trusted(ks.DenseKV)(K, K, length=40),)),
        r"layers\[0\]\.length: 40 is out of range",
        False,
    ),
    (lambda new: new(ks.ModelState)((ks.ModelState(()),)), r"layers\[0\]: a ModelState cannot be a part", True),
    (lambda new: new(ks.ListState)((K,)), r"states\[0\]: a array cannot be a part", True),
]  # fmt: skip


@pytest.mark.parametrize(("make", "expected", "at_construction"), CASES)
def test_each_kind_names_what_is_wrong(make, expected, at_construction):
    message = problems_of(make(kinds.trusted))
    assert re.search(expected, message), message


@pytest.mark.parametrize(("make", "expected", "at_construction"), CASES)
def test_constructors_refuse_what_the_shapes_show(make, expected, at_construction):
    """A constructor runs `check(values=False)` on what it built: no host sync, so the left
    padding's values, and parts that were made unchecked, are left to `check`."""
    if not at_construction:
        assert isinstance(make(lambda cls: cls), ks.State)  # it builds; `check` refuses it
        return
    with pytest.raises(ks.ShapeError) as info:
        make(lambda cls: cls)
    assert re.search(expected, str(info.value)), info.value
    assert str(info.value).startswith("inconsistent ")


def test_values_false_reads_no_arrays_and_skips_what_needs_them():
    state = ks.DenseKV(K, K, mx.array([0, 5], mx.int32), length=4)
    assert ks.check(state, values=False) is state
    problems_of(state, values=True)


def test_an_empty_batched_state_may_hold_the_padding_of_the_prompt_to_come():
    """BatchKVCache(left_padding=[2, 3]) before its first forward: padding past length 0."""
    ks.check(ks.DenseKV(left_padding=mx.array([2, 3], mx.int32)))


def test_states_kvstate_makes_pass():
    ks.check(ks.merge([ks.DenseKV(K[:1], K[:1], length=3), ks.DenseKV(K[:1], K[:1], length=5)]))


def test_tree_unflatten_checks_what_it_builds():
    state = ks.DenseKV(K, K, length=4)
    leaves, treedef = ks.tree_flatten(state)
    with pytest.raises(ks.ShapeError, match="disagree in batch"):
        ks.tree_unflatten(treedef, [leaves[0], mx.zeros((3, 2, 8, 4))])
    # Opting out is for hot paths whose arrays are known to fit: it builds, unchecked.
    unchecked = ks.tree_unflatten(treedef, [leaves[0], mx.zeros((3, 2, 8, 4))], check_state=False)
    assert unchecked.values.shape[0] == 3


def test_from_mlx_lm_checks_what_it_builds():
    cache = KVCache()
    cache.update_and_fetch(mx.zeros((1, 2, 3, 4)), mx.zeros((1, 2, 3, 4)))
    cache.offset = 10**6
    with pytest.raises(ks.ShapeError, match="length: 1000000 is out of range"):
        from_mlx_lm([cache])
    arrays = ArraysCache(2)
    arrays[0], arrays[1] = mx.zeros((2, 3)), mx.zeros((1, 3))
    with pytest.raises(ks.ShapeError, match="batch sizes"):
        from_mlx_lm(arrays)


def test_repr_is_a_summary_without_values():
    k = mx.random.normal((2, 4, 512, 64))
    layer = ks.DenseKV(k, k, mx.array([0, 3], mx.int32), length=300, appended=1)
    state = ks.ModelState(
        (layer, layer, ks.RecurrentState((mx.zeros((2, 3, 8)), None), appended=1), layer)
    )
    text = repr(state)
    assert len(text.splitlines()) == 5 and len(text) < 1200, text
    assert text.splitlines()[0] == "ModelState(batch 2, 6.0 MiB, 4 layers)"
    assert "keys=(2, 4, 512, 64) float32" in text and "length=300" in text
    assert "[2] RecurrentState(batch 2, 192 B, arrays=((2, 3, 8) float32, None)" in text
    assert "array(" not in text and "[[" not in text  # no values, only shapes
    # Even an inconsistent state has a repr (it is what an error message shows).
    bad = kinds.trusted(ks.DenseKV)(K, mx.zeros((3, 2, 8, 4)), length="x")  # type: ignore[arg-type]
    assert "DenseKV(" in repr(bad)


BAD_CODECS = [
    ({"key_bits": 7}, "key_bits: 7 is not one of [2, 3, 4, 5, 6, 8]"),
    ({"value_group_size": 48}, "value_group_size: 48 is not one of [32, 64, 128]"),
    ({"key_pad": 64}, "key_pad: 64 zero channels; a pad is in 0..group_size-1"),
    ({"value_pad": -1}, "value_pad: -1 is out of range"),
    ({"rotation": "x"}, "rotation: 'x' is not one of"),
    ({"seed": -1}, "seed: -1 is out of range"),
]


@pytest.mark.parametrize("kind", [ks.QuantizedKV, ks.QuantizedRotatingKV])
@pytest.mark.parametrize(("statics", "expected"), BAD_CODECS)
def test_both_quantized_kinds_refuse_the_same_codec_statics(kind, statics, expected):
    """One codec check (kvstate._quantized.codec_problems) serves the quantized KV and the
    quantized window."""
    assert expected in problems_of(kinds.trusted(kind)(**statics))
