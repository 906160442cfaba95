"""save / load: bitwise round trips for every state kind, every error case, and mlx-lm
`save_prompt_cache` files, checked against mlx-lm's own `load_prompt_cache` and decoding."""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import (
    ArraysCache,
    BatchKVCache,
    BatchRotatingKVCache,
    CacheList,
    ChunkedKVCache,
    ConcatenateKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    load_prompt_cache,
    make_prompt_cache,
    save_prompt_cache,
)

import kvstate as ks
from kvstate import (
    ChunkedKV,
    DenseKV,
    ListState,
    ModelState,
    QuantizedKV,
    RecurrentState,
    RotatingKV,
    kinds,
)
from kvstate.adapters import from_mlx_lm, to_mlx_lm, wrap
from kvstate.adapters.caches.registry import CONVERTERS, to_cache
from kvstate.adapters.tiny_models import tiny_model
from kvstate.kinds import appended_of, batch_size_of

_UINTS = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}
_seed = iter(range(10_000))


def rand(shape: tuple[int, ...], dtype: mx.Dtype = mx.float32) -> mx.array:
    return mx.random.normal(shape, key=mx.random.key(next(_seed))).astype(dtype)


def bits(a: mx.array) -> bytes:
    """The array's bytes, row-major (through a same-size uint view: numpy has no bf16)."""
    return np.asarray(a.view(_UINTS[a.dtype.size])).tobytes()


def assert_identical(a: Any, b: Any) -> None:
    """Same classes, statics (types included: True is not 1), None/tuple structure, and
    arrays equal bit for bit with the same dtype and shape."""
    la, da = ks.tree_flatten(a)
    lb, db = ks.tree_flatten(b)
    assert da == db and repr(da) == repr(db)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        assert (x.dtype, x.shape) == (y.dtype, y.shape)
        assert bits(x) == bits(y)


# ---------------------------------------------------------------------------- native round trips


def sample_states() -> dict[str, Any]:
    k, v = rand((1, 2, 16, 8)), rand((1, 2, 16, 8))
    kb, vb = rand((3, 2, 16, 8), mx.bfloat16), rand((3, 2, 16, 8), mx.bfloat16)
    k8, v8 = rand((2, 2, 8, 8), mx.bfloat16), rand((2, 2, 8, 8), mx.bfloat16)
    qk = tuple(mx.quantize(rand((1, 2, 16, 64)), group_size=64, bits=4))
    qv = tuple(mx.quantize(rand((1, 2, 16, 64), mx.bfloat16), group_size=64, bits=4))
    window = RotatingKV(k[:, :, :8], v[:, :, :8], max_size=8, keep=2, offset=10, index=4)
    states: dict[str, Any] = {
        "dense": DenseKV(k, v, length=5, appended=1),
        "dense_batched_bf16": DenseKV(kb, vb, mx.array([2, 0, 1], mx.int32), length=9, appended=3),
        "dense_concatenate": DenseKV(k[:, :, :5], v[:, :, :5], length=5, concatenate=True),
        "empty": DenseKV(),
        "quantized": QuantizedKV(
            qk,
            qv,
            length=7,
            appended=2,
            key_bits=4,
            value_bits=4,
            key_group_size=64,
            value_group_size=64,
        ),
        "quantized_empty": QuantizedKV(key_group_size=32, value_group_size=32),
        "rotating_with_previous": RotatingKV(
            k[:, :, :11], v[:, :, :11], previous=window, max_size=8, keep=2, offset=13, index=11
        ),
        "rotating_batched": RotatingKV(
            k8,
            v8,
            mx.array([-3, 1], mx.int32),
            mx.array([12, 8], mx.int32),
            max_size=8,
            offset=12,
            index=3,
            rotated=True,
            appended=1,
        ),
        "chunked": ChunkedKV(
            k, v, ChunkedKV(k, v, chunk_size=8, offset=6), chunk_size=8, offset=9, start_position=1
        ),
        "recurrent": RecurrentState(
            (rand((2, 3, 8)), None, rand((2, 4, 4, 4), mx.bfloat16)),
            mx.array([1, 0], mx.int32),
            None,
            appended=2,
        ),
        "list": ListState((DenseKV(k, v, length=3), RecurrentState((rand((1, 3, 8)), None)))),
    }
    one_row = [s for s in states.values() if ks.batch_size(s) == 1]
    states["every_kind"] = tuple(states.values())  # a tuple of states: no shared batch
    states["model"] = ModelState(tuple(ks.commit_prefix(s, appended_of(s)) for s in one_row))
    return states


SAMPLES = sample_states()


@pytest.mark.parametrize("kind", sorted(SAMPLES))
def test_round_trip_is_bitwise_identical(kind, tmp_path):
    path = tmp_path / "state.safetensors"
    ks.save(path, SAMPLES[kind])
    assert_identical(ks.load(path), SAMPLES[kind])
    assert os.listdir(tmp_path) == ["state.safetensors"]  # no temporary file left behind


def test_file_is_plain_safetensors_with_arrays_named_by_path(tmp_path):
    path = tmp_path / "model.safetensors"
    ks.save(path, SAMPLES["every_kind"])
    arrays = mx.load(str(path))
    at = {name: i for i, name in enumerate(SAMPLES)}  # the tuple's entries, in this order
    expected = {
        f"{at['dense']}.keys",
        f"{at['quantized']}.keys.0",
        f"{at['quantized']}.values.2",
        f"{at['rotating_with_previous']}.previous.keys",
        f"{at['recurrent']}.arrays.2",
        f"{at['list']}.states.1.arrays.0",
    }
    assert expected <= set(arrays)
    assert f"{at['recurrent']}.arrays.1" not in arrays  # a None child holds no tensor
    assert bits(arrays[f"{at['dense']}.keys"]) == bits(SAMPLES["dense"].keys)


def test_metadata_round_trips_separately_from_the_state(tmp_path):
    path = tmp_path / "s.safetensors"
    metadata = {"model": "llama", "tokens": "[1, 2, 3]", "ünïcode": "✓", "": ""}
    ks.save(path, SAMPLES["dense"], metadata)
    state, back = ks.load(path, return_metadata=True)
    assert back == metadata
    assert_identical(state, SAMPLES["dense"])
    ks.save(path, SAMPLES["empty"])  # overwrites; no metadata reads back as {}
    state, back = ks.load(path, return_metadata=True)
    assert back == {}
    assert_identical(state, SAMPLES["empty"])


@pytest.mark.parametrize(
    "state, metadata",
    [
        (SAMPLES["dense"], {"n": 3}),
        (SAMPLES["dense"], {1: "x"}),
        (SAMPLES["dense"], "not a dict"),
        (mx.zeros((2,)), None),
        # A numpy scalar is not a portable static (its constructor refuses it too).
        (kinds.trusted(DenseKV)(length=np.int64(3)), None),
    ],
)
def test_save_refuses_what_it_cannot_write_and_writes_nothing(state, metadata, tmp_path):
    path = tmp_path / "s.safetensors"
    with pytest.raises(ks.StateError):
        ks.save(path, state, metadata)
    assert os.listdir(tmp_path) == []


def test_tuple_and_list_roots_round_trip(tmp_path):
    path = tmp_path / "s.safetensors"
    for tree in [(SAMPLES["dense"], SAMPLES["recurrent"]), [SAMPLES["list"], None]]:
        ks.save(path, tree)
        back = ks.load(path)
        assert type(back) is type(tree)
        assert_identical(back, tree)


def test_save_into_a_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ks.save(tmp_path / "no" / "s.safetensors", SAMPLES["dense"])


# ---------------------------------------------------------------------------- errors


@pytest.fixture
def saved(tmp_path) -> str:
    path = str(tmp_path / "model.safetensors")
    ks.save(path, SAMPLES["model"], {"note": "x"})
    return path


def read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def write(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def header_of(path: str) -> tuple[int, dict[str, Any]]:
    raw = read(path)
    n = int.from_bytes(raw[:8], "little")
    return n, json.loads(raw[8 : 8 + n])


def rewrite(
    path: str,
    *,
    meta: Callable[[dict[str, str]], None] | None = None,
    body: Callable[[dict[str, Any]], None] | None = None,
    arrays: Callable[[dict[str, mx.array]], None] | None = None,
    rehash: bool = True,
) -> None:
    """Rewrite a saved file with edited tensors, metadata or JSON body (re-hashed or not)."""
    tensors, header = mx.load(path, return_metadata=True)
    if body is not None:
        doc = json.loads(header["kvstate.body"])
        body(doc)
        header["kvstate.body"] = json.dumps(doc)
        if rehash:
            header["kvstate.sha256"] = hashlib.sha256(header["kvstate.body"].encode()).hexdigest()
    if meta is not None:
        meta(header)
    if arrays is not None:
        arrays(tensors)
    mx.save_safetensors(path, tensors, header)


def expect_error(path: str, *words: str) -> str:
    with pytest.raises(ks.FileFormatError) as info:
        ks.load(path)
    message = str(info.value)
    for word in words:
        assert word in message, message
    return message


def test_missing_file(tmp_path):
    expect_error(str(tmp_path / "nope.safetensors"), "no file at", "nope.safetensors")


@pytest.mark.parametrize("keep", ["none", "4", "prefix", "header", "half", "all-but-one"])
def test_truncated_file(saved, keep):
    raw = read(saved)
    n, _ = header_of(saved)
    cut = {
        "none": 0,
        "4": 4,
        "prefix": 8,
        "header": 8 + n // 2,
        "half": len(raw) // 2,
        "all-but-one": len(raw) - 1,
    }[keep]
    write(saved, raw[:cut])
    expect_error(saved, "truncated")


def test_trailing_bytes(saved):
    with open(saved, "ab") as f:
        f.write(b"\0")
    expect_error(saved, "trailing bytes")


@pytest.mark.parametrize("tensor", ["layers.0.keys", "layers.3.keys.0", "layers.6.values"])
def test_flipped_byte_in_an_array(saved, tensor):
    n, header = header_of(saved)
    start, end = header[tensor]["data_offsets"]
    raw = bytearray(read(saved))
    raw[8 + n + (start + end) // 2] ^= 0x10
    write(saved, bytes(raw))
    expect_error(saved, tensor, "sha256", "tampered")


def test_json_edited_without_updating_its_checksum(saved):
    def edit(doc):
        doc["tree"]["children"]["layers"]["tuple"][0]["statics"]["length"] = 6

    rewrite(saved, body=edit, rehash=False)
    expect_error(saved, "checksum of the state description", "edited")


def test_header_edited_in_place(saved):
    raw = read(saved)
    n, _ = header_of(saved)
    at = raw.index(b"DenseKV", 0, 8 + n)  # inside the escaped JSON body
    write(saved, raw[:at] + b"DenseKX" + raw[at + 7 :])
    expect_error(saved, "checksum of the state description")


def test_edited_shape_and_dtype_are_caught_even_with_a_recomputed_checksum(saved):
    def edit(doc):
        doc["arrays"]["layers.0.keys"]["shape"] = [1, 2, 8, 16]
        doc["arrays"]["layers.1.values"]["dtype"] = "float16"

    rewrite(saved, body=edit)
    message = expect_error(saved, "'layers.0.keys' has shape [1, 2, 16, 8], recorded [1, 2, 8, 16]")
    assert "'layers.1.values' has dtype float32, recorded float16" in message  # all at once


def test_replaced_array_of_another_dtype(saved):
    def edit(tensors):
        tensors["layers.0.values"] = tensors["layers.0.values"].astype(mx.float16)

    rewrite(saved, arrays=edit)
    expect_error(saved, "'layers.0.values' has dtype float16, recorded float32")


def test_removed_and_added_arrays(saved):
    def edit(tensors):
        del tensors["layers.0.values"]
        tensors["extra"] = mx.zeros((1,))

    rewrite(saved, arrays=edit)
    expect_error(saved, "missing array 'layers.0.values'", "unexpected array 'extra'")


def test_unknown_class_name(saved):
    def edit(doc):
        doc["tree"]["children"]["layers"]["tuple"][0]["class"] = "os.system"

    rewrite(saved, body=edit)
    expect_error(saved, "'os.system'", "does not know", "upgrade")


def test_static_of_the_wrong_type(saved):
    def edit(doc):
        doc["tree"]["children"]["layers"]["tuple"][0]["statics"]["concatenate"] = 1

    rewrite(saved, body=edit)
    expect_error(saved, "DenseKV.concatenate is 1, not a bool")


def test_fields_that_do_not_match_the_class(saved):
    def edit(doc):
        del doc["tree"]["children"]["layers"]["tuple"][0]["statics"]["appended"]

    rewrite(saved, body=edit)
    expect_error(saved, "DenseKV is recorded with fields")


def test_newer_format_version(saved):
    rewrite(saved, meta=lambda h: h.update({"kvstate.version": "2"}))
    expect_error(saved, "version 2", "newer", "upgrade kvstate")


def test_garbled_format_version(saved):
    rewrite(saved, meta=lambda h: h.update({"kvstate.version": "one"}))
    expect_error(saved, "'one'", "positive integer")


def test_safetensors_file_that_is_not_a_kvstate_file(tmp_path):
    path = str(tmp_path / "weights.safetensors")
    mx.save_safetensors(path, {"w": mx.zeros((2, 2))}, {"format": "pt"})
    expect_error(path, "not a kvstate file")


@pytest.mark.parametrize(
    "content, words",
    [
        (b"just some text, not a tensor file at all\n", ("not a safetensors file",)),
        ((12).to_bytes(8, "little") + b"not json!!!!", ("not JSON",)),
        (b"\x02\x00\x00\x00\x00\x00\x00\x00[]", ("not a map",)),
    ],
)
def test_files_that_are_not_safetensors(tmp_path, content, words):
    path = str(tmp_path / "x.safetensors")
    write(path, content)
    expect_error(path, *words)


# ---------------------------------------------------------------------------- mlx-lm files


def filled(cache: Any, steps: list[int], dims: tuple[int, int] = (8, 8), batch: int = 1) -> Any:
    """Feed random keys/values through mlx-lm's own update_and_fetch, `steps` tokens at a time."""
    for n in steps:
        cache.update_and_fetch(rand((batch, 2, n, dims[0])), rand((batch, 2, n, dims[1])))
    return cache


def batched_kv() -> BatchKVCache:
    cache = BatchKVCache.merge([filled(KVCache(), [5]), filled(KVCache(), [2, 1])])
    return filled(cache, [1], batch=2)


def batched_rotating() -> BatchRotatingKVCache:
    rows = [filled(RotatingKVCache(max_size=4), [6, 1]), filled(RotatingKVCache(max_size=4), [2])]
    return filled(BatchRotatingKVCache.merge(rows), [1, 1, 1], batch=2)


def arrays_cache() -> ArraysCache:
    cache = ArraysCache(3, left_padding=[1, 0])
    cache[0], cache[2] = rand((2, 3, 8)), rand((2, 2, 4, 4), mx.bfloat16)
    return cache


def bf16_kv() -> KVCache:
    cache = KVCache()
    cache.update_and_fetch(rand((1, 2, 3, 8), mx.bfloat16), rand((1, 2, 3, 8), mx.bfloat16))
    return cache


# name -> (mlx-lm cache built by mlx-lm's own code, the state that cache means).
MLX_LM_CASES: dict[str, tuple[Callable[[], Any], Callable[[Any], Any]]] = {
    "KVCache": (
        lambda: filled(KVCache(), [5, 1]),
        lambda c: DenseKV(c.keys, c.values, length=c.offset),
    ),
    "KVCache-bf16": (bf16_kv, lambda c: DenseKV(c.keys, c.values, length=c.offset)),
    "KVCache-empty": (KVCache, lambda c: DenseKV()),
    "ConcatenateKVCache": (
        lambda: filled(ConcatenateKVCache(), [3, 1]),
        lambda c: DenseKV(c.keys, c.values, length=4, concatenate=True),
    ),
    "BatchKVCache": (
        batched_kv,
        lambda c: DenseKV(c.keys, c.values, c.left_padding, length=c._idx),
    ),
    "RotatingKVCache": (
        lambda: filled(RotatingKVCache(max_size=4, keep=1), [3, 1, 1, 1]),
        lambda c: RotatingKV(c.keys, c.values, max_size=4, keep=1, offset=c.offset, index=c._idx),
    ),
    "BatchRotatingKVCache": (
        batched_rotating,
        lambda c: RotatingKV(
            c.keys,
            c.values,
            c.left_padding,
            c.offset,
            max_size=4,
            offset=c._offset,
            index=c._idx,
            rotated=c.rotated,
        ),
    ),
    "QuantizedKVCache": (
        lambda: filled(QuantizedKVCache(group_size=64, bits=4), [3, 1], dims=(64, 128)),
        lambda c: QuantizedKV(
            tuple(c.keys),
            tuple(c.values),
            length=4,
            key_bits=4,
            value_bits=4,
            key_group_size=64,
            value_group_size=64,
        ),
    ),
    "ChunkedKVCache": (
        lambda: filled(ChunkedKVCache(chunk_size=4), [3, 3]),
        lambda c: ChunkedKV(
            c.keys, c.values, chunk_size=4, offset=6, start_position=c.start_position
        ),
    ),
    "ArraysCache": (
        arrays_cache,
        lambda c: RecurrentState(tuple(c.cache), c.left_padding, None),
    ),
    "CacheList": (
        lambda: CacheList(filled(KVCache(), [2], batch=2), arrays_cache()),
        lambda c: ListState(
            (
                DenseKV(c[0].keys, c[0].values, length=2),
                RecurrentState(tuple(c[1].cache), c[1].left_padding, None),
            )
        ),
    ),
}


def adapter_missing(caches: list[Any]) -> str | None:
    """Which mlx-lm cache classes the adapters (written in parallel) cannot convert yet."""
    flat = [x for c in caches for x in (c.caches if isinstance(c, CacheList) else [c])]
    missing = sorted({type(c).__name__ for c in flat if type(c) not in CONVERTERS})
    for c in flat:
        # mlx-lm's from_state skips __init__, so a loaded BatchRotatingKVCache lacks the
        # `_lengths = None` its constructor sets (mlx-lm's own decode would trip on it too).
        if isinstance(c, BatchRotatingKVCache) and not hasattr(c, "_lengths"):
            c._lengths = None
    return f"adapters for {missing} not written yet" if missing else None


def kinds_missing(state: ModelState) -> str | None:
    """Which state kinds cannot go through `wrap` yet (kind modules written in parallel)."""
    flat = [x for s in state.layers for x in (s.states if isinstance(s, ListState) else [s])]
    missing = sorted(
        {
            type(s).__name__
            for s in flat
            for fn in (to_cache, batch_size_of)
            if fn.dispatch(type(s)) is fn.dispatch(object)
        }
    )
    return f"to_mlx_lm / transforms for {missing} not written yet" if missing else None


@pytest.mark.parametrize("case", sorted(MLX_LM_CASES))
def test_reads_mlx_lm_prompt_cache_files(case, tmp_path):
    make, meaning = MLX_LM_CASES[case]
    cache = make()
    path = str(tmp_path / "prompt.safetensors")
    rows = ks.batch_size(meaning(cache))  # every layer of one model has the same rows
    save_prompt_cache(
        path, [cache, filled(KVCache(), [2], batch=rows)], {"model": "tiny", "step": "7"}
    )
    state, metadata = ks.load(path, return_metadata=True)
    assert metadata == {"model": "tiny", "step": "7"}
    assert isinstance(state, ModelState) and len(state.layers) == 2
    # The oracle: the arrays and counters of mlx-lm's own cache object.
    assert_identical(state.layers[0], meaning(cache))
    # And field for field what the adapters build from mlx-lm's own load_prompt_cache.
    reference = load_prompt_cache(path)
    if adapter_missing(reference) is None:
        assert_identical(state, from_mlx_lm(reference))


@pytest.mark.parametrize("rows", [1, 2])
def test_mlx_lm_file_of_a_whole_hybrid_model_equals_the_adapters(rows, tmp_path):
    built = [(make(), meaning) for make, meaning in MLX_LM_CASES.values()]
    cases = [(c, m) for c, m in built if ks.batch_size(m(c)) == rows]  # one model, one batch
    caches = [c for c, _ in cases]
    path = str(tmp_path / "prompt.safetensors")
    save_prompt_cache(path, caches)
    state = ks.load(path)
    assert len(state.layers) == len(caches) > 2
    for layer, (cache, meaning) in zip(state.layers, cases, strict=True):
        assert_identical(layer, meaning(cache))
    reference = load_prompt_cache(path)
    if (reason := adapter_missing(reference)) is not None:
        pytest.skip(reason)
    assert_identical(state, from_mlx_lm(reference))


def test_reads_save_prompt_cache_of_adapter_caches(tmp_path):
    """to_mlx_lm's caches (quantized ones with the packing fix) save under mlx-lm's names."""
    path = str(tmp_path / "prompt.safetensors")
    # Caches have no `appended`: what they save is the state with nothing pending.
    state = ModelState(tuple(attrs.evolve(SAMPLES[k], appended=0) for k in ("quantized", "dense")))
    caches = to_mlx_lm(state)
    save_prompt_cache(path, caches)
    back = ks.load(path)
    assert type(back.layers[0]) is QuantizedKV
    assert_identical(back, state)


def committed(state: Any) -> Any:
    """What a state means to mlx-lm: no pending forward (cache objects have no `appended`)."""
    return ks.commit_prefix(state, appended_of(state))


@pytest.mark.parametrize("kind", sorted(set(SAMPLES) - {"every_kind", "model"}))
def test_mlx_lm_loads_what_save_prompt_cache_writes_from_every_kind(kind, tmp_path):
    """The way to hand a state to mlx-lm: save_prompt_cache(path, to_mlx_lm(state)). mlx-lm's
    own load_prompt_cache reads it back (quantized states included: their caches keep the
    class name QuantizedKVCache), and so does kvstate."""
    state = ModelState((committed(SAMPLES[kind]),))
    path = str(tmp_path / "prompt.safetensors")
    save_prompt_cache(path, to_mlx_lm(state))
    theirs = load_prompt_cache(path)
    assert [type(c).__name__ for c in theirs] == [type(c).__name__ for c in to_mlx_lm(state)]
    for c in theirs:  # mlx-lm's from_state skips the __init__ that sets _lengths
        if isinstance(c, BatchRotatingKVCache) and not hasattr(c, "_lengths"):
            c._lengths = None
    expected = ModelState(
        tuple(attrs.evolve(s, previous=None) if hasattr(s, "previous") else s for s in state.layers)
    )
    assert_identical(from_mlx_lm(theirs), expected)
    assert_identical(ks.load(path), expected)


def test_mlx_lm_cannot_read_kvstate_files_and_says_so_in_the_readme(tmp_path):
    """A kvstate file is not an mlx-lm prompt cache (it holds what mlx-lm has no field for:
    pending forwards, rollback records); the README says how to export instead."""
    path = str(tmp_path / "state.safetensors")
    ks.save(path, SAMPLES["model"])
    with pytest.raises(ValueError):
        load_prompt_cache(path)
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    assert "save_prompt_cache(path, to_mlx_lm(state))" in readme


def test_a_renamed_tensor_cannot_make_a_huge_list(tmp_path):
    """Renaming tensor 0.0 to 0.1000000000 used to build a list of 10^9 entries."""
    path = str(tmp_path / "prompt.safetensors")
    save_prompt_cache(path, [filled(KVCache(), [2])])
    rewrite(path, arrays=lambda t: t.update({"0.1000000000": t.pop("0.0")}))
    started = time.perf_counter()
    expect_error(path, "'0.1000000000'", "points past")
    assert time.perf_counter() - started < 5


def test_a_deeply_nested_tensor_name_is_refused(tmp_path):
    path = str(tmp_path / "prompt.safetensors")
    save_prompt_cache(path, [filled(KVCache(), [2])])
    rewrite(path, arrays=lambda t: t.update({".".join(["0"] * 3000): t.pop("0.0")}))
    expect_error(path, "not an mlx-lm prompt-cache path")


def test_a_deeply_nested_kvstate_description_is_refused(tmp_path):
    path = str(tmp_path / "s.safetensors")
    ks.save(path, SAMPLES["dense"])

    def nest(doc):
        node: Any = None
        for _ in range(200):
            node = {"tuple": [node]}
        doc["tree"] = node

    rewrite(path, body=nest)
    expect_error(path, "nests deeper than")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes here")
def test_a_named_pipe_is_refused_without_blocking(tmp_path):
    path = str(tmp_path / "pipe.safetensors")
    os.mkfifo(path)
    expect_error(path, "not a regular file")
    expect_error(str(tmp_path), "not a regular file")


def test_a_corrupted_mlx_lm_counter_is_caught_by_the_state_check(tmp_path):
    """mlx-lm files carry no checksums: a flipped byte in a counter gave length=6094854."""
    path = str(tmp_path / "prompt.safetensors")
    save_prompt_cache(path, [filled(KVCache(), [3])])
    rewrite(path, arrays=lambda t: t.update({"0.2": mx.array(6094854)}))
    expect_error(path, "inconsistent", "length: 6094854 is out of range")


@pytest.mark.parametrize("version", ["01", "\uff11", "1 ", "+1", "1.0", ""])
def test_versions_are_plain_ascii_integers(saved, version):
    rewrite(saved, meta=lambda h: h.update({"kvstate.version": version}))
    expect_error(saved, "positive integer")


def test_a_kvstate_file_whose_state_is_inconsistent_is_refused(saved):
    """Checksums are not a signature: a rewritten, re-hashed file still passes kvstate.check."""

    def edit(doc):
        doc["tree"]["children"]["layers"]["tuple"][0]["statics"]["length"] = 10**6

    rewrite(saved, body=edit)
    expect_error(saved, "inconsistent ModelState", "layers[0].length: 1000000 is out of range")


def test_mlx_lm_file_with_an_unknown_cache_class(tmp_path):
    path = str(tmp_path / "prompt.safetensors")
    save_prompt_cache(path, [filled(KVCache(), [2])])
    rewrite(path, meta=lambda h: h.update({"1.0": "MysteryCache"}))
    expect_error(path, "'MysteryCache'", "cannot read")


def test_mlx_lm_file_with_a_malformed_state(tmp_path):
    path = str(tmp_path / "prompt.safetensors")
    save_prompt_cache(path, [filled(KVCache(), [2])])
    rewrite(path, meta=lambda h: h.update({"1.0": "RotatingKVCache"}))  # 3 entries, not 6
    expect_error(path, "layer 0 (RotatingKVCache)", "has 6")


def test_truncated_mlx_lm_file(tmp_path):
    path = str(tmp_path / "prompt.safetensors")
    save_prompt_cache(path, [filled(KVCache(), [2])])
    raw = read(path)
    write(path, raw[:-10])
    expect_error(path, "truncated")


PROMPT = [3, 17, 42, 99, 7, 250, 31, 8, 120, 64, 5, 77]  # longer than gemma3's window of 8
FOLLOW = [9, 200, 14, 130, 66, 12, 1, 2, 3, 4]
CHUNKS = [1, 1, 3, 1, 2, 1, 1]


@pytest.mark.parametrize("name", ["llama", "gemma3_text", "qwen3_next"])
def test_decoding_from_an_mlx_lm_file_matches_mlx_lm(name, tmp_path):
    model = tiny_model(name)
    caches = make_prompt_cache(model)
    model(mx.array([PROMPT]), cache=caches)
    path = str(tmp_path / "prompt.safetensors")
    save_prompt_cache(path, caches, {"model": name})
    reference = load_prompt_cache(path)  # the oracle: mlx-lm's own reader and caches
    if (reason := adapter_missing(reference)) is not None:
        pytest.skip(reason)
    state = ks.load(path)
    assert_identical(state, from_mlx_lm(reference))
    if (reason := kinds_missing(state)) is not None:
        pytest.skip(reason)
    m = wrap(model)
    at = 0
    for size in CHUNKS:  # teacher forcing, single tokens and multi-token chunks
        tokens = mx.array([FOLLOW[at : at + size]])
        expected = model(tokens, cache=reference)
        logits, state = m(tokens, state)
        np.testing.assert_allclose(np.array(logits), np.array(expected), rtol=1e-4, atol=1e-4)
        at += size
    mine, theirs = logits[:, -1].argmax(-1), expected[:, -1].argmax(-1)
    for _ in range(8):  # then greedy, each side on its own tokens
        assert mine.item() == theirs.item()
        logits, state = m(mine[:, None], state)
        expected = model(theirs[:, None], cache=reference)
        np.testing.assert_allclose(np.array(logits), np.array(expected), rtol=1e-4, atol=1e-4)
        mine, theirs = logits[:, -1].argmax(-1), expected[:, -1].argmax(-1)
