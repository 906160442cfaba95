"""mlx-vlm's cache classes <-> kvstate states, against mlx-vlm's own methods.

For every class: the round trip gives the same class with the same content; a state from an
mlx-vlm cache equals the state from mlx-lm's cache that saw the same updates; the round-
tripped cache behaves like the original under mlx-vlm's own update_and_fetch and make_mask;
mlx-vlm's trim / filter / extend / extract / merge equal kvstate's commit_prefix / filter /
extend / extract / merge.
"""

from __future__ import annotations

import copy
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

pytest.importorskip("mlx_vlm")

import mlx.core as mx
from mlx_lm.models import cache as L
from mlx_vlm.models import cache as V

import kvstate as ks
from kvstate.adapters import from_mlx_lm, to_mlx_lm, wrap
from kvstate.adapters.caches.registry import from_cache
from kvstate.adapters.tiny_models import tiny_model
from kvstate.adapters.vlm import from_mlx_vlm, to_mlx_vlm
from kvstate.kinds import record_forward
from kvstate.testing import assert_states_allclose, assert_states_equal
from tests.vlm_helpers import tiny_vlm

D = 32  # head dim: a multiple of the quantization group size


def kv(n: int, seed: int, batch: int = 1) -> mx.array:
    return mx.random.normal((batch, 2, n, D), key=mx.random.key(seed))


def fed(cache: Any, sizes: list[int], batch: int = 1, seed: int = 0) -> Any:
    """`cache` after update_and_fetch of len(sizes) chunks of random keys / values."""
    for i, n in enumerate(sizes):
        k = kv(n, seed + i, batch)
        cache.update_and_fetch(k, k * 2 + 1)
    return cache


def arrays_cache(lib: Any, left_padding: list[int] | None = None, advance: int = 0) -> Any:
    cache = lib.ArraysCache(2, left_padding=left_padding)
    batch = len(left_padding) if left_padding else 1
    cache[0] = mx.random.normal((batch, 3, 8), key=mx.random.key(5))
    cache[1] = mx.random.normal((batch, 4, 8, 8), key=mx.random.key(6))
    if advance:
        cache.advance(advance)
    return cache


def batch_rotating(lib: Any, steps: int) -> Any:
    rows = [fed(lib.RotatingKVCache(8), [n], seed=n) for n in (4, 10)]
    batch = lib.BatchRotatingKVCache.merge(rows)
    for s in range(steps):
        fed(batch, [1], batch=2, seed=40 + s)
    return batch


def batch_dense(lib: Any, steps: int) -> Any:
    batch = lib.BatchKVCache.merge([fed(lib.KVCache(), [n], seed=n) for n in (4, 7)])
    for s in range(steps):
        fed(batch, [1], batch=2, seed=40 + s)
    return batch


# Each case builds the same cache in either library (`lib` is mlx_lm's or mlx_vlm's module).
CASES: dict[str, Callable[[Any], Any]] = {
    "KVCache empty": lambda lib: lib.KVCache(),
    "KVCache prefill": lambda lib: fed(lib.KVCache(), [5]),
    "KVCache decode": lambda lib: fed(lib.KVCache(), [5, 1, 1]),
    "KVCache past a step": lambda lib: fed(lib.KVCache(), [250, 9]),
    "ConcatenateKVCache": lambda lib: fed(lib.ConcatenateKVCache(), [3, 1, 2]),
    "RotatingKVCache partial": lambda lib: fed(lib.RotatingKVCache(8), [5, 1]),
    "RotatingKVCache rotated": lambda lib: fed(lib.RotatingKVCache(8), [6, 1, 1, 1, 1, 1]),
    "RotatingKVCache concat": lambda lib: fed(lib.RotatingKVCache(8), [12, 1, 3]),
    "RotatingKVCache keep": lambda lib: fed(lib.RotatingKVCache(8, keep=2), [3, 1, 1, 4, 1, 1]),
    "BatchKVCache": lambda lib: batch_dense(lib, 0),
    "BatchKVCache decode": lambda lib: batch_dense(lib, 2),
    "BatchRotatingKVCache": lambda lib: batch_rotating(lib, 1),
    "BatchRotatingKVCache rotated": lambda lib: batch_rotating(lib, 5),
    "ArraysCache": lambda lib: arrays_cache(lib),
    "ArraysCache padded": lambda lib: arrays_cache(lib, [2, 0], advance=1),
    "CacheList": lambda lib: lib.CacheList(fed(lib.KVCache(), [4]), arrays_cache(lib)),
    "ChunkedKVCache": lambda lib: fed(lib.ChunkedKVCache(4), [3, 1]),
    "QuantizedKVCache": lambda lib: fed(lib.QuantizedKVCache(group_size=32, bits=4), [3, 1]),
    "BatchQuantizedKVCache": lambda lib: batch_quantized([1, 0], [3, 1]),
    "SimpleKVCache empty": lambda lib: lib.SimpleKVCache(),
    "SimpleKVCache": lambda lib: fed(lib.SimpleKVCache(), [3, 1, 2]),
    "SimpleKVCache cross": lambda lib: cross_attention(lib),
}
# mlx-lm has no such class
ONLY_MLX_VLM = {
    "BatchQuantizedKVCache",
    "SimpleKVCache empty",
    "SimpleKVCache",
    "SimpleKVCache cross",
}


def cross_attention(lib: Any) -> Any:
    """florence2's cross-attention cache: one update() with the encoder's keys."""
    cache = lib.SimpleKVCache()
    k = kv(6, 3)
    cache.update(k, -k)
    return cache


def batch_quantized(left_padding: list[int], sizes: list[int], seed: int = 0) -> Any:
    cache = V.BatchQuantizedKVCache(left_padding, group_size=32, bits=4)
    return fed(cache, sizes, batch=len(left_padding), seed=seed)


def _np(x: Any) -> Any:
    if isinstance(x, mx.array):
        return np.array(x)
    if isinstance(x, (list, tuple)):
        return [_np(v) for v in x]
    return x


def observed(cache: Any) -> Any:
    """What a cache holds, as mlx-vlm itself reports it: its class, `state` and
    `meta_state` (what mlx-vlm saves), the buffers' capacity, and ArraysCache's padding."""
    if isinstance(cache, V.CacheList):
        return ["CacheList", [observed(c) for c in cache.caches]]
    keys = getattr(cache, "keys", None)
    empty = keys is None if not isinstance(cache, V.ArraysCache) else False
    out = [type(cache).__name__, None if empty else _np(cache.state), cache.meta_state]
    out.append(None if keys is None else [np.shape(k) for k in _flat(keys)])
    if isinstance(cache, V.ArraysCache):
        out += [_np(cache.left_padding), _np(cache.lengths)]
    return out


def _flat(x: Any) -> list[Any]:
    return list(x) if isinstance(x, (list, tuple)) else [x]


def assert_same(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        assert isinstance(a, np.ndarray) and isinstance(b, np.ndarray), where
        assert a.dtype == b.dtype, f"{where}: {a.dtype} != {b.dtype}"
        np.testing.assert_array_equal(a, b, err_msg=where)
    elif isinstance(a, list) and isinstance(b, list):
        assert len(a) == len(b), f"{where}: {len(a)} != {len(b)} entries"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def make_mask(cache: Any, n: int) -> Any:
    if isinstance(cache, V.ArraysCache):
        return cache.make_mask(n)
    if isinstance(cache, (V.BatchKVCache, V.BatchRotatingKVCache)):
        return cache.make_mask(n, return_array=True)
    return cache.make_mask(n, return_array=True, window_size=None)


@pytest.fixture(params=list(CASES))
def case(request) -> str:
    return request.param


def test_round_trip_gives_the_same_class_and_content(case):
    cache = CASES[case](V)
    before = observed(cache)
    back = to_mlx_vlm(from_mlx_vlm(cache))
    assert type(back) is type(cache)
    assert_same(observed(back), before)
    assert_same(observed(cache), before)  # converting changed nothing


def test_state_from_mlx_vlm_equals_state_from_mlx_lm(case):
    if case in ONLY_MLX_VLM:
        pytest.skip("mlx-lm has no such class")
    assert_states_equal(from_mlx_vlm(CASES[case](V)), from_mlx_lm(CASES[case](L)))
    # and back: each library gets its own classes
    state = from_mlx_vlm(CASES[case](V))
    assert type(to_mlx_lm(state)).__module__ == "mlx_lm.models.cache"
    assert type(to_mlx_vlm(state)).__module__ == "mlx_vlm.models.cache"


def _update(cache: Any, n: int, seed: int) -> Any:
    """mlx-vlm's own step on one cache: update_and_fetch (KV caches) or the recurrent
    layers' writes and advance (ArraysCache); returns what the step hands the model."""
    if isinstance(cache, V.CacheList):
        return [_update(c, n, seed) for c in cache.caches]
    if isinstance(cache, V.ArraysCache):
        cache[0] = cache[0] + 1
        cache.advance(n)
        return None
    rows = cache.keys[0].shape[0] if isinstance(cache.keys, tuple) else None
    batch = rows or (cache.keys.shape[0] if cache.keys is not None else 1)
    k = kv(n, seed, batch)
    return _np(cache.update_and_fetch(k, k - 1))


@pytest.mark.parametrize("n", [1, 3])
def test_round_tripped_cache_behaves_like_the_original(case, n):
    """mlx-vlm's make_mask and update_and_fetch see no difference after a round trip."""
    cache = CASES[case](V)
    back = to_mlx_vlm(from_mlx_vlm(cache))
    # A rotated padded ring's multi-token mask is corrected on purpose (see the next test).
    corrected = isinstance(cache, V.BatchRotatingKVCache) and cache.rotated and n > 1
    if hasattr(cache, "make_mask") and not corrected:
        assert_same(_np(make_mask(back, n)), _np(make_mask(cache, n)), "make_mask")
    assert_same(_update(back, n, 9), _update(cache, n, 9), "update_and_fetch")
    assert_same(observed(back), observed(cache), "after the update")


TRIMMABLE: dict[str, Callable[[], Any]] = {
    "KVCache": lambda: fed(V.KVCache(), [5]),
    "ConcatenateKVCache": lambda: fed(V.ConcatenateKVCache(), [3, 1]),
    "RotatingKVCache": lambda: fed(V.RotatingKVCache(8), [2]),  # 2 + 3 tokens fit the window
    "BatchKVCache": lambda: batch_dense(V, 1),
    "ChunkedKVCache": lambda: fed(V.ChunkedKVCache(16), [3]),
    "QuantizedKVCache": lambda: fed(V.QuantizedKVCache(group_size=32, bits=4), [3, 1]),
    "BatchQuantizedKVCache": lambda: batch_quantized([2, 0], [3]),
}


@pytest.mark.parametrize("name", list(TRIMMABLE))
@pytest.mark.parametrize("n", [0, 1, 3])
def test_trim_equals_commit_prefix(name, n):
    """cache.trim(n) after a forward of K tokens == commit_prefix(state, K - n)."""
    cache = TRIMMABLE[name]()
    before = from_mlx_vlm(copy.deepcopy(cache))
    k = 3
    _update(cache, k, 20)
    state = record_forward(from_cache(cache), before, k)
    assert cache.trim(n) == n
    kept = to_mlx_vlm(ks.commit_prefix(state, k - n))
    assert_same(observed(kept)[1:3], observed(cache)[1:3])


def _batch_pair(lib: Any, kind: str) -> list[Any]:
    if kind == "dense":
        return [fed(lib.KVCache(), [n], seed=n) for n in (4, 7, 2)]
    if kind == "rotating":
        return [fed(lib.RotatingKVCache(8), [n], seed=n) for n in (4, 10, 2)]
    return [arrays_cache(lib) for _ in range(3)]


@pytest.mark.parametrize("kind", ["dense", "rotating", "arrays"])
def test_batch_methods_equal_kvstate_transforms(kind):
    rows = _batch_pair(V, kind)
    cls = type(rows[0])
    batch = cls.merge([copy.deepcopy(r) for r in rows[:2]])
    merged = ks.merge([from_mlx_vlm(r) for r in rows[:2]])
    assert_same(observed(to_mlx_vlm(merged)), observed(batch), "merge")

    other = cls.merge([copy.deepcopy(rows[2])])
    batch.extend(other)
    merged = ks.extend(merged, from_mlx_vlm(cls.merge([copy.deepcopy(rows[2])])))
    assert_same(observed(to_mlx_vlm(merged)), observed(batch), "extend")

    for row in range(3):
        assert_same(
            observed(to_mlx_vlm(ks.extract(merged, row))), observed(batch.extract(row)), "extract"
        )
    batch.filter(mx.array([1, 2]))
    merged = ks.filter(merged, [1, 2])
    assert_same(observed(to_mlx_vlm(merged)), observed(batch), "filter")


def test_batch_quantized_methods_equal_kvstate_transforms():
    """mlx-vlm's BatchQuantizedKVCache extend / extract / filter == kvstate's on QuantizedKV
    (content and bookkeeping; kvstate's extend leaves no spare capacity)."""
    batch = batch_quantized([2, 0], [3, 1])
    other = batch_quantized([0], [6], seed=7)
    state = ks.extend(from_mlx_vlm(batch), from_mlx_vlm(other))
    batch.extend(other)
    assert_same(observed(to_mlx_vlm(state))[:3], observed(batch)[:3], "extend")
    for row in range(3):
        assert_same(
            observed(to_mlx_vlm(ks.extract(state, row)))[:3],
            observed(batch.extract(row))[:3],
            "extract",
        )
    batch.filter(mx.array([0, 2]))
    state = ks.filter(state, [0, 2])
    assert_same(observed(to_mlx_vlm(state))[:3], observed(batch)[:3], "filter")


def test_batch_quantized_keys_and_values_of_other_bits_have_no_mlx_vlm_class():
    keys = mx.random.normal((2, 1, 3, 64))
    dense = ks.DenseKV(keys, keys, mx.array([1, 0], mx.int32), length=3)
    state = ks.quantize(dense, group_size=32, key_bits=4, value_bits=8)
    with pytest.raises(ks.StateError, match="one bits and group_size"):
        to_mlx_vlm(state)


@pytest.mark.parametrize("steps", [1, 5])
def test_batch_rotating_multi_token_mask_is_the_valid_keys(steps):
    """The mask to_mlx_vlm's BatchRotatingKVCache gives a 3-token forward on a rotated ring
    is exactly the keys that forward leaves valid (row b: buffer index >= its left padding
    after the update, causal, inside the window). mlx-vlm 0.7.10 copied mlx-lm's mask, which
    hides one valid key of a row that still has padding (steps=1); kvstate corrects it
    (kvstate.adapters.caches.compat.fixed_make_mask). If mlx-vlm's own mask passes too, mlx-vlm
    fixed it: drop the correction."""
    cache = batch_rotating(V, steps)
    assert cache.rotated
    fixed = to_mlx_vlm(from_mlx_vlm(copy.deepcopy(cache)))
    n = 3
    theirs, ours = np.array(make_mask(cache, n)), np.array(make_mask(fixed, n))
    fed(cache, [n], batch=2, seed=70)
    width = cache.keys.shape[2]
    key, query = np.arange(width)[None, :], np.arange(width - n, width)[:, None]
    padding = np.array(cache.left_padding)[:, None, None, None]
    expected = (key <= query) & (query - key < cache.max_size) & (key >= padding)
    np.testing.assert_array_equal(ours, np.broadcast_to(expected, ours.shape))
    if steps == 1:  # the upstream bug: one valid key of row 0 is masked
        assert not np.array_equal(theirs, np.broadcast_to(expected, theirs.shape))


@pytest.mark.parametrize("kept", [0, 2, 3])
def test_simple_kv_commit_prefix_equals_a_cache_fed_only_the_kept_tokens(kept):
    """SimpleKVCache has no trim of its own: the oracle is mlx-vlm's update_and_fetch given
    only the tokens commit_prefix keeps."""
    cache = fed(V.SimpleKVCache(), [4])
    before = from_mlx_vlm(copy.deepcopy(cache))
    k = kv(3, 20)
    cache.update_and_fetch(k, k - 1)
    state = record_forward(from_cache(cache), before, 3)
    assert state.simple and state.concatenate
    expected = fed(V.SimpleKVCache(), [4])
    if kept:
        expected.update_and_fetch(k[..., :kept, :], (k - 1)[..., :kept, :])
    back = to_mlx_vlm(ks.commit_prefix(state, kept))
    assert type(back) is V.SimpleKVCache
    assert_same(observed(back), observed(expected))
    # and it keeps working as mlx-vlm's class: the next step appends after the kept tokens
    assert_same(_update(back, 1, 30), _update(expected, 1, 30), "update_and_fetch")


def test_simple_kv_whose_count_disagrees_with_its_arrays_is_refused():
    cache = cross_attention(V)
    cache.update(kv(2, 4), kv(2, 5))  # update() replaces the arrays but adds to the count
    with pytest.raises(ks.StateError, match="holds 2 positions but its cache_length is 8"):
        from_mlx_vlm(cache)


def test_simple_flag_needs_the_concatenate_form():
    k = kv(2, 1)
    with pytest.raises(ks.StateError, match="simple: the SimpleKVCache form"):
        ks.check(ks.DenseKV(k, k, length=2, simple=True))
    # mlx-lm has no SimpleKVCache: its form there is ConcatenateKVCache, same content
    state = from_mlx_vlm(fed(V.SimpleKVCache(), [3]))
    assert type(to_mlx_lm(state)) is L.ConcatenateKVCache
    assert_same(_np(to_mlx_lm(state).state), _np(to_mlx_vlm(state).state))


def test_dense_kv_files_written_before_the_simple_flag_still_load(tmp_path):
    """A DenseKV file without the `simple` static (older kvstate) loads as the same state."""
    import hashlib
    import json

    k = kv(3, 2)
    state = ks.DenseKV(k, -k, length=3, appended=1, concatenate=True)
    path = str(tmp_path / "old.safetensors")
    ks.save(path, state)
    tensors, header = mx.load(path, return_metadata=True)
    doc = json.loads(header["kvstate.body"])
    assert doc["tree"]["statics"].pop("simple") is False
    header["kvstate.body"] = json.dumps(doc)
    header["kvstate.sha256"] = hashlib.sha256(header["kvstate.body"].encode()).hexdigest()
    mx.save_safetensors(path, tensors, header)
    assert_states_equal(ks.load(path), state)


# ---------------------------------------------------------------------------------------
# Errors and imports
# ---------------------------------------------------------------------------------------


def test_a_buffered_window_with_a_keep_prefix_is_refused_with_the_reason():
    cache = V.BufferedRotatingKVCache(8, keep=2)
    with pytest.raises(ks.StateError, match="keep=2 runs RotatingKVCache's ring buffer"):
        from_mlx_vlm([cache])


class UnknownCache(V.KVCache):
    """A cache class no converter is registered for."""


def test_unsupported_classes_say_what_is_supported():
    with pytest.raises(ks.StateError) as err:
        from_mlx_vlm([UnknownCache()])
    message = str(err.value)
    assert "UnknownCache" in message
    assert "mlx_vlm.models.cache: " in message and "mlx_lm.models.cache: " in message
    supported = message.split("mlx_vlm.models.cache: ")[1]
    for name in ("KVCache", "RotatingKVCache", "ArraysCache", "CacheList", "QuantizedKVCache"):
        assert name in supported
    for name in ("PoolingCache", "BufferedRotatingKVCache", "StaticPrefixKVCache"):
        assert name in supported


def test_caches_mid_transaction_are_refused():
    batch = V.BatchKVCache([1, 0])
    batch.prepare(lengths=[1, 2], right_padding=[1, 0])
    with pytest.raises(ks.StateError, match="between prepare"):
        from_mlx_vlm(batch)
    speculating = arrays_cache(V)
    speculating.start_speculation(3)
    with pytest.raises(ks.StateError, match="speculation transaction"):
        from_mlx_vlm(speculating)


def test_importing_kvstate_and_its_adapters_never_imports_mlx_vlm():
    code = (
        "import sys, mlx.core as mx\n"
        "import kvstate, kvstate.adapters, kvstate.speculative, kvstate.testing\n"
        "from kvstate.adapters import from_mlx_lm, to_mlx_lm, wrap\n"
        "from kvstate.adapters.tiny_models import tiny_model\n"
        "m = wrap(tiny_model('llama', num_hidden_layers=1))\n"
        "logits, state = m(mx.array([[1, 2]]), m.init_state())\n"
        "to_mlx_lm(from_mlx_lm(to_mlx_lm(state)))\n"
        "assert 'mlx_vlm' not in sys.modules, 'mlx_vlm was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------------------------------
# Models: one configuration, either library
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gemma3_text", "qwen3_next", "lfm2"])
def test_mlx_lm_and_mlx_vlm_caches_of_one_model_give_the_same_state(name):
    """mlx-lm's model and mlx-vlm's, of one configuration and the same weights, each on its
    own library's caches after the same prompt: the same state, and each library's wrapper
    continues from the other's state."""
    lm_model, vlm_model = tiny_model(name), tiny_vlm(name)
    vlm_model.language_model.update(lm_model.parameters())
    prompt = mx.array([[3, 17, 42, 9, 100, 7, 1, 250, 66, 12]])
    lm_caches = L.make_prompt_cache(lm_model)
    lm_model(prompt, cache=lm_caches)
    vlm_caches = V.make_prompt_cache(vlm_model.language_model)
    vlm_model.language_model(prompt, cache=vlm_caches)
    from_lm, from_vlm = from_mlx_lm(lm_caches), from_mlx_vlm(vlm_caches)
    assert_states_allclose(from_vlm, from_lm, rtol=1e-4, atol=1e-4)
    step = mx.array([[5]])
    by_lm, _ = wrap(lm_model)(step, from_vlm)
    by_vlm, _ = wrap(vlm_model)(step, from_lm)
    np.testing.assert_allclose(np.array(by_lm), np.array(by_vlm), rtol=1e-4, atol=1e-4)
