"""kvstate-serve as a real process on a loopback port, driven by the official `openai` client
(streaming and not) and by raw HTTP (bad requests, the event stream's bytes). The oracle
for every greedy reply is mlx-lm's own `generate_step` on the same prompt alone."""

from __future__ import annotations

import json
import re
import threading
import time
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from kvstate.adapters.tiny_models import byte_tokenizer, tiny_model  # noqa: E402
from kvstate.serve.cli import parser  # noqa: E402
from kvstate.serve.prompts import fallback_text  # noqa: E402
from tests.helpers import greedy_reference  # noqa: E402
from tests.serving import ROOT, Server, connection, get, post, sse_events, stream, wait_until  # noqa: E402

MODEL = "tiny:llama"
MAX_BATCH = 8  # below the 16 concurrent streams: some wait in the queue


@pytest.fixture(scope="module")
def server():
    s = Server("--model", MODEL, "--max-batch", str(MAX_BATCH), "--draft", "ngram",
               "--log-level", "warning")  # fmt: skip
    yield s
    log = s.stop()
    assert "Traceback" not in log, log  # no request crashed a handler or the engine thread


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def tokenizer():
    return byte_tokenizer()


def client(server: Server) -> Any:
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def token_ids(choice: Any) -> list[int]:
    return list(choice.model_extra["token_ids"])


def reference_text(tokenizer: Any, tokens: list[int]) -> str:
    d = tokenizer.detokenizer
    for t in tokens:
        d.add_token(t)
    d.finalize()
    return d.text


def status(server: Server) -> dict[str, Any]:
    code, body = get(server.port, "/v1/status")
    assert code == 200
    return body


def idle(s: dict[str, Any]) -> bool:
    return s["running"] == s["prefilling"] == s["queued"] == 0


def test_completion_equals_generate_step_streaming_or_not(server, model, tokenizer):
    c = client(server)
    prompt = "The quick brown fox"
    ids = tokenizer.encode(prompt)
    want = greedy_reference(model, ids, 20)
    whole = c.completions.create(
        model=MODEL, prompt=prompt, max_tokens=20, extra_body={"return_token_ids": True}
    )
    (choice,) = whole.choices
    assert token_ids(choice) == want
    assert choice.model_extra["prompt_token_ids"] == ids
    assert choice.finish_reason == "length"
    assert choice.text == reference_text(tokenizer, want)
    assert whole.usage.prompt_tokens == len(ids)
    assert whole.usage.completion_tokens == 20
    assert whole.usage.total_tokens == len(ids) + 20
    assert whole.model == MODEL and whole.object == "text_completion"

    chunks = list(
        c.completions.create(
            model=MODEL,
            prompt=ids,  # token ids work as a prompt too
            max_tokens=20,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"return_token_ids": True},
        )
    )
    *body, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 20
    assert [t for ch in body for t in token_ids(ch.choices[0])] == want
    assert "".join(ch.choices[0].text for ch in body) == choice.text
    assert [ch.choices[0].finish_reason for ch in body][-1] == "length"
    assert all(ch.choices[0].finish_reason is None for ch in body[:-1])
    assert len({ch.id for ch in chunks}) == 1


def test_chat_uses_the_fallback_template_and_equals_generate_step(server, model, tokenizer):
    c = client(server)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
    ]  # fmt: skip
    flat = [messages[0], {"role": "user", "content": "Hi there"}]
    ids = tokenizer.encode(fallback_text(flat))
    want = greedy_reference(model, ids, 12)
    reply = c.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, extra_body={"return_token_ids": True}
    )
    (choice,) = reply.choices
    assert token_ids(choice) == want
    assert choice.message.role == "assistant"
    assert choice.message.content == reference_text(tokenizer, want)
    assert reply.usage.prompt_tokens == len(ids) and reply.object == "chat.completion"

    chunks = list(
        c.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, stream=True)
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == choice.message.content
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)


def test_logprobs_are_the_chosen_tokens_under_the_target(server, model, tokenizer):
    c = client(server)
    ids = tokenizer.encode("logprobs, please")
    steps = list(generate_step(mx.array(ids), model, max_tokens=8))
    want_tokens = [int(t) for t, _ in steps]
    want = [float(lp[t].item()) for t, lp in zip(want_tokens, (lp for _, lp in steps), strict=True)]
    whole = c.completions.create(model=MODEL, prompt=ids, max_tokens=8, logprobs=0)
    lp = whole.choices[0].logprobs
    np.testing.assert_allclose(lp.token_logprobs, want, rtol=1e-4, atol=1e-4)
    assert len(lp.tokens) == len(lp.text_offset) == 8 and lp.top_logprobs is None
    chat = c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=5, logprobs=True
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 5 and all(e.logprob <= 0 and e.top_logprobs == [] for e in content)


def test_stop_strings_cut_the_reply_streaming_or_not(server, tokenizer):
    c = client(server)
    ids = tokenizer.encode("stop strings")
    full = c.completions.create(
        model=MODEL, prompt=ids, max_tokens=40, extra_body={"return_token_ids": True}
    ).choices[0]
    text = full.text
    # A stop string from the middle of the reply (two characters that are not replacement
    # characters, first seen past the start).
    at = next(i for i in range(3, len(text) - 2) if "\ufffd" not in text[i : i + 2])
    stop = text[at : at + 2]
    want = text[: text.index(stop)]
    cut = c.completions.create(
        model=MODEL, prompt=ids, max_tokens=40, stop=[stop], extra_body={"return_token_ids": True}
    )
    choice = cut.choices[0]
    assert choice.text == want and choice.finish_reason == "stop"
    got = token_ids(choice)
    assert got == token_ids(full)[: len(got)] and len(got) < 40
    assert cut.usage.completion_tokens == len(got)
    chunks = list(
        c.completions.create(model=MODEL, prompt=ids, max_tokens=40, stop=stop, stream=True)
    )
    assert "".join(ch.choices[0].text for ch in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_several_prompts_and_n_choices(server, model, tokenizer):
    c = client(server)
    prompts = ["first prompt", "second"]
    reply = c.completions.create(
        model=MODEL, prompt=prompts, n=2, max_tokens=6, extra_body={"return_token_ids": True}
    )
    assert [ch.index for ch in reply.choices] == [0, 1, 2, 3]
    for ch in reply.choices:
        want = greedy_reference(model, tokenizer.encode(prompts[ch.index // 2]), 6)
        assert token_ids(ch) == want
    assert reply.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in prompts)
    assert reply.usage.completion_tokens == 24


def test_seeded_sampling_is_reproducible(server):
    c = client(server)
    ask = {"model": MODEL, "prompt": "sample", "max_tokens": 16, "temperature": 1.0, "seed": 7,
           "extra_body": {"return_token_ids": True}}  # fmt: skip
    a, b = (token_ids(c.completions.create(**ask).choices[0]) for _ in range(2))
    other = token_ids(c.completions.create(**{**ask, "seed": 8}).choices[0])
    assert a == b and a != other


def test_models_health_status_metrics(server):
    c = client(server)
    assert [m.id for m in c.models.list().data] == [MODEL]
    assert get(server.port, "/health") == (200, {"status": "ok", "model": MODEL})
    assert get(server.port, f"/v1/models/{MODEL}")[1]["id"] == MODEL
    assert get(server.port, "/v1/models/other")[0] == 404
    s = status(server)
    assert {"running", "queued", "tokens_per_s", "generated_tokens", "prefix_cache"} <= set(s)
    assert set(s["prefix_cache"]) == {"hits", "misses", "hit_rate", "bytes"}
    code, text = get(server.port, "/metrics")
    assert code == 200 and "kvstate_running " in text and "kvstate_prefix_hit_rate " in text


def test_sse_format(server):
    response, conn = stream(server.port, "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "sse"}], "max_tokens": 6,
        "stream": True, "stream_options": {"include_usage": True}, "n": 2,
    })  # fmt: skip
    try:
        assert response.status == 200
        assert response.getheader("content-type").startswith("text/event-stream")
        assert response.getheader("cache-control") == "no-cache"
        events = list(sse_events(response))
    finally:
        conn.close()
    assert events[-1] == b"data: [DONE]"
    assert all(e.startswith(b"data: ") and b"\n" not in e for e in events)
    chunks = [json.loads(e[len(b"data: ") :]) for e in events[:-1]]
    *body, usage = chunks
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 12
    assert all(ch["usage"] is None for ch in body)  # include_usage: null until the last
    assert all(ch["object"] == "chat.completion.chunk" and len(ch["choices"]) == 1 for ch in body)
    for index in (0, 1):
        mine = [ch["choices"][0] for ch in body if ch["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert [m["finish_reason"] for m in mine][-1] == "length"
        assert all(m["finish_reason"] is None for m in mine[:-1])
        assert mine[-1]["delta"].keys() <= {"content"}


USER = [{"role": "user", "content": "x"}]

# fmt: off
BAD_REQUESTS = [
    # (path, body, the param the error names)
    ("/v1/completions", b'{"prompt": "x", "max_tokens": ', None),
    ("/v1/completions", b"[1, 2]", None),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "8"}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": True}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": -0.5}, "temperature"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_k": 2.5}, "top_k"),
    ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": "x", "stop": 5}, "stop"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, "stop"),
    ("/v1/completions", {"prompt": "x", "seed": "x"}, "seed"),
    ("/v1/completions", {"prompt": "x", "logprobs": 2}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 0.5}, "presence_penalty"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [256]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "x", "max_token": 5}, "max_token"),
    ("/v1/completions", {"prompt": "x", "model": 3}, "model"),
    ("/v1/completions", {"max_tokens": 5}, "prompt"),
    ("/v1/completions", {"prompt": 5}, "prompt"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": [1, 256]}, "prompt"),
    ("/v1/completions", {"prompt": [-1]}, "prompt"),
    ("/v1/completions", {"prompt": [[1], [2, 300]]}, "prompt[1]"),
    ("/v1/completions", {"prompt": "x" * 5000}, "prompt"),  # the model takes 4096 positions
    ("/v1/chat/completions", {"max_tokens": 5}, "messages"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{**USER[0], "tool_calls": []}]}, "messages[0]"),
    ("/v1/chat/completions", {"messages": USER, "top_logprobs": 3}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": USER, "max_completion_tokens": -1},
     "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": USER, "temperature": None, "n": 1.5}, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 5000}]}, "messages"),
]
# fmt: on


def test_bad_requests_get_400_naming_the_field_and_the_server_goes_on(server, model, tokenizer):
    for path, body, param in BAD_REQUESTS:
        code, answer = post(server.port, path, body)
        assert code == 400, (body, answer)
        error = answer["error"]
        assert error["param"] == param, (body, error)
        assert error["type"] == "invalid_request_error" and error["message"]
    code, answer = post(server.port, "/v1/completions", {"prompt": "x" * 5000})
    assert answer["error"]["code"] == "context_length_exceeded"
    for path, want in (("/v1/completions", 405), ("/v2/nothing", 404)):  # GET: JSON errors too
        code, answer = get(server.port, path)
        assert code == want and "error" in answer
    # The official client raises its own BadRequestError for the same answers.
    with pytest.raises(openai.BadRequestError) as caught:
        client(server).completions.create(model=MODEL, prompt="x", max_tokens=0)
    assert caught.value.body["param"] == "max_tokens"
    ids = tokenizer.encode("still serving")
    reply = client(server).completions.create(
        model=MODEL, prompt=ids, max_tokens=5, extra_body={"return_token_ids": True}
    )
    assert token_ids(reply.choices[0]) == greedy_reference(model, ids, 5)


def test_a_disconnected_stream_is_cancelled_at_once(server):
    before = status(server)
    response, conn = stream(server.port, "/v1/completions", {
        "model": MODEL, "prompt": "go on and on", "max_tokens": 4000, "stream": True,
    })  # fmt: skip
    events = sse_events(response)
    for _ in range(3):
        next(events)
    conn.close()  # mid-stream: the other 3,990-odd tokens are never generated
    wait_until(lambda: idle(status(server)), 10, "the request is cancelled")
    after = status(server)
    assert after["requests"]["disconnected"] == before["requests"]["disconnected"] + 1
    assert after["generated_tokens"] - before["generated_tokens"] < 1000


def test_a_client_leaving_before_a_whole_reply_cancels_it(server):
    before = status(server)
    conn = connection(server.port)
    body = {"model": MODEL, "prompt": "long", "max_tokens": 4000}
    conn.request("POST", "/v1/completions", json.dumps(body).encode())
    wait_until(lambda: status(server)["running"] == 1, 10, "the request runs")
    conn.close()  # without reading: nobody will read the reply
    wait_until(lambda: idle(status(server)), 10, "the request is cancelled")
    after = status(server)
    assert after["requests"]["disconnected"] == before["requests"]["disconnected"] + 1
    assert after["generated_tokens"] - before["generated_tokens"] < 1000


def test_sixteen_concurrent_streams_one_leaving_midway(server, model, tokenizer):
    """Every stream but the one that disconnects gets exactly the tokens of its prompt
    alone; bad requests sent meanwhile disturb none of them; the server serves afterwards."""
    prompts = [f"request {i}: " + "abc " * (i % 4) for i in range(16)]
    lengths = [8 + (i * 5) % 17 for i in range(16)]
    leaver = 5
    results: dict[int, Any] = {}
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            if i == leaver:
                response, conn = stream(server.port, "/v1/chat/completions", {
                    "model": MODEL, "messages": [{"role": "user", "content": prompts[i]}],
                    "max_tokens": 4000, "stream": True,
                })  # fmt: skip
                events = sse_events(response)
                for _ in range(4):
                    next(events)
                conn.close()
                return
            chunks = client(server).completions.create(
                model=MODEL,
                prompt=prompts[i],
                max_tokens=lengths[i],
                stream=True,
                extra_body={"return_token_ids": True},
            )
            results[i] = [t for ch in chunks for t in token_ids(ch.choices[0])]
        except BaseException as error:
            errors.append(error)

    def bad() -> None:
        for _, body, _ in BAD_REQUESTS[:12]:
            post(server.port, "/v1/completions", body)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    threads.append(threading.Thread(target=bad))
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert time.monotonic() - start < 120
    for i in range(16):
        if i != leaver:
            want = greedy_reference(model, tokenizer.encode(prompts[i]), lengths[i])
            assert results[i] == want, i
    wait_until(lambda: idle(status(server)), 10, "every request is done")
    ids = tokenizer.encode("afterwards")
    reply = client(server).completions.create(
        model=MODEL, prompt=ids, max_tokens=6, extra_body={"return_token_ids": True}
    )
    assert token_ids(reply.choices[0]) == greedy_reference(model, ids, 6)


def readme_server_block(language: str) -> str:
    section = (ROOT / "README.md").read_text().split("## Server", 1)[1]
    match = re.search(rf"```{language}\n(.*?)```", section, re.S)
    assert match, "the README lost its server example"
    return match.group(1)


def test_readme_server_example_runs_against_the_server(server, capsys):
    code = readme_server_block("python").replace("127.0.0.1:8000", f"127.0.0.1:{server.port}")
    exec(compile(code, "README.md", "exec"), {})
    printed = capsys.readouterr().out
    first, streamed = printed.split("\n", 1)
    assert first.endswith(" 16")  # the reply's completion tokens
    assert streamed.startswith("'") and streamed.count("'") >= 2  # the streamed texts


def test_readme_server_command_parses():
    command = readme_server_block("bash").split("kvstate-serve", 1)[1].split()
    args = parser().parse_args(command)
    assert args.model == MODEL and args.port == 8000
    assert (
        "serve" in readme_server_block("bash")
        and "kvstate-serve" in (ROOT / "pyproject.toml").read_text()
    )
