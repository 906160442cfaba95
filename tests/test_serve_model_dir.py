"""kvstate-serve on a local mlx-lm model directory (the tiny llama saved with
`mlx_lm.utils.save_model`, its byte tokenizer with a chat template, an eos id in its
config): mlx-lm's loader, the tokenizer's own chat template and its eos, through the
official client."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from mlx_lm.utils import save_config, save_model  # noqa: E402

from kvstate.adapters.tiny_models import CONFIGS, byte_tokenizer, tiny_model  # noqa: E402
from tests.helpers import greedy_reference  # noqa: E402
from tests.serving import Server  # noqa: E402

TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
MESSAGES = [{"role": "user", "content": "Tell me something."}]
RENDERED = "<user>Tell me something.\n<assistant>"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(server, the greedy reply's tokens, where the eos is in it: the config's eos id is
    the reply's token there, its 5th or later, first seen there)."""
    model = tiny_model("llama")
    want = greedy_reference(model, list(RENDERED.encode()), 40)
    at = next(i for i in range(4, 40) if want[i] not in want[:i])
    eos = want[at]
    folder = tmp_path_factory.mktemp("tiny-llama")
    save_model(folder, model)
    save_config({**CONFIGS["llama"], "eos_token_id": eos}, folder / "config.json")
    hf = byte_tokenizer()._tokenizer
    hf.chat_template = TEMPLATE
    hf.save_pretrained(folder)
    server = Server("--model", str(folder), "--served-model-name", "dir-llama",
                    "--log-level", "warning")  # fmt: skip
    yield server, want, at
    log = server.stop()
    assert "Traceback" not in log, log


def test_a_model_directory_with_its_chat_template_and_eos(served):
    server, want, at = served
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["dir-llama"]
    reply = client.chat.completions.create(
        model="dir-llama", messages=MESSAGES, max_tokens=40, extra_body={"return_token_ids": True}
    )
    (choice,) = reply.choices
    assert reply.usage.prompt_tokens == len(RENDERED.encode())  # the tokenizer's template
    assert choice.model_extra["token_ids"] == want[: at + 1]  # through the eos, which ends it
    assert choice.finish_reason == "stop"
    assert choice.message.content == bytes(want[:at]).decode("utf-8", "replace").lstrip(" ")
    ignoring = client.chat.completions.create(
        model="dir-llama",
        messages=MESSAGES,
        max_tokens=40,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    assert ignoring.choices[0].model_extra["token_ids"] == want
    assert ignoring.choices[0].finish_reason == "length"
    streamed = client.chat.completions.create(
        model="dir-llama", messages=MESSAGES, max_tokens=40, stream=True
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    assert chunks[-1].choices[0].finish_reason == "stop"
