"""Quantized sliding windows (QuantizedRotatingKV, issue 22 item 4) on a tiny gemma3_text
(window 8, sliding and global layers), every layer quantized by `kvstate.quantize`.

Oracle: mlx-lm's own model on mlx-lm's own caches (RotatingKVCache, KVCache), run without
kvstate, whose every update stores the new keys and values quantized and dequantized by
the state's codec (`fake_quantized`): a window that holds, slot for slot, the dequantized
values of the quantized one, read by mlx-lm's fp attention (`mx.fast.scaled_dot_product_
attention`) under mlx-lm's masks. kvstate's side stores packed words and reads them through
`kvstate.quantized_attention`; a speculative verify is rolled back by `commit_prefix` and the
oracle is the un-speculated decode of the accepted tokens. Tokens are teacher-forced
(random-init models repeat a token under greedy), logits compared at every step.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import MethodType
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

import kvstate as ks
import kvstate.testing
from kvstate.adapters import from_mlx_lm, to_mlx_lm, wrap
from kvstate.adapters.caches.quantized_rotating import QuantizedRotatingCache
from kvstate.adapters.tiny_models import VOCAB, tiny_model
from kvstate.quantization import Codec, channel_pad, dequantized
from kvstate.speculative import NGramDrafter, generate
from tests.helpers import two_rows_through_a_ragged_commit

WINDOW = 8  # the tiny gemma3_text's sliding window (head dim 32: one group of 32, no pad)
OPTIONS: dict[str, dict[str, Any]] = {
    "K8/V8": {"bits": 8, "group_size": 32},
    "K4/V3 hadamard": {"key_bits": 4, "value_bits": 3, "group_size": 32, "rotation": "hadamard"},
    "K5/V4 so4": {"key_bits": 5, "value_bits": 4, "group_size": 64, "rotation": "so4", "seed": 3},
}
ATOL = 2e-3


@pytest.fixture(scope="module")
def model() -> Any:
    return tiny_model("gemma3_text", head_dim=32)


def codecs(options: dict[str, Any], key_dim: int, value_dim: int) -> tuple[Codec, Codec]:
    group = options.get("group_size", 64)
    bits = options.get("bits", 8)
    kb, vb = options.get("key_bits", bits), options.get("value_bits", bits)
    rotation, seed = options.get("rotation", "none"), options.get("seed", 0)
    return (
        Codec(kb, group, channel_pad(key_dim, group), rotation, seed),
        Codec(vb, group, channel_pad(value_dim, group), rotation, seed),
    )


def fake_quantized(cache: Any, options: dict[str, Any]) -> Any:
    """mlx-lm's `cache`, storing every update's keys and values quantized-and-dequantized."""
    update = cache.update_and_fetch

    def update_and_fetch(self: Any, keys: mx.array, values: mx.array) -> Any:
        kc, vc = codecs(options, int(keys.shape[-1]), int(values.shape[-1]))
        return update(kc.decode(kc.encode(keys)), vc.decode(vc.encode(values)))

    cache.update_and_fetch = MethodType(update_and_fetch, cache)
    return cache


def oracle(model: Any, chunks: Sequence[Sequence[int]], options: dict[str, Any]) -> list[Any]:
    """mlx-lm's logits (1, len, V) for each chunk fed in turn, on fake-quantized caches;
    and the caches last."""
    caches = [fake_quantized(c, options) for c in model.make_cache()]
    out = [np.array(model(mx.array([list(c)]), cache=caches)) for c in chunks]
    return [*out, caches]


def ids(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, VOCAB, n).tolist()


def quantized_state(m: Any, options: dict[str, Any], batch: int = 1) -> Any:
    state = ks.quantize(m.init_state(batch), **options)
    kinds = [type(layer).__name__ for layer in state.layers]
    assert kinds == ["QuantizedRotatingKV", "QuantizedKV"] * 2, kinds
    return state


@pytest.mark.parametrize("name", list(OPTIONS))
def test_prefill_and_decode_across_the_wrap_are_mlx_lms_on_the_dequantized_window(model, name):
    """Prompt chunks of 5 and 7 (the second trims the window), then 10 single tokens (the ring
    wraps): logits at every position, and the windows slot for slot."""
    options = OPTIONS[name]
    m = wrap(model)
    prompt, steps = ids(0, 12), ids(1, 10)
    chunks = [prompt[:5], prompt[5:], *([t] for t in steps)]
    want = oracle(model, chunks, options)
    state = quantized_state(m, options)
    for i, chunk in enumerate(chunks):
        logits, state = m(mx.array([chunk]), state)
        np.testing.assert_allclose(np.array(logits), want[i], atol=ATOL, rtol=ATOL, err_msg=str(i))
        for layer, cache in zip(state.layers[::2], want[-1][::2], strict=True):
            if i == len(chunks) - 1:  # the windows, dequantized, are mlx-lm's
                np.testing.assert_allclose(
                    np.array(dequantized(layer).keys), np.array(from_mlx_lm(cache).keys), atol=1e-5
                )
    window = state.layers[0]
    assert window.offset == 22 and window.index < WINDOW, "the ring wrapped"
    ks.check(state)


@pytest.mark.parametrize("name", list(OPTIONS))
@pytest.mark.parametrize("accepted", [0, 1, 3, 5])
def test_a_verify_across_the_wrap_rolls_back_exactly(model, name, accepted):
    """After a 12-token prompt and 4 steps (offset 16, a wrapped ring), a 5-token verify
    pushes window entries out; commit_prefix(accepted) gives back the window of the
    un-speculated decode: its verify logits and the next 5 steps' are the oracle's."""
    options = OPTIONS[name]
    m = wrap(model)
    prompt, steps, draft, after = ids(2, 12), ids(3, 4), ids(4, 5), ids(5, 5)
    state = quantized_state(m, options)
    _, state = m(mx.array([prompt]), state)
    for t in steps:
        _, state = m(mx.array([[t]]), state)
    before = state
    verify_logits, verified = m(mx.array([draft]), state)
    committed = ks.commit_prefix(verified, accepted)
    ks.check(committed)
    chunks = [
        prompt,
        *([t] for t in steps),
        *([t] for t in draft[:accepted]),
        *([t] for t in after),
    ]
    want = oracle(model, chunks, options)
    drafted = np.concatenate(
        want[1 + len(steps) : 1 + len(steps) + accepted] or [np.zeros((1, 0, VOCAB))], 1
    )
    np.testing.assert_allclose(np.array(verify_logits[:, :accepted]), drafted, atol=ATOL, rtol=ATOL)
    for j, t in enumerate(after):
        logits, committed = m(mx.array([[t]]), committed)
        np.testing.assert_allclose(
            np.array(logits), want[-len(after) - 1 + j], atol=ATOL, rtol=ATOL
        )
    # Nothing was changed in place: the state before the verify still decodes as it did.
    first = m(mx.array([[draft[0]]]), before)[0]
    np.testing.assert_allclose(
        np.array(first), np.array(verify_logits[:, :1]), atol=ATOL, rtol=ATOL
    )


@pytest.mark.parametrize("name", ["K4/V3 hadamard"])
def test_ragged_rows_decode_and_roll_back_like_each_row_alone(model, name):
    """Two rows prefilled apart (12 and 7 tokens), merged (left padding), decoded across the
    wrap, verified 4 tokens and committed ragged (3 and 1), then decoded: each row's logits
    are those of the row served alone by the oracle."""
    options = OPTIONS[name]
    m = wrap(model)
    prompts = [ids(6, 12), ids(7, 7)]
    steps = [ids(8, 5), ids(9, 5)]
    drafts = [ids(10, 4), ids(11, 4)]
    after = [ids(12, 4), ids(13, 4)]
    counts = [3, 1]
    rows = []
    for p in prompts:
        _, s = m(mx.array([p]), quantized_state(m, options))
        rows.append(s)
    state = ks.merge(rows)
    assert state.layers[0].left_padding is not None
    got, _ = two_rows_through_a_ragged_commit(m, state, steps, drafts, counts, after)
    for r in range(2):
        chunks = [prompts[r], *([t] for t in steps[r]), *([t] for t in drafts[r][: counts[r]]),
                  *([t] for t in after[r])]  # fmt: skip
        want = oracle(model, chunks, options)[1:-1]
        want = want[:5] + want[5 + counts[r] :]
        for j, (g, w) in enumerate(zip(got[r], want, strict=True)):
            np.testing.assert_allclose(g, w[0], atol=ATOL, rtol=ATOL, err_msg=f"row {r} step {j}")


def test_the_caches_a_model_reads_are_kvstates_own(model):
    m = wrap(model)
    state = quantized_state(m, OPTIONS["K8/V8"])
    _, state = m(mx.array([ids(14, 10)]), state)
    caches = to_mlx_lm(state)
    assert type(caches[0]) is QuantizedRotatingCache
    with pytest.raises(ks.StateError, match="route_attention"):
        _ = caches[0].bits


def test_n_gram_speculation_on_every_layer_quantized_is_its_own_greedy(model):
    """generate with kv_bits (every layer, windows included, quantized from the prompt on):
    n-gram speculation gives the plain decode's tokens on the same quantized state, over
    rounds that wrap the window."""
    m = wrap(model)
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    options = {"kv_bits": 8, "kv_group_size": 32, "quantized_kv_start": 0}
    plain = generate(m, prompt, max_tokens=24, keep_states=True, **options)
    plain_tokens = [t.token for r in plain for t in r]
    kinds = {type(layer).__name__ for layer in plain.states[0].layers}
    assert kinds == {"QuantizedKV", "QuantizedRotatingKV"}
    spec = generate(m, prompt, NGramDrafter(), k=4, max_tokens=24, adaptive=False, **options)
    spec_tokens, drafted = [], 0
    for r in spec:
        for t in r:
            spec_tokens.append(t.token)
            drafted += t.from_draft
    assert spec_tokens == plain_tokens
    assert drafted > 0, "the n-gram drafter should have had drafts accepted"


def test_a_whole_quantized_gemma_state_saves_loads_and_splits_into_rows(model, tmp_path):
    """save/load of a merged, wrapped, every-layer-quantized state gives it back bit for bit;
    extract / row_select / tile rows of it decode as the row served alone."""
    options = OPTIONS["K5/V4 so4"]
    m = wrap(model)
    prompts = [ids(15, 11), ids(16, 6)]
    alone = [m(mx.array([p]), quantized_state(m, options))[1] for p in prompts]
    state = ks.merge(alone)
    path = tmp_path / "gemma.safetensors"
    ks.save(path, state)
    loaded = ks.load(path)
    ks.testing.assert_states_equal(ks.eval(loaded), ks.eval(state))
    token = [[ids(17, 1)[0]]]
    want = [np.array(m(mx.array(token), s)[0]) for s in alone]
    for r in range(2):
        for part in (ks.extract(loaded, r), ks.row_select(loaded, r)):
            got = np.array(m(mx.array(token), part)[0])
            np.testing.assert_allclose(got, want[r], atol=ATOL, rtol=ATOL)
    tiled = m(mx.array(token * 4), ks.tile(loaded, 2))[0]
    for r in range(4):
        np.testing.assert_allclose(np.array(tiled[r : r + 1]), want[r // 2], atol=ATOL, rtol=ATOL)


def test_a_right_padded_prompt_batch_is_each_row_alone(model):
    """wrap(..., lengths=) on a batched empty quantized window (mlx-lm's prepare / finalize on
    every lane): the prompt's last logits and the next step's are those of each row served
    alone, which the tests above check against mlx-lm."""
    options = OPTIONS["K4/V3 hadamard"]
    m = wrap(model)
    prompts = [ids(18, 12), ids(19, 7)]
    tokens = mx.array([prompts[0], prompts[1] + [0] * 5])
    logits, state = m(tokens, quantized_state(m, options, batch=2), lengths=[12, 7])
    assert state.layers[0].left_padding.tolist() == [0, 5]
    step = [[ids(20, 1)[0]], [ids(21, 1)[0]]]
    after, _ = m(mx.array(step), state)
    for r, p in enumerate(prompts):
        last, alone = m(mx.array([p]), quantized_state(m, options))
        np.testing.assert_allclose(
            np.array(logits[r, len(p) - 1]), np.array(last[0, -1]), atol=ATOL, rtol=ATOL
        )
        want, _ = m(mx.array([step[r]]), alone)
        np.testing.assert_allclose(np.array(after[r : r + 1]), np.array(want), atol=ATOL, rtol=ATOL)
