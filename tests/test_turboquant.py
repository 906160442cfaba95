"""TurboQuantKV against mlx-vlm's own TurboQuant caches (`mlx_vlm.turboquant`).

The oracle is always mlx-vlm: its update_and_fetch + quantized_attention on the cache the
state came from, its trim / filter / extend / extract on BatchTurboQuantKVCache, its codecs'
dequantize, and its language model decoding on its own caches. Every test runs on integer
bits (MSE codecs) and on x.5 bits (mlx-vlm's Split layout: data-chosen high channels).
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest

pytest.importorskip("mlx_vlm")

import mlx.core as mx
from mlx_vlm import turboquant as tq
from mlx_vlm.models.cache import make_prompt_cache

import kvstate as ks
from kvstate.adapters.caches.vlm.turboquant import codecs, side_state
from kvstate.adapters.vlm import from_mlx_vlm, to_mlx_vlm
from tests.vlm_helpers import greedy_side_by_side, tiny_vlm


def normal(seed: int, shape: tuple[int, ...]) -> mx.array:
    return mx.array(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


def filled(cache: Any, n: int, seed: int, batch: int = 1, dims: tuple[int, int] = (64, 80)) -> Any:
    cache.update_and_fetch(
        normal(seed, (batch, 2, n, dims[0])), normal(seed + 1, (batch, 2, n, dims[1]))
    )
    return cache


def leaves(held: Any) -> list[mx.array]:
    """The arrays of one side as mlx-vlm holds it (MSE state, or Split state of two)."""
    if isinstance(held, tq.TurboQuantSplitState):
        return leaves(held.low) + leaves(held.high)
    assert isinstance(held, tq.TurboQuantMSEState)
    return [held.norms, held.indices]


def mse_arrays(cache: Any) -> list[mx.array]:
    keys, values = cache.state[:2]
    return leaves(keys) + leaves(values)


def channels(codec: Any) -> list[list[int]] | None:
    """A split codec's (low, high) channel lists; None for an MSE codec."""
    if isinstance(codec, tq._SplitCodec):
        return [np.array(codec.low_idx).tolist(), np.array(codec.high_idx).tolist()]
    assert type(codec) is tq._TurboQuantMSECodec
    return None


def assert_same_arrays(a: list[mx.array], b: list[mx.array]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.shape == y.shape and x.dtype == y.dtype
        assert mx.array_equal(x, y).item()


def step_outputs(
    cache: Any, seed: int, batch: int = 1, dims: tuple[int, int] = (64, 80)
) -> list[mx.array]:
    """Two decode steps of mlx-vlm's own update_and_fetch + quantized_attention (GQA 4:2)."""
    out = []
    for i in range(2):
        k, v = (
            normal(seed + 10 * i, (batch, 2, 1, dims[0])),
            normal(seed + 10 * i + 1, (batch, 2, 1, dims[1])),
        )
        ks_, vs_ = cache.update_and_fetch(k, v)
        q = normal(seed + 10 * i + 2, (batch, 4, 1, dims[0]))
        out.append(cache.quantized_attention(q, ks_, vs_, scale=dims[0] ** -0.5))
    return out


@pytest.mark.parametrize(
    ("bits", "key_bits", "value_bits", "dims"),
    [
        (4, None, None, (64, 64)),
        (3, None, None, (64, 80)),
        (2, 2, 4, (80, 64)),
        (3.5, None, None, (64, 64)),
        (3, 2.5, 3.5, (64, 80)),  # Split on both sides
        (3.5, 3.5, 3, (12, 16)),  # Split keys of a non-power-of-two dim (dense rotation)
        (2, 4, 1.5, (16, 12)),
    ],
)
def test_round_trip_keeps_the_arrays_and_decodes_like_the_original(
    tmp_path, bits, key_bits, value_bits, dims
):
    # 3.5 bits: keys 3, values 4 (mlx-vlm's resolve_kv_bits), still integer-bit MSE codecs.
    cache = filled(
        tq.TurboQuantKVCache(bits, seed=7, key_bits=key_bits, value_bits=value_bits),
        5,
        1,
        dims=dims,
    )
    state = from_mlx_vlm(cache)
    assert (state.key_dim, state.value_dim, state.seed) == (*dims, 7)
    back = to_mlx_vlm(state)
    assert type(back) is tq.TurboQuantKVCache
    assert_same_arrays(mse_arrays(back), mse_arrays(cache))
    for ours, theirs in ((back.key_codec, cache.key_codec), (back.value_codec, cache.value_codec)):
        assert type(ours) is type(theirs) and channels(ours) == channels(theirs)
    assert (back.key_bits, back.value_bits, back.offset) == (cache.key_bits, cache.value_bits, 5)
    ks.save(tmp_path / "tq.safetensors", state)
    loaded = to_mlx_vlm(ks.load(tmp_path / "tq.safetensors"))  # codecs rebuilt from statics
    expected = step_outputs(cache, 3, dims=dims)
    for other in (back, loaded):
        for got, want in zip(step_outputs(other, 3, dims=dims), expected, strict=True):
            assert mx.array_equal(got, want).item()


@pytest.mark.parametrize(("key_bits", "value_bits"), [(3, 3), (2.5, 3.5)])
def test_the_rebuilt_codecs_dequantize_like_the_caches_own(key_bits, value_bits):
    cache = filled(tq.TurboQuantKVCache(3, seed=2, key_bits=key_bits, value_bits=value_bits), 6, 4)
    state = from_mlx_vlm(cache)
    key_codec, value_codec = codecs(state)
    want_k, want_v = cache.dequantize()
    got_k = key_codec.dequantize(side_state(state, "key"))
    got_v = value_codec.dequantize(side_state(state, "value"))
    assert mx.array_equal(got_k, want_k).item() and mx.array_equal(got_v, want_v).item()


def test_a_split_side_keeps_mlx_vlms_channels_and_seeds():
    # The Split construction, read off mlx-vlm's own codec: the high channels are the largest
    # mean |x| of the first keys; the low codec is seeded `seed`, the high one `seed + 97`.
    keys = normal(1, (1, 2, 5, 64)) * mx.where(mx.arange(64) % 7 == 0, 10.0, 1.0)
    cache = tq.TurboQuantKVCache(3, seed=5, key_bits=2.5, value_bits=3)
    cache.update_and_fetch(keys, normal(2, (1, 2, 5, 80)))
    state = from_mlx_vlm(cache)
    high = np.array(state.key_high_channels).tolist()
    assert set(range(0, 64, 7)) <= set(high) and len(high) == 32
    assert state.value_high_channels is None and state.value_high_norms is None
    rebuilt = codecs(state)[0]
    for part, seed in ((rebuilt.low_codec, 5), (rebuilt.high_codec, 5 + 97)):
        twin = tq._TurboQuantMSECodec(part.dim, part.bits, seed)
        assert mx.array_equal(twin.rotation, part.rotation).item()
    assert (rebuilt.low_codec.bits, rebuilt.high_codec.bits) == (2, 3)


@pytest.mark.parametrize("key_bits", [4, 2.5])
def test_commit_prefix_equals_trim(key_bits):
    cache = filled(tq.TurboQuantKVCache(4, seed=0, key_bits=key_bits), 6, 5)
    state = ks.commit_prefix(_appended(cache, 3), 1)  # the last 3 positions pending: keep 1
    cache.trim(2)
    assert state.length == cache.offset == 4
    expected = step_outputs(cache, 8)
    for got, want in zip(step_outputs(to_mlx_vlm(state), 8), expected, strict=True):
        assert mx.array_equal(got, want).item()


def _appended(cache: Any, n: int) -> ks.TurboQuantKV:
    return ks.kinds.replace(from_mlx_vlm(cache), appended=n)


def batch_cache(
    paddings: list[int], n: int, seed: int, key_bits: float = 3, like: Any = None
) -> tq.BatchTurboQuantKVCache:
    """A filled BatchTurboQuantKVCache; with `like`, coded with that cache's codecs (a Split
    codec's channels are chosen from the first keys: rows batched together must share them)."""
    cache = tq.BatchTurboQuantKVCache(paddings, 3, seed=1, key_bits=key_bits, value_bits=3.5)
    if like is not None:
        cache.key_codec, cache.value_codec = like.key_codec, like.value_codec
    return filled(cache, n, seed, batch=len(paddings))


def batch_fields(cache: tq.BatchTurboQuantKVCache) -> list[Any]:
    arrays = [
        a[..., : cache._idx, :] if a.ndim == 4 else a[..., : cache._idx]
        for a in leaves(cache.keys) + leaves(cache.values)
    ]
    return [*arrays, cache.left_padding, cache.offset, cache._idx]


def assert_batch_equal(a: tq.BatchTurboQuantKVCache, b: tq.BatchTurboQuantKVCache) -> None:
    fa, fb = batch_fields(a), batch_fields(b)
    assert fa[-1] == fb[-1]
    assert_same_arrays(fa[:-1], fb[:-1])


@pytest.mark.parametrize("key_bits", [3, 2.5])
def test_batch_round_trip_and_batch_methods_equal_kvstates(key_bits):
    cache = batch_cache([2, 0, 1], 5, 20, key_bits)
    state = from_mlx_vlm(cache)
    assert type(to_mlx_vlm(state)) is tq.BatchTurboQuantKVCache
    assert_batch_equal(to_mlx_vlm(state), cache)

    filtered = copy.deepcopy(cache)
    filtered.filter(mx.array([0, 2]))
    assert_batch_equal(to_mlx_vlm(ks.filter(state, [0, 2])), filtered)

    other = batch_cache([0, 1], 3, 30, key_bits, like=cache)
    extended = copy.deepcopy(cache)
    extended.extend(other)
    assert_batch_equal(to_mlx_vlm(ks.extend(state, from_mlx_vlm(other))), extended)

    for row in range(3):
        one = cache.extract(row)
        assert_same_arrays(mse_arrays(to_mlx_vlm(ks.extract(state, row))), mse_arrays(one))

    expected = step_outputs(cache, 40, batch=3)
    for got, want in zip(step_outputs(to_mlx_vlm(state), 40, batch=3), expected, strict=True):
        assert mx.array_equal(got, want).item()


def test_merge_refuses_mixed_bits_and_seeds_naming_the_fields():
    a = from_mlx_vlm(filled(tq.TurboQuantKVCache(3, seed=0), 4, 1))
    for other, field in (
        (tq.TurboQuantKVCache(4, seed=0), "key_bits"),
        (tq.TurboQuantKVCache(3, seed=5), "seed"),
        (tq.TurboQuantKVCache(3, seed=0, value_bits=2), "value_bits"),
    ):
        with pytest.raises(ks.ConfigMismatchError, match=field):
            ks.merge([a, from_mlx_vlm(filled(other, 4, 1))])
    merged = ks.merge([a, from_mlx_vlm(filled(tq.TurboQuantKVCache(3, seed=0), 2, 9))])
    assert ks.batch_size(merged) == 2 and merged.length == 4


def test_merge_refuses_split_rows_of_other_channels_naming_the_field():
    # Two caches at 2.5 key bits chose their high channels from different first keys: their
    # rows are packed in different coordinates (mlx-vlm's extend would mix them silently).
    def split(seed: int, like: Any = None) -> tq.TurboQuantKVCache:
        cache = tq.TurboQuantKVCache(3, seed=0, key_bits=2.5, value_bits=3.5)
        if like is not None:
            cache.key_codec, cache.value_codec = like.key_codec, like.value_codec
        return filled(cache, 4, seed)

    first = split(1)
    a = from_mlx_vlm(first)
    with pytest.raises(ks.ConfigMismatchError, match=r"key_high_channels\[\d+\]"):
        ks.merge([a, from_mlx_vlm(split(2))])
    with pytest.raises(ks.ConfigMismatchError, match=r"key_bits: 2\.5 != 3"):
        ks.merge([a, from_mlx_vlm(filled(tq.TurboQuantKVCache(3, seed=0, value_bits=3.5), 4, 1))])
    merged = ks.merge([a, from_mlx_vlm(split(3, like=first))])
    assert ks.batch_size(merged) == 2
    assert mx.array_equal(merged.key_high_channels, a.key_high_channels).item()


def test_unsupported_codecs_are_refused_naming_the_class():
    # mlx-vlm's caches build only mode="mse" codecs; a cache given another one by hand is
    # refused, naming the codec, instead of being read as MSE arrays.
    keys = normal(0, (1, 2, 4, 64))
    for codec, name in (
        (tq._TurboQuantProdCodec(64, 3, 0), "_TurboQuantProdCodec"),
        (tq._TurboQuantPolarProdCodec(64, 4, 0), "_TurboQuantPolarProdCodec"),
        (tq._SplitCodec(keys, 2.5, "prod", 0), "_SplitCodec of mode 'prod'"),
    ):
        odd = filled(tq.TurboQuantKVCache(3, seed=0), 4, 1)
        odd.key_codec = codec
        with pytest.raises(ks.StateError, match=name):
            from_mlx_vlm(odd)


def test_check_refuses_a_wrong_index_width():
    state = from_mlx_vlm(filled(tq.TurboQuantKVCache(3, seed=0), 4, 1))
    with pytest.raises(
        ks.StateError, match="key_indices: 6 words per row, but 64 indices of 4 bits pack into 8"
    ):
        ks.check(ks.kinds.replace(state, key_bits=4))


@pytest.mark.parametrize("bits", [4, 3, 2, 3.5, 2.5])
def test_state_errors_equal_mlx_vlms(bits):
    # The quality figures: relative key error of TurboQuant-MSE (and Split at x.5
    # bits: BENCHMARKS.md's 0.146 / 0.271), through kvstate's state (codecs rebuilt from its
    # statics and channels) and through mlx-vlm's cache, identical.
    keys = normal(int(bits * 2), (1, 2, 64, 128))
    cache = tq.TurboQuantKVCache(bits, seed=0, key_bits=bits, value_bits=bits)
    cache.update_and_fetch(keys, keys)
    state = from_mlx_vlm(cache)
    ours = codecs(state)[0].dequantize(side_state(state, "key"))
    theirs = cache.dequantize()[0]
    err = lambda x: (mx.linalg.norm(x - keys) / mx.linalg.norm(keys)).item()  # noqa: E731
    assert err(ours) == err(theirs)
    expected = {4: 0.097, 3: 0.184, 2: 0.341, 3.5: 0.146, 2.5: 0.271}[bits]
    assert err(ours) == pytest.approx(expected, abs=0.02)


@pytest.mark.parametrize(("key_bits", "value_bits"), [(3, 3), (2.5, 3.5)])
def test_a_model_decodes_the_same_after_a_save_load_round_trip(tmp_path, key_bits, value_bits):
    model = tiny_vlm("llama").language_model
    prompt, follow = [3, 17, 42, 8, 99, 5], [11, 23, 7]

    def caches() -> list[Any]:
        return [
            tq.TurboQuantKVCache(3, seed=4, key_bits=key_bits, value_bits=value_bits)
            for _ in make_prompt_cache(model)
        ]

    theirs = caches()
    model(mx.array([prompt]), cache=theirs)
    ks.save(tmp_path / "m.safetensors", from_mlx_vlm(theirs))
    ours = to_mlx_vlm(ks.load(tmp_path / "m.safetensors"))
    tokens: list[list[int]] = [[], []]
    for t in follow:  # teacher-forced logits, then greedy tokens
        a = model(mx.array([[t]]), cache=theirs).logits
        b = model(mx.array([[t]]), cache=ours).logits
        assert mx.array_equal(a, b).item()
    for cache, out in ((theirs, tokens[0]), (ours, tokens[1])):
        token = follow[-1]
        for _ in range(4):
            token = int(mx.argmax(model(mx.array([[token]]), cache=cache).logits[0, -1]).item())
            out.append(token)
    assert tokens[0] == tokens[1]


@pytest.mark.parametrize(("key_bits", "value_bits"), [(3, 2), (2.5, 3.5)])
def test_an_empty_padded_state_prefills_like_mlx_vlms_batch_cache(key_bits, value_bits):
    # Padding for a batched prefill: the state says how much of each row will be padding
    # (a Split side chooses its channels from the prefill's keys, as mlx-vlm's does).
    spec = ks.TurboQuantKV(
        left_padding=mx.array([2, 0], mx.int32), key_bits=key_bits, value_bits=value_bits
    )
    spec = ks.merge([ks.row_select(spec, 0), ks.row_select(spec, 1)])
    theirs = tq.BatchTurboQuantKVCache([2, 0], 3, seed=0, key_bits=key_bits, value_bits=value_bits)
    ours = to_mlx_vlm(spec)
    assert type(ours) is tq.BatchTurboQuantKVCache
    for cache in (theirs, ours):
        filled(cache, 4, 50, batch=2)
    assert_batch_equal(ours, theirs)
    ks.check(from_mlx_vlm(ours))
    expected = step_outputs(theirs, 60, batch=2)
    for got, want in zip(step_outputs(ours, 60, batch=2), expected, strict=True):
        assert mx.array_equal(got, want).item()


@pytest.mark.parametrize(("key_bits", "value_bits"), [(3, 3), (3.5, 2.5)])
def test_a_wrapped_model_on_turboquant_states_decodes_like_mlx_vlms_caches(key_bits, value_bits):
    """kvstate's wrapper on a ModelState of TurboQuantKV layers vs the language model on
    mlx-vlm's TurboQuantKVCache list: prompt logits, a verify forward rolled back with
    commit_prefix (mlx-vlm: trim), then greedy tokens, identical."""
    from kvstate.adapters.vlm import wrap

    model = tiny_vlm("llama")
    lm, wrapped = model.language_model, wrap(model)
    layers = len(make_prompt_cache(lm))
    bits = {"key_bits": key_bits, "value_bits": value_bits}
    caches = [tq.TurboQuantKVCache(3, seed=4, **bits) for _ in range(layers)]
    state = ks.ModelState(tuple(ks.TurboQuantKV(seed=4, **bits) for _ in range(layers)))
    prompt = mx.array([[3, 17, 42, 8, 99, 5]])
    logits, state = wrapped(prompt, state)
    assert mx.array_equal(logits, lm(prompt, cache=caches).logits).item()
    draft = mx.array([[11, 23, 7]])
    logits, state = wrapped(draft, state)
    assert mx.array_equal(logits, lm(draft, cache=caches).logits).item()
    state = ks.commit_prefix(state, 1)
    for cache in caches:
        cache.trim(2)
    ours, theirs = greedy_side_by_side(wrapped, state, lm, caches, 11, 5)
    assert ours == theirs and len(set(ours)) > 2  # the tokens vary: a real decode
