"""QuantizedKV through wrap, the adapters and the transforms, against mlx-lm's QuantizedKVCache
(generate_step with kv_bits), `mx.quantize`, and a dequantizing KVCache for the packing fix."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

import kvstate as ks
from kvstate.adapters import from_mlx_lm, to_mlx_lm, wrap
from kvstate.adapters.caches.compat import packed_quantized_cache, packed_update_and_fetch
from kvstate.adapters.tiny_models import tiny_model
from kvstate.testing import assert_states_equal, frozen_copy

PROMPT = [3, 17, 42, 99, 7, 250, 31, 8, 1, 2, 3, 4]
DRAFT = [11, 12, 13, 14]
FOLLOW = [5, 6, 7]


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", head_dim=64)  # quantization groups are >= 32 wide


def np_(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32) if a.dtype == mx.bfloat16 else a)


def assert_same_triples(a: tuple, b: tuple, length: int) -> None:
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(np_(x[..., :length, :]), np_(y[..., :length, :]))


def quantized_prefill(model, prompt, bits, group_size):
    """kvstate's version of generate_step's prefill: all but the last prompt token, then quantize."""
    m = wrap(model)
    _, state = m(mx.array([prompt[:-1]]), m.init_state())
    return m, ks.quantize(state, bits=bits, group_size=group_size)


def mlx_lm_quantized_prefill(model, prompt, bits, group_size):
    caches = make_prompt_cache(model)
    model(mx.array([prompt]), cache=caches)
    return [c.to_quantized(group_size=group_size, bits=bits) for c in caches]


# --- against generate_step(kv_bits=...) -------------------------------------------------


@pytest.mark.parametrize(
    ("bits", "group_size"), [(2, 64), (3, 32), (4, 64), (5, 32), (6, 64), (8, 32)]
)
def test_greedy_tokens_and_logprobs_equal_generate_step_with_kv_bits(model, bits, group_size):
    n = 16
    steps = generate_step(
        mx.array(PROMPT),
        model,
        max_tokens=n,
        kv_bits=bits,
        kv_group_size=group_size,
        quantized_kv_start=0,
    )
    expected = [(int(tok), np.array(lp)) for tok, lp in steps]
    assert len({t for t, _ in expected}) > 4, "the oracle decode is degenerate"

    m, state = quantized_prefill(model, PROMPT, bits, group_size)
    logits, state = m(mx.array([PROMPT[-1:]]), state)
    for tok, ref_logprobs in expected:
        last = logits[:, -1]
        y = last.argmax(-1)
        assert int(y.item()) == tok
        logprobs = np.array(last - mx.logsumexp(last, keepdims=True))[0]
        np.testing.assert_allclose(logprobs, ref_logprobs, rtol=1e-5, atol=1e-5)
        logits, state = m(y[:, None], state)
    assert all(isinstance(layer, ks.QuantizedKV) for layer in state.layers)
    assert state.layers[0].length == len(PROMPT) + n


def test_logits_equal_quantized_kv_cache_under_teacher_forcing(model):
    tokens = list(range(40, 80))
    chunks = [1] * 5 + [3, 2, 1, 4] + [1] * 3
    caches = mlx_lm_quantized_prefill(model, PROMPT, 4, 64)
    _, state = wrap(model)(mx.array([PROMPT]), wrap(model).init_state())
    state = ks.quantize(state, bits=4, group_size=64)
    m, at = wrap(model), 0
    for size in chunks:
        x = mx.array([tokens[at : at + size]])
        expected = np.array(model(x, cache=caches))
        logits, state = m(x, state)
        np.testing.assert_allclose(np.array(logits), expected, rtol=1e-5, atol=1e-5)
        at += size
    assert state.layers[0].length == caches[0].offset
    assert_same_triples(state.layers[1].keys, caches[1].keys, caches[1].offset)


# --- commit_prefix --------------------------------------------------------------------


@pytest.mark.parametrize("accepted", [0, 1, 3, 4])
def test_commit_prefix_equals_decoding_only_the_accepted_prefix(model, accepted):
    m = wrap(model)
    _, state = m(mx.array([PROMPT]), m.init_state())
    state = ks.quantize(state, bits=4, group_size=64)
    before_verify = frozen_copy(state)
    _, verified = m(mx.array([DRAFT]), state)
    after_verify = frozen_copy(verified)
    committed = ks.commit_prefix(verified, accepted)
    logits, _ = m(mx.array([FOLLOW]), committed)

    caches = mlx_lm_quantized_prefill(model, PROMPT, 4, 64)
    if accepted:
        model(mx.array([DRAFT[:accepted]]), cache=caches)
    for layer, cache in zip(committed.layers, caches, strict=True):
        assert layer.length == cache.offset == len(PROMPT) + accepted
        assert_same_triples(layer.keys, cache.keys, cache.offset)
        assert_same_triples(layer.values, cache.values, cache.offset)
    expected = np.array(model(mx.array([FOLLOW]), cache=caches))

    np.testing.assert_allclose(np.array(logits), expected, rtol=1e-5, atol=1e-5)
    assert all(layer.appended == 0 for layer in committed.layers)
    # Neither the input of the verify nor the verified state changed, though the follow-up
    # forward wrote into the buffer they share with `committed`.
    assert_states_equal(state, before_verify)
    assert_states_equal(verified, after_verify)


def test_ragged_commit_equals_each_row_decoding_its_accepted_prefix(model):
    """Rows keep 1 and 3 of 4 drafted tokens: the follow-up logits of each row equal mlx-lm's
    QuantizedKVCache that decoded only that row's accepted prefix."""
    m = wrap(model)
    _, state = m(mx.array([PROMPT]), m.init_state())
    batch = ks.tile(ks.quantize(state, bits=8, group_size=64), 2)
    _, verified = m(mx.array([DRAFT, DRAFT]), batch)
    committed = ks.commit_prefix(verified, [1, 3])
    assert ks.capabilities(committed).ragged_commit
    logits, _ = m(mx.array([FOLLOW, FOLLOW]), committed)
    for row, accepted in enumerate([1, 3]):
        caches = mlx_lm_quantized_prefill(model, PROMPT, 8, 64)
        model(mx.array([DRAFT[:accepted]]), cache=caches)
        extracted = ks.extract(committed, row)
        assert extracted.layers[1].length == caches[1].offset == len(PROMPT) + accepted
        expected = np.array(model(mx.array([FOLLOW]), cache=caches))
        np.testing.assert_allclose(np.array(logits[row : row + 1]), expected, atol=1e-4)
        # (the commit moved the row's oldest tokens into its hole: same set, other order)
        alone, _ = m(mx.array([FOLLOW]), extracted)
        np.testing.assert_allclose(np.array(alone), expected, atol=1e-4)


# --- the packing fix --------------------------------------------------------------------


def mlx_lm_words(dim: int, bits: int) -> int:
    return dim // (32 // bits)  # what mlx-lm 0.32's QuantizedKVCache allocates


@pytest.mark.parametrize("head_dim", [64, 192, 256])
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_adapter_buffers_match_mx_quantize(bits, head_dim):
    mx.random.seed(bits * 1000 + head_dim)
    k1, v1 = mx.random.normal((1, 2, 5, head_dim)), mx.random.normal((1, 2, 5, 64))
    k2, v2 = mx.random.normal((1, 2, 3, head_dim)), mx.random.normal((1, 2, 3, 64))

    state = ks.QuantizedKV(key_bits=bits, value_bits=bits, key_group_size=64, value_group_size=64)
    for k, v in [(k1, v1), (k2, v2)]:
        cache = to_mlx_lm(state)
        cache.update_and_fetch(k, v)
        state = from_mlx_lm(cache)
    assert state.length == 8 and ks.batch_size(state) == 1
    expected_k = mx.quantize(mx.concatenate([k1, k2], axis=2), group_size=64, bits=bits)
    expected_v = mx.quantize(mx.concatenate([v1, v2], axis=2), group_size=64, bits=bits)
    assert_same_triples(state.keys, expected_k, 8)
    assert_same_triples(state.values, expected_v, 8)
    assert state.keys[0].shape[-1] == head_dim * bits // 32

    # mlx-lm's own class: right exactly where its word count agrees with mx.quantize.
    theirs = QuantizedKVCache(group_size=64, bits=bits)
    if mlx_lm_words(head_dim, bits) == head_dim * bits // 32:
        theirs.update_and_fetch(k1, v1)
        assert_same_triples(theirs.keys, expected_k, 5)
    else:
        with pytest.raises(ValueError, match="broadcast"):
            theirs.update_and_fetch(k1, v1)


def test_mlx_lm_quantized_cache_fails_for_5_bit_at_head_dim_192():
    """Documents the mlx-lm bug kvstate works around (fails once mlx-lm fixes it)."""
    keys = mx.random.normal((1, 2, 3, 192))
    assert mlx_lm_words(192, 5) == 32 and 192 * 5 // 32 == 30
    with pytest.raises(ValueError, match="broadcast"):
        QuantizedKVCache(group_size=64, bits=5).update_and_fetch(keys, keys)
    fixed = packed_quantized_cache(group_size=64, bits=5)
    packed, _, _ = fixed.update_and_fetch(keys, keys)[0]
    assert packed.shape == (1, 2, 3, 30)


class DequantizingKVCache(KVCache):
    """Oracle: a float KVCache holding dequantize(quantize(x)), independent of any packing."""

    def __init__(self, bits: int, group_size: int) -> None:
        super().__init__()
        self.q = {"bits": bits, "group_size": group_size}

    def update_and_fetch(self, keys, values):
        def rt(x):
            return mx.dequantize(*mx.quantize(x, **self.q), **self.q)

        return super().update_and_fetch(rt(keys), rt(values))


@pytest.mark.parametrize("bits", [3, 5, 6])
def test_wrap_decodes_where_mlx_lm_cannot(bits):
    """head_dim 192 at 3/5/6 bits, quantized from the start: mlx-lm's cache crashes on its
    first write (only an empty QuantizedKVCache allocates with the wrong width: generate_step
    quantizes a filled KVCache, whose buffers mx.quantize sized); kvstate matches a cache of
    dequantized keys and values (the same numbers the quantized matmuls see)."""
    model = tiny_model("llama", head_dim=192, num_hidden_layers=2)
    theirs = [c.to_quantized(group_size=64, bits=bits) for c in make_prompt_cache(model)]
    with pytest.raises(ValueError, match="broadcast"):
        model(mx.array([PROMPT]), cache=theirs)

    m = wrap(model)
    state = ks.quantize(m.init_state(), bits=bits, group_size=64)
    caches = [DequantizingKVCache(bits, 64) for _ in model.layers]
    tokens = PROMPT
    for _ in range(6):
        logits, state = m(mx.array([tokens]), state)
        expected = model(mx.array([tokens]), cache=caches)
        np.testing.assert_allclose(np.array(logits), np.array(expected), rtol=1e-4, atol=1e-4)
        assert int(logits[0, -1].argmax().item()) == int(expected[0, -1].argmax().item())
        tokens = [int(logits[0, -1].argmax().item())]
    assert state.layers[0].keys[0].shape[-1] == 192 * bits // 32


# --- adapters ---------------------------------------------------------------------------


def test_round_trips_are_identities(model):
    caches = mlx_lm_quantized_prefill(model, PROMPT, 4, 64)
    state = from_mlx_lm(caches)
    layer = state.layers[0]
    assert isinstance(layer, ks.QuantizedKV)
    assert (layer.length, layer.key_bits, layer.value_bits) == (len(PROMPT), 4, 4)
    assert layer.key_group_size == layer.value_group_size == 64
    for a, b in zip(layer.keys + layer.values, caches[0].keys + caches[0].values, strict=True):
        assert a is not b
        np.testing.assert_array_equal(np_(a), np_(b))

    back = to_mlx_lm(state)
    assert all(type(c) is QuantizedKVCache for c in back)
    assert all(c.update_and_fetch.__func__ is packed_update_and_fetch for c in back)
    for c, orig in zip(back, caches, strict=True):
        assert (c.offset, c.bits, c.group_size) == (orig.offset, orig.bits, orig.group_size)
        for a, b in zip(c.keys + c.values, orig.keys + orig.values, strict=True):
            assert a is not b
            np.testing.assert_array_equal(np_(a), np_(b))

    again = from_mlx_lm(back)
    assert ks.tree_flatten(again)[1] == ks.tree_flatten(state)[1]
    for a, b in zip(ks.tree_flatten(again)[0], ks.tree_flatten(state)[0], strict=True):
        np.testing.assert_array_equal(np_(a), np_(b))
    empty = ks.QuantizedKV(key_bits=3, value_bits=3, key_group_size=32, value_group_size=32)
    assert ks.tree_flatten(from_mlx_lm(to_mlx_lm(empty)))[1] == ks.tree_flatten(empty)[1]


# --- quantize and the batch transforms --------------------------------------------------


def test_quantize_matches_kv_cache_to_quantized(model):
    m = wrap(model)
    _, dense = m(mx.array([PROMPT]), m.init_state())
    frozen = frozen_copy(dense)
    caches = make_prompt_cache(model)
    model(mx.array([PROMPT]), cache=caches)
    for layer, cache in zip(ks.quantize(dense, bits=6, group_size=32).layers, caches, strict=True):
        ref = cache.to_quantized(group_size=32, bits=6)
        assert (layer.length, layer.key_bits, layer.value_bits) == (ref.offset, 6, 6)
        assert layer.key_group_size == layer.value_group_size == 32
        assert_same_triples(layer.keys, ref.keys, ref.offset)
        assert_same_triples(layer.values, ref.values, ref.offset)
    assert_states_equal(dense, frozen)


def test_quantize_refuses_what_it_cannot_represent(model):
    m = wrap(model)
    with pytest.raises(ks.ConfigMismatchError, match="bits=7"):
        ks.quantize(m.init_state(), bits=7)
    _, small = wrap(tiny_model("llama"))(mx.array([PROMPT]), wrap(tiny_model("llama")).init_state())
    padded = ks.quantize(small, group_size=32).layers[0]  # head_dim 16: 16 zero channels
    assert (padded.key_pad, padded.value_pad, padded.keys[1].shape[-1]) == (16, 16, 1)
    with pytest.raises(ks.ConfigMismatchError, match="rotation='givens'"):
        ks.quantize(small, rotation="givens")
    with pytest.raises(ks.StateError, match="expected a DenseKV"):
        ks.quantize(ks.QuantizedKV())


def prefilled(model, prompt):
    _, state = wrap(model)(mx.array([prompt]), wrap(model).init_state())
    return ks.quantize(state, bits=4, group_size=64)


def test_merge_tile_extract_against_single_sequence_caches(model):
    prompts = [PROMPT, list(range(100, 107))]  # different lengths: left padding
    singles = [prefilled(model, p) for p in prompts]
    frozen = [frozen_copy(s) for s in singles]
    merged = ks.merge(singles)
    assert ks.batch_size(merged) == 2
    logits, merged_after = wrap(model)(mx.array([DRAFT, [*FOLLOW, 9]]), merged)
    for row, (prompt, draft) in enumerate(zip(prompts, [DRAFT, [*FOLLOW, 9]], strict=True)):
        caches = mlx_lm_quantized_prefill(model, prompt, 4, 64)
        expected = np.array(model(mx.array([draft]), cache=caches))
        np.testing.assert_allclose(np.array(logits[row : row + 1]), expected, atol=1e-4)
        extracted = ks.extract(merged_after, row).layers[2]
        assert extracted.length == caches[2].offset
        assert_same_triples(extracted.keys, caches[2].keys, caches[2].offset)
    for s, f in zip(singles, frozen, strict=True):
        assert_states_equal(s, f)

    tiled = ks.tile(singles[0], 3)
    assert ks.batch_size(tiled) == 3
    logits, _ = wrap(model)(mx.array([DRAFT] * 3), tiled)
    np.testing.assert_array_equal(np.array(logits[0]), np.array(logits[2]))
    assert ks.batch_size(ks.row_select(ks.extend(singles[0], singles[1]), [1])) == 1


@pytest.mark.parametrize(
    ("other", "named"),
    [
        ({"bits": 8}, r"key_bits: 4 != 8.*value_bits: 4 != 8"),
        ({"value_bits": 3}, r"value_bits: 4 != 3"),
        ({"key_group_size": 32}, r"key_group_size: 64 != 32"),
        ({"rotation": "hadamard"}, r"rotation: 'none' != 'hadamard'"),
        ({"rotation": "none", "seed": 5}, r"seed: 0 != 5"),
    ],
)
def test_merge_refuses_mixed_configs_naming_the_fields(model, other, named):
    a = prefilled(model, PROMPT)
    m = wrap(model)
    _, dense = m(mx.array([PROMPT[:5]]), m.init_state())
    b = ks.quantize(dense, **{"bits": 4, "group_size": 64, **other})
    with pytest.raises(ks.ConfigMismatchError, match=named):
        ks.merge([a, b])
    with pytest.raises(ks.ConfigMismatchError, match=named):
        ks.extend(a, b)
