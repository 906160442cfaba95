"""HybridQuantKVCache (mlx-vlm: one side TurboQuant, the other mx.quantize) as a TurboQuantKV
of form "hybrid", and TurboQuantKV files written before the Split layout.

The oracle is mlx-vlm: its HybridQuantKVCache's update_and_fetch (the dequantized keys and
values its attention reads) and trim on the cache the state came from, and its language
model decoding on its own caches (built as mlx-vlm's generate builds them for a policy that
mixes schemes).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np
import pytest

pytest.importorskip("mlx_vlm")

import mlx.core as mx
from mlx_vlm import turboquant as tq
from mlx_vlm.kv_quant import from_legacy
from mlx_vlm.models.cache import make_prompt_cache

import kvstate as ks
from kvstate.adapters.tiny_models import CONFIGS
from kvstate.adapters.vlm import from_mlx_vlm, to_mlx_vlm
from kvstate.testing import assert_states_equal
from tests.test_turboquant import filled, leaves, normal
from tests.vlm_helpers import _scaled, greedy_side_by_side

# (bits, group size, key scheme / bits, value scheme / bits), as mlx-vlm's generate takes them
POLICIES = {
    "tq3-uniform4": (3, 64, "turboquant", None, "uniform", 4),
    "uniform8-split2.5": (4, 32, "uniform", 8, "turboquant", 2.5),
    "split3.5-uniform4": (3.5, 64, "turboquant", 3.5, "uniform", 4),
}


DIMS = (64, 64)  # key / value head dims that every policy's groups divide


def policy(name: str) -> Any:
    bits, group, k_scheme, k_bits, v_scheme, v_bits = POLICIES[name]
    made = from_legacy(bits, "turboquant", group, k_bits, v_bits, k_scheme, v_scheme)
    assert not made.is_homogeneous  # the policy mlx-vlm's generate hybridizes caches for
    return made


def arrays(cache: tq.HybridQuantKVCache) -> list[mx.array]:
    """Every array a HybridQuantKVCache holds (TurboQuant side states or mx.quantize triples)."""

    def side(held: Any) -> list[mx.array]:
        if isinstance(held, (tq.TurboQuantMSEState, tq.TurboQuantSplitState)):
            return leaves(held)
        return list(held)  # mx.quantize's (packed, scales, biases)

    return side(cache.keys) + side(cache.values)


def assert_same(a: list[mx.array], b: list[mx.array]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.shape == y.shape and x.dtype == y.dtype and mx.array_equal(x, y).item()


def fetched(cache: tq.HybridQuantKVCache, seed: int, dims: tuple[int, int]) -> list[mx.array]:
    """What the attention reads after two more steps: update_and_fetch's dequantized K, V."""
    out = []
    for i in range(2):
        k = normal(seed + i, (1, 2, 1, dims[0])).astype(mx.float16)
        v = normal(seed + 10 + i, (1, 2, 1, dims[1])).astype(mx.float16)
        out += list(cache.update_and_fetch(k, v))
    return out


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_round_trip_and_save_load_give_back_mlx_vlms_cache(tmp_path, name):
    dims = (64, 128)
    cache = filled(tq.HybridQuantKVCache(policy(name), seed=5), 6, 1, dims=dims)
    state = from_mlx_vlm(cache)
    assert state.form == "hybrid" and (state.key_dim, state.value_dim) == dims
    back = to_mlx_vlm(state)
    assert type(back) is tq.HybridQuantKVCache
    assert back.meta_state == cache.meta_state
    assert_same(arrays(back), arrays(cache))
    ks.save(tmp_path / "h.safetensors", state)
    loaded = to_mlx_vlm(ks.load(tmp_path / "h.safetensors"))  # codecs rebuilt from statics
    assert loaded.meta_state == cache.meta_state
    expected = fetched(cache, 7, dims)
    for other in (back, loaded):
        assert_same(fetched(other, 7, dims), expected)


def test_an_empty_cache_round_trips_and_fills_like_mlx_vlms():
    theirs = tq.HybridQuantKVCache(policy("split3.5-uniform4"), seed=2)
    ours = to_mlx_vlm(from_mlx_vlm(theirs))
    assert ours.meta_state == theirs.meta_state
    for cache in (theirs, ours):
        filled(cache, 4, 3, dims=(64, 64))
    assert_same(arrays(ours), arrays(theirs))
    ks.check(from_mlx_vlm(ours))


def test_commit_prefix_equals_trim():
    dims = (64, 64)
    cache = filled(tq.HybridQuantKVCache(policy("uniform8-split2.5"), seed=0), 6, 2, dims=dims)
    state = ks.commit_prefix(ks.kinds.replace(from_mlx_vlm(cache), appended=3), 1)
    cache.trim(2)
    back = to_mlx_vlm(state)
    assert back.offset == cache.offset == 4
    assert_same(arrays(back), arrays(cache))
    assert_same(fetched(back, 9, dims), fetched(cache, 9, dims))


def test_rows_batch_and_come_back_as_their_own_caches():
    # mlx-vlm has no batched HybridQuantKVCache: a merged state's rows come back one by one
    # (extract), each equal to the cache it came from; padded rows are refused, not dropped.
    def made_cache(n: int, seed: int) -> tq.HybridQuantKVCache:
        return filled(tq.HybridQuantKVCache(policy("tq3-uniform4"), seed=1), n, seed, dims=DIMS)

    made = [made_cache(4, 1), made_cache(4, 2)]
    states = [from_mlx_vlm(c) for c in made]
    merged = ks.merge(states)
    assert type(to_mlx_vlm(merged)) is tq.HybridQuantKVCache  # equal lengths: no padding
    for row, cache in enumerate(made):
        assert_same(arrays(to_mlx_vlm(ks.extract(merged, row))), arrays(cache))
    longer = from_mlx_vlm(made_cache(6, 9))
    with pytest.raises(ks.StateError, match="no left padding"):
        to_mlx_vlm(ks.merge([states[0], longer]))


def test_merge_refuses_other_forms_and_schemes_naming_the_field():
    hybrid = from_mlx_vlm(
        filled(tq.HybridQuantKVCache(policy("tq3-uniform4"), seed=0), 4, 1, dims=DIMS)
    )
    for other, field in (
        (tq.TurboQuantKVCache(3, seed=0, value_bits=4), "form"),
        (tq.HybridQuantKVCache(policy("uniform8-split2.5"), seed=0), "key_scheme"),
    ):
        with pytest.raises(ks.ConfigMismatchError, match=field):
            ks.merge([hybrid, from_mlx_vlm(filled(other, 4, 1, dims=DIMS))])


def test_check_refuses_inconsistent_hybrid_states():
    state = from_mlx_vlm(
        filled(tq.HybridQuantKVCache(policy("tq3-uniform4"), seed=0), 4, 1, dims=DIMS)
    )
    for changes, message in (
        ({"form": "turboquant"}, "value_scheme: 'uniform' sides exist only in form 'hybrid'"),
        ({"group_size": 48}, "group_size: 48 is not one of"),
        ({"value_bits": 7}, r"value_bits: 7 is not one of \[2, 3, 4, 5, 6, 8\]"),
        ({"value_scales": None}, "value_scales: must be an array"),
    ):
        with pytest.raises(ks.StateError, match=message):
            ks.check(ks.kinds.replace(state, **changes))


def test_check_refuses_bad_split_channels():
    state = from_mlx_vlm(filled(tq.TurboQuantKVCache(3, seed=0, key_bits=2.5), 4, 1))
    channels = np.array(state.key_high_channels)
    for bad, message in (
        (channels[::-1].copy(), "must be distinct channels in"),
        (channels[:-1], "codes 32 channels high"),
        (
            np.where(channels == channels[-1], 64, channels),
            r"must be distinct channels in \[0, 64\)",
        ),
    ):
        with pytest.raises(ks.StateError, match=message):
            ks.check(ks.kinds.replace(state, key_high_channels=mx.array(bad, mx.int32)))
    with pytest.raises(ks.StateError, match="key_high_norms: must be an array"):
        ks.check(ks.kinds.replace(state, key_high_norms=None))


def tiny_llama(head_dim: int) -> Any:
    """mlx-vlm's llama with the tiny test configuration but wider heads."""
    from mlx_vlm.models import llama

    mx.random.seed(0)
    config = llama.ModelConfig.from_dict({**CONFIGS["llama"], "head_dim": head_dim})
    return _scaled(llama.Model(config), 0, 4.0)


def test_a_wrapped_model_on_hybrid_states_decodes_like_mlx_vlms_caches(tmp_path):
    """kvstate's wrapper on TurboQuantKV states of form "hybrid" vs the language model on
    mlx-vlm's HybridQuantKVCache list: prompt and verify logits, commit_prefix (mlx-vlm: trim),
    a save/load round trip, then greedy tokens; identical."""
    from kvstate.adapters.vlm import wrap

    model = tiny_llama(head_dim=32)  # mx.quantize's groups are 32 at the smallest
    lm, wrapped = model.language_model, wrap(model)
    chosen = policy("uniform8-split2.5")
    caches = [tq.HybridQuantKVCache(chosen, seed=4) for _ in make_prompt_cache(lm)]
    state = ks.ModelState(tuple(from_mlx_vlm(c) for c in caches))
    for tokens in ([3, 17, 42, 8, 99, 5], [11, 23, 7]):
        logits, state = wrapped(mx.array([tokens]), state)
        assert mx.array_equal(logits, lm(mx.array([tokens]), cache=caches).logits).item()
    assert (state.layers[0].key_scheme, state.layers[0].key_dim) == ("uniform", 32)
    state = ks.commit_prefix(state, 1)
    for cache in caches:
        cache.trim(2)
    ks.save(tmp_path / "m.safetensors", state)
    state = ks.load(tmp_path / "m.safetensors")
    ours, theirs = greedy_side_by_side(wrapped, state, lm, caches, 11, 5)
    assert ours == theirs and len(set(ours)) > 2  # the tokens vary: a real decode


def test_files_written_before_the_split_layout_still_load(tmp_path):
    """A TurboQuantKV file with only the four MSE arrays (before Split and Hybrid) loads as
    the same integer-bit state."""
    state = from_mlx_vlm(filled(tq.TurboQuantKVCache(3, seed=1), 4, 2))
    path = str(tmp_path / "old.safetensors")
    ks.save(path, state)
    tensors, header = mx.load(path, return_metadata=True)
    doc = json.loads(header["kvstate.body"])
    node = doc["tree"]
    for name in ("group_size", "form", "policy_bits", "key_scheme", "value_scheme"):
        del node["statics"][name]
    node["statics"]["key_bits"] = node["statics"]["value_bits"] = 3  # ints, as then
    old = ("key_norms", "key_indices", "value_norms", "value_indices", "left_padding")
    node["children"] = {k: v for k, v in node["children"].items() if k in old}
    header["kvstate.body"] = json.dumps(doc)
    header["kvstate.sha256"] = hashlib.sha256(header["kvstate.body"].encode()).hexdigest()
    mx.save_safetensors(path, tensors, header)
    assert_states_equal(ks.load(path), state)
