"""QuantizedKV's options (key / value bits and group sizes, pads, rotations, left padding)
against oracles: NumPy (packing bounds, quaternion products, dequantize-then-attend in
float64), mlx-lm's QuantizedKVCache where it is right, and the same mlx-lm model over a
KVCache of dequantized keys and values."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache, make_prompt_cache

import kvstate as ks
import kvstate.testing
from kvstate.adapters import from_mlx_lm, to_mlx_lm, wrap
from kvstate.adapters.caches.quantized_cache import QuantizedStateCache
from kvstate.adapters.tiny_models import CONFIGS, tiny_model
from kvstate.quantization import Codec, rotation_numpy

HEAD_DIMS = (64, 80, 96, 128, 192, 256)
BITS = (2, 3, 4, 5, 6, 8)


def f64(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32)).astype(np.float64)


# --- packing over the bits x head_dim grid ------------------------------------------------


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("bits", BITS)
def test_packing_and_round_trip_over_the_grid(bits, head_dim):
    """Stored rows are whole groups of 32 (80 -> 96); packed words = stored * bits / 32;
    dequantized values are within one quantization step of the input (NumPy bound); the
    adapter writes exactly what `quantize` of the whole sequence gives; mlx-lm's
    QuantizedKVCache allocates `dim // (32 // bits)` words and fails exactly where that
    differs."""
    rng = np.random.default_rng(bits * 1000 + head_dim)
    x1, x2 = (mx.array(rng.standard_normal((1, 2, t, head_dim)).astype(np.float32)) for t in (3, 2))
    v_bits = 8 if bits != 8 else 4  # values at other bits than keys
    state = ks.QuantizedKV(key_bits=bits, value_bits=v_bits, key_group_size=32, value_group_size=32)
    for x in (x1, x2):
        cache = to_mlx_lm(state)
        assert isinstance(cache, QuantizedStateCache)
        cache.update_and_fetch(x, x)
        state = from_mlx_lm(cache)
    stored = head_dim + (-head_dim % 32)
    assert state.key_pad == stored - head_dim
    assert state.keys[0].shape[-1] == stored * bits // 32
    assert state.values[0].shape[-1] == stored * v_bits // 32
    whole = mx.concatenate([x1, x2], axis=2)
    expected = ks.quantize(
        ks.DenseKV(whole, whole, length=5), key_bits=bits, value_bits=v_bits, group_size=32
    )
    for a, b in zip(state.keys + state.values, expected.keys + expected.values, strict=True):
        np.testing.assert_array_equal(np.array(a[..., :5, :]), np.array(b))

    packed, scales, _ = (f64(a[..., :5, :]) for a in state.keys)
    back = f64(mx.dequantize(*(a[..., :5, :] for a in state.keys), group_size=32, bits=bits))
    padded = np.concatenate([f64(whole), np.zeros((1, 2, 5, stored - head_dim))], axis=-1)
    step = np.repeat(np.abs(scales), 32, axis=-1)
    # (mlx keeps zero exactly representable, so the error bound is one step, not half)
    assert np.all(np.abs(back - padded) <= step + 1e-3 * (1 + np.abs(padded)))
    assert packed.shape[-1] * 32 == stored * bits

    mlx_lm_words = head_dim // (32 // bits)
    theirs = QuantizedKVCache(group_size=32, bits=bits)
    if head_dim % 32 == 0 and mlx_lm_words == head_dim * bits // 32:
        theirs.update_and_fetch(x1, x1)
        np.testing.assert_array_equal(
            np.array(theirs.keys[0][..., :3, :]), np.array(state.keys[0][..., :3, :])
        )
    else:
        with pytest.raises(ValueError):
            theirs.update_and_fetch(x1, x1)


def test_mlx_lm_words_are_wrong_where_the_issue_says():
    wrong = {
        (d, b) for d in HEAD_DIMS for b in BITS if d % 32 == 0 and d // (32 // b) != d * b // 32
    }
    assert {(192, 3), (256, 3)} <= wrong and not {(d, b) for d, b in wrong if b in (2, 4, 8)}
    assert {(128, 5), (128, 6), (96, 5)} <= wrong


# --- rotations ------------------------------------------------------------------------------


def hamilton(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    w1, x1, y1, z1 = p
    w2, x2, y2, z2 = q
    return np.array(
        [
            w1 * w2 - x1 * x2 - y1 * y2 - z1 * z2,
            w1 * x2 + x1 * w2 + y1 * z2 - z1 * y2,
            w1 * y2 - x1 * z2 + y1 * w2 + z1 * x2,
            w1 * z2 + x1 * y2 - y1 * x2 + z1 * w2,
        ]
    )


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_so4_is_q_left_v_conj_q_right_per_block(head_dim):
    seed = 11
    quats = np.random.default_rng(seed).standard_normal((2, head_dim // 4, 4))
    quats /= np.linalg.norm(quats, axis=-1, keepdims=True)
    v = np.random.default_rng(0).standard_normal(head_dim)
    expected = np.concatenate(
        [
            hamilton(hamilton(quats[0, b], v[4 * b : 4 * b + 4]), quats[1, b] * [1, -1, -1, -1])
            for b in range(head_dim // 4)
        ]
    )
    r = rotation_numpy("so4", head_dim, seed)
    np.testing.assert_allclose(r @ v, expected, atol=1e-12)
    np.testing.assert_allclose(r @ r.T, np.eye(head_dim), atol=1e-12)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_hadamard_is_orthogonal_and_mixes_every_block(head_dim):
    r = rotation_numpy("hadamard", head_dim, 3)
    np.testing.assert_allclose(r @ r.T, np.eye(head_dim), atol=1e-12)
    if head_dim & (head_dim - 1) == 0:  # a power of two: a signed Sylvester Hadamard matrix
        np.testing.assert_allclose(np.abs(r), 1 / np.sqrt(head_dim), atol=1e-12)
    assert (np.abs(r) > 1e-9).sum(axis=1).min() >= head_dim // 2
    assert not np.allclose(r, rotation_numpy("hadamard", head_dim, 4))  # the seed matters


# --- quantized attention vs dequantize-then-attend ----------------------------------------


def reference_attention(queries, state, scale, mask):
    """Float64 NumPy: dequantize, rotate back, drop the pad channels, attend."""

    def side(q, bits, group, pad):
        x = f64(mx.dequantize(*(a[..., : state.length, :] for a in q), group_size=group, bits=bits))
        x = x @ rotation_numpy(state.rotation, x.shape[-1], state.seed)
        return x[..., : x.shape[-1] - pad]

    k = side(state.keys, state.key_bits, state.key_group_size, state.key_pad)
    v = side(state.values, state.value_bits, state.value_group_size, state.value_pad)
    q = f64(queries)
    repeats = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, repeats, axis=1), np.repeat(v, repeats, axis=1)
    scores = scale * q @ k.swapaxes(-1, -2)
    L, S = scores.shape[-2:]
    allowed = np.ones(scores.shape, bool)
    if isinstance(mask, str):
        allowed &= np.arange(S - L, S)[:, None] >= np.arange(S)[None]
    elif mask is not None and mask.dtype == mx.bool_:
        allowed &= np.array(mask)
    elif mask is not None:
        scores = scores + f64(mask)
    if state.left_padding is not None:
        allowed &= (
            np.arange(S)[None, None, None] >= np.array(state.left_padding)[:, None, None, None]
        )
    scores = np.where(allowed, scores, -np.inf)
    w = np.exp(scores - scores.max(-1, keepdims=True))
    return (w / w.sum(-1, keepdims=True)) @ v


@pytest.mark.parametrize(
    ("key_bits", "value_bits", "rotation", "head_dim", "q_heads", "mask"),
    [
        (4, 3, "hadamard", 128, 8, "causal"),
        (4, 3, "so4", 128, 4, "bool"),
        (8, 2, "none", 80, 4, "additive"),
        (3, 5, "hadamard", 96, 2, None),
        (6, 4, "so4", 192, 2, "causal"),
        (2, 8, "hadamard", 64, 2, "bool"),
        (5, 6, "none", 256, 4, None),
    ],
)
@pytest.mark.parametrize("left_padded", [False, True])
def test_quantized_attention_equals_dequantize_then_attend(
    key_bits, value_bits, rotation, head_dim, q_heads, mask, left_padded
):
    rng = np.random.default_rng(key_bits * 100 + value_bits)
    B, H, S, L = 2, 2, 9, 3
    keys = mx.array(rng.standard_normal((B, H, S, head_dim)).astype(np.float32))
    values = mx.array(rng.standard_normal((B, H, S, head_dim)).astype(np.float32))
    pads = mx.array([0, 4], mx.int32) if left_padded else None
    dense = ks.DenseKV(keys, values, pads, length=S)
    state = ks.quantize(
        dense, key_bits=key_bits, value_bits=value_bits, group_size=32, rotation=rotation, seed=5
    )
    queries = mx.array(rng.standard_normal((B, q_heads, L, head_dim)).astype(np.float32))
    if mask == "bool":
        mask = mx.array(rng.random((B, 1, L, S)) > 0.3) | (mx.arange(S) == S - 1)
    elif mask == "additive":
        mask = mx.array(rng.standard_normal((B, q_heads, L, S)).astype(np.float32))
    scale = head_dim**-0.5
    out = ks.quantized_attention(queries, state, scale=scale, mask=mask)
    assert out.shape == (B, q_heads, L, head_dim)
    np.testing.assert_allclose(
        f64(out), reference_attention(queries, state, scale, mask), atol=2e-3
    )


# --- wrapped models: a drop-in for the dense cache ------------------------------------------


class DequantizingCache(KVCache):
    """Oracle: mlx-lm's KVCache of decode(encode(x)), read by mlx-lm's own dense attention."""

    def __init__(self, key_codec: Codec, value_codec: Codec) -> None:
        super().__init__()
        self.codecs = (key_codec, value_codec)

    def update_and_fetch(self, keys, values):
        k, v = (c.decode(c.encode(x)) for c, x in zip(self.codecs, (keys, values), strict=True))
        return super().update_and_fetch(k, v)


OPTIONS = {"key_bits": 4, "value_bits": 3, "group_size": 32, "seed": 3}


def oracle_caches(model, name, rotation):
    caches = make_prompt_cache(model)
    pads = -CONFIGS[name]["head_dim"] % 32  # tiny models: head dim 16, stored as 32
    codecs = (Codec(4, 32, pads, rotation, 3), Codec(3, 32, pads, rotation, 3))
    return [DequantizingCache(*codecs) if type(c) is KVCache else c for c in caches]


def quantized_state(m, rotation):
    state = m.init_state()
    layers = [
        ks.quantize(layer, rotation=rotation, **OPTIONS) if isinstance(layer, ks.DenseKV) else layer
        for layer in state.layers
    ]
    return ks.ModelState(tuple(layers))


@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma3_text", "qwen3_next"])
@pytest.mark.parametrize("rotation", ["hadamard", "so4"])
def test_wrapped_models_decode_like_a_dequantized_cache(name, rotation):
    model = tiny_model(name)
    m = wrap(model)
    state = quantized_state(m, rotation)
    caches = oracle_caches(model, name, rotation)
    assert any(type(c) is RotatingKVCache for c in caches) == (name == "gemma3_text")
    tokens = [3, 17, 42, 99, 7, 250, 31, 8, 1, 2]
    for _ in range(6):
        logits, state = m(mx.array([tokens]), state)
        expected = model(mx.array([tokens]), cache=caches)
        np.testing.assert_allclose(np.array(logits), np.array(expected), atol=2e-3, rtol=1e-3)
        tokens = [int(expected[0, -1].argmax().item())]
    quantized = [p for p in state.layers if isinstance(p, ks.QuantizedKV)]
    assert quantized and all(p.key_bits == 4 and p.value_bits == 3 for p in quantized)


def test_left_padded_batch_decodes_each_row_like_mlx_lm_quantized_cache():
    """Equal bits, no rotation, rows of different lengths (left padding: kvstate's attention)
    -> greedy tokens and logits of each row equal mlx-lm's QuantizedKVCache decoding it alone."""
    model = tiny_model("llama", head_dim=64)
    m = wrap(model)
    prompts = [[3, 17, 42, 99, 7, 250, 31, 8], [5, 6, 7]]
    singles = []
    for p in prompts:
        _, s = m(mx.array([p[:-1]]), m.init_state())
        singles.append(ks.quantize(s, bits=4, group_size=64))
    batch = ks.merge(singles)
    assert isinstance(to_mlx_lm(batch)[0], QuantizedStateCache)
    tokens = [[p[-1]] for p in prompts]
    theirs = []
    for p in prompts:
        caches = make_prompt_cache(model)
        model(mx.array([p[:-1]]), cache=caches)
        theirs.append([c.to_quantized(group_size=64, bits=4) for c in caches])
    for _ in range(8):
        logits, batch = m(mx.array(tokens), batch)
        for row in range(2):
            expected = model(mx.array([tokens[row]]), cache=theirs[row])
            np.testing.assert_allclose(np.array(logits[row]), np.array(expected[0]), atol=1e-4)
        tokens = [[int(t)] for t in logits[:, -1].argmax(-1).tolist()]


# --- save / load -------------------------------------------------------------------------


def test_rotations_and_pads_survive_save_and_load(tmp_path):
    model = tiny_model("llama", head_dim=80)
    m = wrap(model)
    _, dense = m(mx.array([[3, 17, 42, 99, 7]]), m.init_state())
    state = ks.quantize(dense, rotation="so4", **OPTIONS)
    assert state.layers[0].key_pad == 16
    ks.save(tmp_path / "q.safetensors", state)
    loaded = ks.load(tmp_path / "q.safetensors")
    ks.testing.assert_states_equal(loaded, state)
    a, _ = m(mx.array([[9, 10]]), state)
    b, _ = m(mx.array([[9, 10]]), loaded)
    np.testing.assert_array_equal(np.array(a), np.array(b))
    other_seed = ks.quantize(dense, rotation="so4", **{**OPTIONS, "seed": 4})
    c, _ = m(mx.array([[9, 10]]), other_seed)
    assert not np.allclose(np.array(a), np.array(c))  # the seed is what the file restores


def test_files_of_the_one_bits_quantized_kv_still_load(tmp_path):
    """A file written before keys and values had their own bits (statics length, group_size,
    bits, appended; children keys, values) loads as the equal-bits state it was."""
    import hashlib
    import json

    rng = np.random.default_rng(0)
    k = mx.array(rng.standard_normal((1, 2, 6, 64)).astype(np.float32))
    state = ks.quantize(ks.DenseKV(k, k, length=6, appended=2), bits=4, group_size=64)
    path = str(tmp_path / "old.safetensors")
    ks.save(path, state)
    tensors, header = mx.load(path, return_metadata=True)
    doc = json.loads(header["kvstate.body"])
    node = doc["tree"]
    node["statics"] = {"length": 6, "group_size": 64, "bits": 4, "appended": 2}
    for child in ("left_padding", "tail_keys", "tail_values"):
        del node["children"][child]
    header["kvstate.body"] = json.dumps(doc)
    header["kvstate.sha256"] = hashlib.sha256(header["kvstate.body"].encode()).hexdigest()
    mx.save_safetensors(path, tensors, header)
    kvstate.testing.assert_states_equal(ks.load(path), state)

    node["statics"]["bits"] = "four"  # an upgraded file is checked like any other
    header["kvstate.body"] = json.dumps(doc)
    header["kvstate.sha256"] = hashlib.sha256(header["kvstate.body"].encode()).hexdigest()
    mx.save_safetensors(path, tensors, header)
    with pytest.raises(ks.FileFormatError, match="key_bits"):
        ks.load(path)


def test_route_attention_is_per_instance_and_unrouted_models_refuse():
    """mlx-lm's attention reading a QuantizedStateCache raises (instead of reading K4/V3
    buffers at one bits); route_attention fixes that instance only, and leaves dense caches
    to mlx-lm's own attention (identical logits)."""
    from kvstate.adapters import route_attention

    routed, plain = tiny_model("llama"), tiny_model("llama")
    tokens = mx.array([[3, 17, 42, 99]])
    dense_before = routed(tokens, cache=make_prompt_cache(routed))
    state = quantized_state(wrap(routed), "hadamard")
    with pytest.raises(ks.StateError, match="route_attention"):
        routed(tokens, cache=to_mlx_lm(state))
    assert route_attention(routed) is routed
    logits = routed(tokens, cache=to_mlx_lm(state))
    expected = routed(tokens, cache=oracle_caches(routed, "llama", "hadamard"))
    np.testing.assert_allclose(np.array(logits), np.array(expected), atol=2e-3, rtol=1e-3)
    np.testing.assert_array_equal(
        np.array(routed(tokens, cache=make_prompt_cache(routed))), np.array(dense_before)
    )
    assert type(plain.layers[0].self_attn) is not type(routed.layers[0].self_attn)
    with pytest.raises(ks.StateError, match="route_attention"):
        plain(tokens, cache=to_mlx_lm(state))
