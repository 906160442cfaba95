"""kvstate.serve's parts without HTTP: the byte tokenizer, the text stream (whole
characters, stop strings), request parsing, chat prompts, the engine thread, metrics."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

pytest.importorskip("starlette")

from kvstate import StateError
from kvstate.adapters.tiny_models import VOCAB, byte_tokenizer
from kvstate.serve.engine import Output, Request, RequestParams
from kvstate.serve.errors import BadRequest
from kvstate.serve.loop import EngineLoop, Failure, Sink
from kvstate.serve.metrics import hit_rate, prometheus_text
from kvstate.serve.prompts import chat_ids, fallback_text
from kvstate.serve.protocol import ModelFacts, parse_chat, parse_completion
from kvstate.serve.text import TextStream

TOKENIZER = byte_tokenizer()
FACTS = ModelFacts(TOKENIZER, VOCAB, 64, eos_ids=(3,), default_max_tokens=32)
TEXT = "naïve café, 東京 and € signs: ok"


def test_byte_tokenizer_ids_are_the_bytes():
    assert len(TOKENIZER) == VOCAB == 256 and not TOKENIZER.eos_token_ids
    assert TOKENIZER.encode(TEXT) == list(TEXT.encode())
    assert TOKENIZER.decode(list(TEXT.encode())) == TEXT
    assert len(set(TOKENIZER.convert_ids_to_tokens(list(range(256))))) == 256
    assert not TOKENIZER.has_chat_template


@pytest.mark.parametrize("per_feed", [1, 2, 3, 7])
def test_text_stream_never_splits_a_character(per_feed):
    ids = list(TEXT.encode())
    text = TextStream(TOKENIZER, (), frozenset())
    deltas = [
        text.feed(tuple(ids[i : i + per_feed]), None).text for i in range(0, len(ids), per_feed)
    ]
    deltas.append(text.finish().text)
    assert "".join(deltas) == TEXT == text.text
    assert all("\ufffd" not in d for d in deltas)  # a split character decodes to U+FFFD
    assert text.tokens == ids


def feed_bytes(stream: TextStream, text: str) -> list[str]:
    return [stream.feed((b,), None).text for b in text.encode()]


def test_stop_string_ends_the_reply_before_it():
    stream = TextStream(TOKENIZER, ("STOP", "never"), frozenset())
    deltas = feed_bytes(stream, "abc STOP def")
    assert stream.stopped and stream.text == "abc " == "".join(deltas)
    assert stream.tokens == list(b"abc STOP")  # the token completing it counts, none after
    assert stream.finish().text == ""


def test_text_that_may_begin_a_stop_string_is_held_back_until_decided():
    stream = TextStream(TOKENIZER, ("help",), frozenset())
    assert feed_bytes(stream, "hel") == ["", "", ""]  # 'h', 'he', 'hel' could begin "help"
    assert stream.feed(tuple(b"lo"), None).text == "hello"  # 'hell' begins it; 'hello' not
    # mlx-lm's BPE detokenizer holds a lone space until the next token: " " comes with "h",
    # which is held back itself.
    assert feed_bytes(stream, " he") == ["", " ", ""]
    assert stream.finish().text == "he"  # the end releases what was held
    assert not stream.stopped and stream.text == "hello he"


def test_stop_string_across_a_multibyte_character():
    stream = TextStream(TOKENIZER, ("€!",), frozenset())
    deltas = feed_bytes(stream, "a€b €! c")
    assert stream.text == "a€b " and stream.stopped and "\ufffd" not in "".join(deltas)


def test_hidden_ids_count_but_have_no_text():
    stream = TextStream(TOKENIZER, (), frozenset({3}))
    delta = stream.feed((104, 105, 3), (-1.0, -2.0, -3.0))
    assert delta.tokens == (104, 105, 3) and delta.logprobs == (-1.0, -2.0, -3.0)
    assert stream.text + stream.finish().text == "hi"


def test_completion_fields_become_engine_params():
    job = parse_completion(
        {"model": "m", "prompt": ["ab", [5, 6]], "n": 2, "max_tokens": 7.0, "temperature": 0.5,
         "top_p": 0.9, "top_k": -1, "seed": -1, "stop": "x", "stop_token_ids": [9],
         "logprobs": 0, "presence_penalty": 0, "user": "u", "echo": False, "suffix": None},
        FACTS,
    )  # fmt: skip
    assert job.prompts == ((97, 98), (5, 6)) and job.n == 2 and not job.chat
    p = job.params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k) == (7, 0.5, 0.9, 0)
    assert p.stop_ids == (3, 9) and job.hidden_ids == {3, 9} and job.stop == ("x",)
    assert p.logprobs and job.logprobs
    choices = job.choices()
    assert [(i, prompt) for i, prompt, _ in choices] == [
        (0, (97, 98)), (1, (97, 98)), (2, (5, 6)), (3, (5, 6))
    ]  # fmt: skip
    assert [c[2].seed for c in choices] == [2**64 - 1, 0, 1, 2]  # seed -1 wraps; then +index
    defaults = parse_completion({"prompt": "a", "ignore_eos": True}, FACTS)
    assert defaults.params.max_tokens == 32 and defaults.params.stop_ids == ()
    assert defaults.params.seed is None and not defaults.stream


def test_chat_fields_become_engine_params():
    body = {"messages": [{"role": "user", "content": "hi", "name": "me"}], "max_tokens": 4,
            "max_completion_tokens": 9, "logprobs": True, "top_logprobs": 0, "stream": True,
            "stream_options": {"include_usage": True}, "response_format": {"type": "text"},
            "tools": [], "tool_choice": "none"}  # fmt: skip
    job = parse_chat(body, FACTS)
    assert job.chat and job.params.max_tokens == 9 and job.logprobs and job.include_usage
    assert job.prompts == (tuple(fallback_text([{"role": "user", "content": "hi"}]).encode()),)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "a", "temperature": float("nan")}, "temperature"),
        ({"prompt": "a", "frequency_penalty": 1}, "frequency_penalty"),
        ({"prompt": "a", "logit_bias": {"1": 2}}, "logit_bias"),
        ({"prompt": "a", "best_of": 2}, "best_of"),
        ({"prompt": "a", "echo": True}, "echo"),
        ({"prompt": "a", "suffix": "z"}, "suffix"),
        ({"prompt": "a", "stream": True, "stream_options": {"other": 1}}, "stream_options"),
        ({"prompt": [[1], "b", 3]}, "prompt"),
        ({"prompt": [0] * 65}, "prompt"),  # FACTS' model takes 64
    ],
)
def test_completion_refusals_name_the_field(body, param):
    with pytest.raises(BadRequest) as caught:
        parse_completion(body, FACTS)
    assert caught.value.param == param and caught.value.status == 400


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"logprobs": 1}, "logprobs"),
        ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ],
)
def test_chat_refusals_name_the_field(extra, param):
    with pytest.raises(BadRequest) as caught:
        parse_chat({"messages": [{"role": "user", "content": "x"}], **extra}, FACTS)
    assert caught.value.param == param


def templated_tokenizer() -> Any:
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, TokenizerWrapper

    hf = byte_tokenizer()._tokenizer  # a fresh one: the template stays on it
    hf.chat_template = (
        "{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system') }}"
        "{% endif %}<{{ m.role }}>{{ m.content }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    return TokenizerWrapper(hf, BPEStreamingDetokenizer)


def test_chat_template_is_the_tokenizers_own_and_its_refusal_a_400():
    tokenizer = templated_tokenizer()
    assert tokenizer.has_chat_template
    ids = chat_ids(tokenizer, [{"role": "user", "content": "hi"}])
    assert bytes(ids).decode() == "<user>hi<assistant>"
    with pytest.raises(BadRequest) as caught:
        chat_ids(tokenizer, [{"role": "system", "content": "x"}])
    assert caught.value.param == "messages" and "no system" in caught.value.message
    assert fallback_text([{"role": "user", "content": "hi"}]) == "user: hi\nassistant:"


class FlakyEngine:
    """An engine whose step raises when a request asks for 13 tokens (a stand-in for a
    bug), and otherwise emits one token 7 per step."""

    vocab_size, max_prompt_tokens = 16, None

    def __init__(self) -> None:
        self.requests: list[Request] = []

    def submit(self, prompt: Any, params: RequestParams | None = None) -> Request:
        params = params or RequestParams()
        if len(prompt) > 4:
            raise StateError("prompt too long for FlakyEngine")
        request = Request(len(self.requests), tuple(prompt), params)
        self.requests.append(request)
        return request

    def cancel(self, request: Request) -> None:
        request.cancel_requested = True

    def has_work(self) -> bool:
        return any(not r.finished for r in self.requests)

    def step(self) -> list[Output]:
        out = []
        for r in self.requests:
            if r.finished:
                continue
            if r.params.max_tokens == 13:
                raise RuntimeError("a broken round")
            if r.cancel_requested:
                r.finished, r.finish_reason = True, "cancelled"
                out.append(Output(r, (), None, True, "cancelled"))
                continue
            r.tokens.append(7)
            r.finished = len(r.tokens) >= r.params.max_tokens
            r.finish_reason = "length" if r.finished else None
            out.append(Output(r, (7,), None, r.finished, r.finish_reason))
        return out

    def stats(self) -> dict[str, Any]:
        return {"running": sum(not r.finished for r in self.requests), "queued": 0}


async def drain(sink: Sink) -> list[Any]:
    """Everything the sink gets until its request finishes or fails."""
    items: list[Any] = []
    while True:
        item = await asyncio.wait_for(sink.queue.get(), 10)
        items.append(item)
        if isinstance(item, Failure) or any(out.finished for _, out in item):
            return items


def test_engine_thread_survives_a_failed_step_and_a_refused_submit():
    engines: list[FlakyEngine] = []

    def make() -> FlakyEngine:
        engines.append(FlakyEngine())
        return engines[-1]

    async def scenario() -> None:
        loop = EngineLoop(make)  # type: ignore[arg-type]
        loop.start()
        try:
            with pytest.raises(StateError):
                await loop.submit((1, 2, 3, 4, 5), RequestParams(), Sink(), 0)
            sink = Sink()
            await loop.submit((1,), RequestParams(max_tokens=3), sink, 4)
            items = await drain(sink)
            assert [(i, out.tokens) for item in items for i, out in item] == [(4, (7,))] * 3
            bad = Sink()
            await loop.submit((1,), RequestParams(max_tokens=13), bad, 0)
            (failure,) = await drain(bad)
            assert isinstance(failure, Failure) and "a broken round" in failure.message
            assert len(engines) == 2 and loop.stats()["engine_failures"] == 1
            sink = Sink()
            await loop.submit((2,), RequestParams(max_tokens=2), sink, 0)  # the new engine
            assert sum(len(item) for item in await drain(sink)) == 2
            assert loop.alive
        finally:
            loop.stop()
        assert not loop.alive

    asyncio.run(scenario())


def test_a_submit_whose_waiter_left_is_cancelled():
    engine = FlakyEngine()

    async def scenario() -> None:
        loop = EngineLoop(lambda: engine)  # type: ignore[arg-type, return-value]
        waiter = asyncio.ensure_future(
            loop.submit((1,), RequestParams(max_tokens=10**6), Sink(), 0)
        )
        await asyncio.sleep(0)
        waiter.cancel()  # the client left before the engine thread took the request
        loop.start()
        try:
            for _ in range(200):
                await asyncio.sleep(0.01)
                if engine.requests and engine.requests[0].finished:
                    break
            (request,) = engine.requests
            assert request.finish_reason == "cancelled" and len(request.tokens) < 10**6
        finally:
            loop.stop()

    asyncio.run(scenario())


def test_metrics():
    stats = {"running": 2, "queued": 1, "tokens_per_s": 12.5, "prefix_hits": 3,
             "prefix_misses": 1, "note": "text is left out"}  # fmt: skip
    assert hit_rate(stats) == 0.75 and hit_rate({}) == 0.0
    text = prometheus_text(stats, {"completed": 4})
    assert "kvstate_running 2\n" in text and "kvstate_prefix_hit_rate 0.75\n" in text
    assert 'kvstate_requests_total{outcome="completed"} 4' in text and "note" not in text


def test_nothing_imports_the_server():
    """The server is the top floor (DESIGN.md): no module of the library imports it."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    serve = root / "kvstate" / "serve"
    found = []
    for path in [*(root / "kvstate").rglob("*.py"), *(root / "adapters").rglob("*.py")]:
        if serve in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            if any(n == "kvstate.serve" or n.startswith("kvstate.serve.") for n in names):
                found.append(f"{path.relative_to(root)}:{node.lineno}")
    assert not found, found
