"""QuantizedKV's exact tail (`quantize(..., exact_latest=R)`, issue 22's quality goal): each
query reads its latest R keys and values unquantized and the older ones through the codec.

Oracles: a float64 NumPy attention that picks, per (query, key) pair, the raw or the
dequantized key and value by the rule (t_k > t_q - R); mlx-lm's model on its own dense
KVCache with its attention function swapped for that rule (chunking cannot change it, so
every chunked prefill, decode and verify must match it); the state of each row alone.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx_lm.models.gemma3_text as gemma3_text
import mlx_lm.models.llama as llama
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

import kvstate as ks
from kvstate.adapters import wrap
from kvstate.adapters.tiny_models import VOCAB, tiny_model
from kvstate.quantization import Codec, key_codec, rotation_numpy, value_codec

from .helpers import two_rows_through_a_ragged_commit
from .test_quantized_options import f64


def _dequantized(q: Any, codec: Codec, length: int, seed: int) -> np.ndarray:
    x = f64(
        mx.dequantize(
            *(a[..., :length, :] for a in q), group_size=codec.group_size, bits=codec.bits
        )
    )
    x = x @ rotation_numpy(codec.rotation, x.shape[-1], seed)
    return x[..., : x.shape[-1] - codec.pad]


def mixed_reference(queries, raw_keys, raw_values, state, scale, mask) -> np.ndarray:
    """Float64: query at position length - L + i reads key t raw when t > that - R, else
    dequantized; causal / bool masks and the left padding as `quantized_attention` takes them."""
    S, R = state.length, state.exact_latest
    k_q = _dequantized(state.keys, key_codec(state), S, state.seed)
    v_q = _dequantized(state.values, value_codec(state), S, state.seed)
    k, v, q = f64(raw_keys)[..., :S, :], f64(raw_values)[..., :S, :], f64(queries)
    repeats = q.shape[1] // k.shape[1]
    k, v, k_q, v_q = (np.repeat(x, repeats, axis=1) for x in (k, v, k_q, v_q))
    L = q.shape[2]
    t_q, t_k = np.arange(S - L, S)[:, None], np.arange(S)[None]
    exact = t_k > t_q - R
    scores = scale * np.where(exact, q @ k.swapaxes(-1, -2), q @ k_q.swapaxes(-1, -2))
    allowed = np.ones(scores.shape, bool)
    if isinstance(mask, str):
        allowed &= t_q >= t_k
    elif mask is not None:
        allowed &= np.array(mask)
    if state.left_padding is not None:
        allowed &= t_k[None, None] >= np.array(state.left_padding)[:, None, None, None]
    scores = np.where(allowed, scores, -np.inf)
    w = np.exp(scores - scores.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    return (w * exact) @ v + (w * ~exact) @ v_q


@pytest.mark.parametrize(
    ("key_bits", "value_bits", "rotation", "head_dim", "q_heads", "mask", "exact_latest"),
    [
        (4, 3, "hadamard", 128, 8, "causal", 3),
        (4, 3, "so4", 96, 4, "bool", 5),
        (2, 2, "none", 64, 2, None, 1),
        (4, 2, "hadamard", 256, 4, "causal", 20),  # longer than the state: all exact
    ],
)
@pytest.mark.parametrize("left_padded", [False, True])
def test_attention_reads_the_latest_keys_exactly(
    key_bits, value_bits, rotation, head_dim, q_heads, mask, exact_latest, left_padded
):
    rng = np.random.default_rng(key_bits * 10 + exact_latest)
    B, H, S, L = 2, 2, 11, 4
    keys = mx.array(rng.standard_normal((B, H, S, head_dim)).astype(np.float32))
    values = mx.array(rng.standard_normal((B, H, S, head_dim)).astype(np.float32))
    pads = mx.array([0, 3], mx.int32) if left_padded else None
    dense = ks.DenseKV(keys, values, pads, length=S, appended=L)  # a verify of L tokens
    state = ks.quantize(
        dense, key_bits=key_bits, value_bits=value_bits, group_size=32, rotation=rotation,
        seed=4, exact_latest=exact_latest,
    )  # fmt: skip
    assert state.tail_keys.shape[2] == min(S, exact_latest + L)
    queries = mx.array(rng.standard_normal((B, q_heads, L, head_dim)).astype(np.float32))
    if mask == "bool":
        mask = mx.array(rng.random((B, 1, L, S)) > 0.3) | (mx.arange(S) == S - 1)
    scale = head_dim**-0.5
    out = ks.quantized_attention(queries, state, scale=scale, mask=mask)
    expected = mixed_reference(queries, keys, values, state, scale, mask)
    np.testing.assert_allclose(f64(out), expected, atol=2e-4)
    if exact_latest < S:  # the quantized keys are read too: reading all raw differs
        all_raw = mixed_reference(
            queries, keys, values, ks.quantize(dense, exact_latest=S), scale, mask
        )
        assert np.abs(expected - all_raw).max() > 1e-2


# --- a wrapped model against mlx-lm's model under the same rule ------------------------------

OPTIONS = {"key_bits": 4, "value_bits": 3, "group_size": 32, "rotation": "hadamard", "seed": 3}
R = 4


def oracle_attention(queries, keys, values, cache, scale, mask, sinks=None):
    """mlx-lm's attention over its dense KVCache (all positions [0, T)), each pair read raw
    or through the codec by the exact-tail rule."""
    T, L = keys.shape[2], queries.shape[2]
    pad = -keys.shape[-1] % OPTIONS["group_size"]
    codecs = [
        Codec(b, OPTIONS["group_size"], pad, OPTIONS["rotation"], OPTIONS["seed"]) for b in (4, 3)
    ]
    k_q, v_q = (c.decode(c.encode(x)) for c, x in zip(codecs, (keys, values), strict=True))
    repeats = queries.shape[1] // keys.shape[1]
    k, v, k_q, v_q = (mx.repeat(x, repeats, 1) for x in (keys, values, k_q, v_q))
    t_q, t_k = mx.arange(T - L, T)[:, None], mx.arange(T)[None]
    exact = t_k > t_q - R
    q = queries * scale
    scores = mx.where(exact, q @ k.swapaxes(-1, -2), q @ k_q.swapaxes(-1, -2))
    allowed = (t_k <= t_q) if not isinstance(mask, mx.array) else mask
    weights = mx.softmax(mx.where(allowed, scores, -1e30), axis=-1, precise=True)
    return (weights * exact) @ v + (weights * ~exact) @ v_q


MODULES = {"llama": llama, "gemma3_text": gemma3_text}


def oracle_logits(monkeypatch, name: str, chunks: list[list[int]]) -> list[np.ndarray]:
    """A fresh tiny model (the same weights; a wrapped one reads its attention through
    kvstate's routing, which a module patch does not reach) over `chunks`, every layer on a
    plain KVCache of the whole history (a sliding layer's window is then its mask's)."""
    model = tiny_model(name)
    caches = [KVCache() for _ in model.layers]
    with monkeypatch.context() as patch:
        patch.setattr(MODULES[name], "scaled_dot_product_attention", oracle_attention)
        return [np.array(model(mx.array([c]), cache=caches)[0]) for c in chunks]


PROMPT = [3, 17, 42, 99, 7, 250, 31, 8, 1, 2, 60, 61, 62, 5]


@pytest.mark.parametrize("name", ["llama", "gemma3_text"])
@pytest.mark.parametrize("sizes", [[14], [5, 3, 1, 1, 4], [1] * 14])
def test_a_wrapped_model_reads_like_mlx_lm_under_the_rule(monkeypatch, name, sizes):
    """Prefill in chunks of `sizes`, then 6 greedy steps: every forward's logits equal the
    oracle's (which read the same positions raw), whatever the chunking. gemma3_text's
    windows of 8 wrap: their latest R come from the exact ring."""
    model = tiny_model(name)
    m = wrap(model)
    state = ks.quantize(m.init_state(), exact_latest=R, **OPTIONS)
    chunks, start = [], 0
    for n in sizes:
        chunks.append(PROMPT[start : start + n])
        start += n
    got = []
    for c in chunks:
        logits, state = m(mx.array([c]), state)
        got.append(np.array(logits[0]))
    for _ in range(6):
        chunks.append([int(np.argmax(got[-1][-1]))])
        logits, state = m(mx.array([chunks[-1]]), state)
        got.append(np.array(logits[0]))
    expected = oracle_logits(monkeypatch, name, chunks)
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_allclose(g, e, atol=2e-4, rtol=1e-4)
    for layer in state.layers:
        if isinstance(layer, ks.QuantizedKV):
            assert layer.tail_keys.shape[2] == R + 1
        else:
            assert isinstance(layer, ks.QuantizedRotatingKV) and layer.exact.max_size == R
    # Not vacuous: without the tail the same tokens read other logits.
    plain = ks.quantize(m.init_state(), **OPTIONS)
    logits, _ = m(mx.array([[t for c in chunks for t in c]]), plain)
    assert np.abs(np.array(logits[0, -1]) - expected[-1][-1]).max() > 1e-3


@pytest.mark.parametrize("name", ["llama", "gemma3_text"])
def test_a_right_padded_prompt_batch_reads_each_row_like_the_row_alone(name):
    """Rows of 14, 9 and 3 tokens prefilled as one right-padded batch (mlx-lm's prepare /
    finalize roll each row's tail with its buffers, and each window's ring), then three
    decode steps."""
    model = tiny_model(name)
    m = wrap(model)
    prompts = [PROMPT, PROMPT[:9], PROMPT[5:8]]
    width = max(len(p) for p in prompts)
    tokens = mx.array([p + [0] * (width - len(p)) for p in prompts])
    state = ks.quantize(m.init_state(len(prompts)), exact_latest=R, **OPTIONS)
    logits, state = m(tokens, state, lengths=[len(p) for p in prompts])
    batch = [[np.array(logits[b, len(p) - 1])] for b, p in enumerate(prompts)]
    nexts = [40, 41, 42]
    for t in nexts:
        logits, state = m(mx.array([[t]] * len(prompts)), state)
        for b in range(len(prompts)):
            batch[b].append(np.array(logits[b, -1]))
    for b, p in enumerate(prompts):
        logits, alone = m(mx.array([p]), ks.quantize(m.init_state(), exact_latest=R, **OPTIONS))
        rows = [np.array(logits[0, -1])]
        for t in nexts:
            logits, alone = m(mx.array([[t]]), alone)
            rows.append(np.array(logits[0, -1]))
        np.testing.assert_allclose(np.stack(batch[b]), np.stack(rows), atol=2e-4, rtol=1e-4)


# --- the state: files, refusals, mlx-lm's form ------------------------------------------------


def _filled(exact_latest: int = R) -> ks.QuantizedKV:
    rng = np.random.default_rng(1)
    k = mx.array(rng.standard_normal((2, 2, 9, 32)).astype(np.float32))
    dense = ks.DenseKV(k, k * 2, mx.array([0, 2], mx.int32), length=9, appended=3)
    return ks.quantize(dense, exact_latest=exact_latest, **OPTIONS)


def test_a_tail_survives_save_and_load(tmp_path):
    state = _filled()
    path = str(tmp_path / "tail.safetensors")
    ks.save(path, state)
    loaded = ks.load(path)
    ks.testing.assert_states_equal(loaded, state)
    assert loaded.exact_latest == R and loaded.tail_keys.shape == (2, 2, R + 3, 32)


def test_files_written_before_the_tail_load_without_one(tmp_path):
    import hashlib
    import json

    state = _filled(0)
    path = str(tmp_path / "old.safetensors")
    ks.save(path, state)
    tensors, header = mx.load(path, return_metadata=True)
    doc = json.loads(header["kvstate.body"])
    del doc["tree"]["statics"]["exact_latest"]
    for child in ("tail_keys", "tail_values"):
        del doc["tree"]["children"][child]
    header["kvstate.body"] = json.dumps(doc)
    header["kvstate.sha256"] = hashlib.sha256(header["kvstate.body"].encode()).hexdigest()
    mx.save_safetensors(path, tensors, header)
    ks.testing.assert_states_equal(ks.load(path), state)


def test_a_tail_is_never_mlx_lm_form_and_bad_tails_are_named():
    from kvstate.adapters import to_mlx_lm
    from kvstate.adapters.caches.quantized_cache import QuantizedStateCache

    plain = ks.DenseKV(mx.zeros((1, 1, 4, 32)), mx.zeros((1, 1, 4, 32)), length=4)
    cache = to_mlx_lm(ks.quantize(plain, bits=4, group_size=32, exact_latest=2))
    assert isinstance(cache, QuantizedStateCache)
    state = _filled()
    with pytest.raises(ks.StateError, match="tail_keys"):
        ks.check(ks.kinds.replace(state, tail_keys=state.tail_keys[:, :1]))
    with pytest.raises(ks.StateError, match="exact_latest=4 needs a tail"):
        ks.check(ks.kinds.replace(state, tail_values=None))
    with pytest.raises(ks.StateError, match="only a state with exact_latest > 0"):
        ks.check(ks.kinds.replace(state, exact_latest=0))
    with pytest.raises(ks.ConfigMismatchError, match="exact_latest"):
        ks.quantize(plain, exact_latest=-1)
    with pytest.raises(ks.ConfigMismatchError, match="exact_latest"):
        ks.merge([_filled(), _filled(2)])
    m = wrap(tiny_model("gemma3_text"))
    _, filled = m(mx.array([PROMPT]), m.init_state())
    with pytest.raises(ks.NotSupportedError, match="already holds tokens"):
        ks.quantize(filled, exact_latest=2)  # a window's ring starts empty
    ring = ks.quantize(m.init_state(), exact_latest=2).layers[0]
    with pytest.raises(ks.StateError, match="exact: max_size"):
        ks.check(ks.kinds.replace(ring, exact=ks.kinds.replace(ring.exact, max_size=3)))
    with pytest.raises(ks.StateError, match="exact: only a state"):
        ks.check(ks.kinds.replace(ring, exact_latest=0))


def test_mlx_vlm_caches_refuse_a_tail_they_cannot_hold():
    pytest.importorskip("mlx_vlm")
    from kvstate.adapters.vlm import to_mlx_vlm

    plain = ks.DenseKV(mx.zeros((2, 1, 4, 32)), mx.zeros((2, 1, 4, 32)), mx.array([0, 1]), length=4)
    for state in (
        ks.quantize(plain, bits=4, group_size=32, exact_latest=2),  # left-padded: the batch class
        ks.extract(ks.quantize(plain, bits=4, group_size=32, exact_latest=2), 0),
    ):
        with pytest.raises(ks.NotSupportedError):
            to_mlx_vlm(ks.ModelState((state,)))


# --- sliding windows: the exact ring through verifies, rollbacks and rows --------------------


def _gemma() -> tuple[Any, Any]:
    return tiny_model("gemma3_text"), wrap(tiny_model("gemma3_text"))


def _exact_state(m: Any, batch: int = 1) -> Any:
    return ks.quantize(m.init_state(batch), exact_latest=R, **OPTIONS)


def _ids(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 256, n).tolist()


@pytest.mark.parametrize("accepted", [0, 1, 3, 5])
def test_a_verify_across_the_wrap_rolls_the_ring_back_exactly(monkeypatch, accepted):
    """A 12-token prompt and 4 steps (window 8 wrapped), a 5-token verify, commit_prefix
    (accepted), 4 more steps: the verify's accepted logits and the steps' are the oracle's
    over the accepted tokens only."""
    _, m = _gemma()
    prompt, steps, draft, after = _ids(2, 12), _ids(3, 4), _ids(4, 5), _ids(5, 4)
    _, state = m(mx.array([prompt]), _exact_state(m))
    for t in steps:
        _, state = m(mx.array([[t]]), state)
    verify, verified = m(mx.array([draft]), state)
    state = ks.commit_prefix(verified, accepted)
    ks.check(state)
    got = [np.array(verify[0, :accepted])]
    for t in after:
        logits, state = m(mx.array([[t]]), state)
        got.append(np.array(logits[0]))
    chunks = [prompt, *([t] for t in steps), draft[:accepted] or [], *([t] for t in after)]
    want = oracle_logits(monkeypatch, "gemma3_text", [c for c in chunks if c])
    want = want[1 + len(steps) :] if accepted else [np.zeros((0, VOCAB)), *want[1 + len(steps) :]]
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, atol=2e-4, rtol=1e-4)


def test_ragged_rows_of_windows_roll_back_like_each_row_alone(monkeypatch, tmp_path):
    """Rows prefilled apart (12 tokens, and 2: fewer than the ring's R), merged,
    decoded across the wrap, verified 4 and committed ragged (3 and 1), decoded again; then
    saved, loaded and split: each row reads as the oracle over its own tokens."""
    _, m = _gemma()
    prompts, steps = [_ids(6, 12), _ids(7, 2)], [_ids(8, 5), _ids(9, 5)]
    drafts, after, counts = [_ids(10, 4), _ids(11, 4)], [_ids(12, 3), _ids(13, 3)], [3, 1]
    state = ks.merge([m(mx.array([p]), _exact_state(m))[1] for p in prompts])
    got, state = two_rows_through_a_ragged_commit(m, state, steps, drafts, counts, after)
    for r in range(2):
        chunks = [prompts[r], *([t] for t in steps[r]), drafts[r][: counts[r]],
                  *([t] for t in after[r])]  # fmt: skip
        want = oracle_logits(monkeypatch, "gemma3_text", chunks)
        want = want[1 : 1 + 5] + want[-3:]
        for j, (g, w) in enumerate(zip(got[r], want, strict=True)):
            np.testing.assert_allclose(g, w, atol=2e-4, rtol=1e-4, err_msg=f"row {r} step {j}")
        # the state as a file, then the row alone: the next token reads as the oracle's
        ks.save(tmp_path / f"ring-{r}.safetensors", state)
        row = ks.extract(ks.load(tmp_path / f"ring-{r}.safetensors"), r)
        logits, _ = m(mx.array([[7]]), row)
        want_next = oracle_logits(monkeypatch, "gemma3_text", [*chunks, [7]])[-1]
        np.testing.assert_allclose(np.array(logits[0]), want_next, atol=2e-4, rtol=1e-4)


def test_speculation_on_exact_windows_is_the_plain_decode():
    """generate with a scripted drafter (half its drafts right) over a quantized Gemma-style
    state with exact rings and tails, batch 1 and a ragged batch: the tokens and
    log-probabilities of the same state decoded one token at a time, row by row."""
    from tests.test_quantized_speculative import NEW, QuantizedTarget, plain_decode, speculate

    target = QuantizedTarget(
        wrap(tiny_model("gemma3_text", head_dim=32)), {**OPTIONS, "exact_latest": R}
    )
    prompts = [[3, 17, 42, 99, 7, 250, 31, 8, 1, 2, 60], [5, 6, 7], [9, 8, 7, 6, 5]]
    plain = [plain_decode(target, p, NEW + 9) for p in prompts]
    for k in (2, 4):
        tokens, logprobs, drafted = speculate(target, prompts, [t for t, _ in plain], k)
        assert drafted > 0
        for got, lp, (want, want_lp) in zip(tokens, logprobs, plain, strict=True):
            assert got == want[:NEW]
            np.testing.assert_allclose(lp, want_lp[:NEW], atol=1e-4)


def test_window_files_written_before_the_ring_load_without_one(tmp_path):
    import hashlib
    import json

    _, m = _gemma()
    _, state = m(mx.array([PROMPT]), ks.quantize(m.init_state(), **OPTIONS))
    path = str(tmp_path / "old-window.safetensors")
    ks.save(path, state)
    tensors, header = mx.load(path, return_metadata=True)
    doc = json.loads(header["kvstate.body"])
    windows = [n for n in doc["tree"]["children"]["layers"]["tuple"] if "exact" in n["children"]]
    assert len(windows) == 2
    for node in windows:
        for n in (node, node["children"]["previous"]):
            if n is not None:
                del n["statics"]["exact_latest"], n["children"]["exact"]
    header["kvstate.body"] = json.dumps(doc)
    header["kvstate.sha256"] = hashlib.sha256(header["kvstate.body"].encode()).hexdigest()
    mx.save_safetensors(path, tensors, header)
    ks.testing.assert_states_equal(ks.load(path), state)
