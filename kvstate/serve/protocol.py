"""OpenAI request bodies -> `Job`s: every field checked, a BadRequest naming the first bad one.

Fields: OpenAI's for `/v1/completions` and `/v1/chat/completions`, plus four that vLLM's
server has too: `top_k` (0 or -1: off), `stop_token_ids`, `ignore_eos` and
`return_token_ids` (each choice's `token_ids`, and `prompt_token_ids`). An unknown field is
refused, as OpenAI's API does (a misspelt `max_token` would otherwise pass unnoticed), and
so is a field this server does not implement set to anything but its neutral value
(`presence_penalty` other than 0, `echo`, `best_of` > 1, tools, top log-probabilities: the
engine reports the chosen token's log-probability only). `null` is the field's default.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from kvstate import StateError

from . import fields as f
from .engine import RequestParams
from .errors import BadRequest
from .prompts import chat_ids, text_ids

_COMMON = frozenset(
    {"model", "max_tokens", "temperature", "top_p", "top_k", "n", "stream", "stream_options",
     "stop", "seed", "presence_penalty", "frequency_penalty", "logit_bias", "user",
     "stop_token_ids", "ignore_eos", "return_token_ids"}
)  # fmt: skip
COMPLETION_FIELDS = _COMMON | {"prompt", "logprobs", "echo", "suffix", "best_of"}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs",
                         "response_format", "tools", "tool_choice", "parallel_tool_calls"}  # fmt: skip
_ROLES = ("system", "developer", "user", "assistant", "tool")


@attrs.frozen
class ModelFacts:
    """What parsing needs to know of the served model: its tokenizer, the ids it takes
    (0 .. vocab_size - 1), its longest prompt (None: no bound), the ids that end a reply
    (`eos_ids`), and `max_tokens` when a request gives none."""

    tokenizer: Any
    vocab_size: int
    max_prompt_tokens: int | None
    eos_ids: tuple[int, ...]
    default_max_tokens: int = 256


@attrs.frozen
class Job:
    """One request, checked: `prompts` (one per prompt; each makes `n` choices, choice
    `i` of prompt `p` being index p * n + i as OpenAI numbers them) and the engine's
    `params` for each; the rest says how to answer. `hidden_ids`: stop ids whose text is
    not part of the reply (eos and `stop_token_ids`)."""

    chat: bool
    prompts: tuple[tuple[int, ...], ...]
    n: int
    params: RequestParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    logprobs: bool
    return_token_ids: bool

    @property
    def hidden_ids(self) -> frozenset[int]:
        return frozenset(self.params.stop_ids)

    def choices(self) -> list[tuple[int, tuple[int, ...], RequestParams]]:
        """(index, prompt ids, params) of every choice; a seeded request's choices get the
        seeds seed, seed + 1, ... so that `n` samples differ and are each reproducible."""
        out = []
        for p, prompt in enumerate(self.prompts):
            for i in range(self.n):
                index = p * self.n + i
                seed = self.params.seed
                params = self.params
                if seed is not None and index:
                    params = attrs.evolve(params, seed=(seed + index) % 2**64)
                out.append((index, prompt, params))
        return out


def parse_completion(body: Any, facts: ModelFacts) -> Job:
    """A `/v1/completions` body: `prompt` is a string, an array of strings, an array of
    token ids or an array of arrays of ids."""
    given = _given(body, COMPLETION_FIELDS)
    if "prompt" not in given:
        raise BadRequest("prompt is required", "prompt")
    prompts = _completion_prompts(given["prompt"], facts)
    logprobs = "logprobs" in given
    if logprobs and f.integer(given["logprobs"], "logprobs", 0) > 0:
        raise BadRequest(
            "logprobs > 0 (top log-probabilities) is not supported: this server reports the "
            "chosen token's log-probability only; ask logprobs=0",
            "logprobs",
        )
    for name, neutral in (("echo", (False,)), ("suffix", ()), ("best_of", (1,))):
        if name in given:
            f.neutral(given[name], name, neutral, "")
    return _job(False, prompts, given, facts, logprobs, "prompt")


def parse_chat(body: Any, facts: ModelFacts) -> Job:
    """A `/v1/chat/completions` body: `messages`, each a role and text content (a string
    or an array of text parts), rendered with the chat template (`prompts`)."""
    given = _given(body, CHAT_FIELDS)
    messages = _messages(given.get("messages"))
    prompt = chat_ids(facts.tokenizer, messages)
    if "max_completion_tokens" in given:  # OpenAI's newer name wins over max_tokens
        given["max_tokens"] = f.integer(given["max_completion_tokens"], "max_completion_tokens", 1)
    logprobs = f.boolean(given.get("logprobs", False), "logprobs")
    if "top_logprobs" in given:
        top = f.integer(given["top_logprobs"], "top_logprobs", 0, 20)
        if top > 0:
            raise BadRequest(
                "top_logprobs > 0 is not supported: this server reports the chosen token's "
                "log-probability only",
                "top_logprobs",
            )
    if "response_format" in given:
        kind = f.obj(given["response_format"], "response_format").get("type")
        if kind != "text":
            raise BadRequest(
                f"response_format {kind!r} is not supported; only {{'type': 'text'}}",
                "response_format",
            )
    if "tools" in given and f.array(given["tools"], "tools"):
        raise BadRequest("tools are not supported by this server", "tools")
    if "tool_choice" in given:
        f.neutral(given["tool_choice"], "tool_choice", ("none",), "other than 'none'")
    if "parallel_tool_calls" in given:
        f.boolean(given["parallel_tool_calls"], "parallel_tool_calls")
    return _job(True, (prompt,), given, facts, logprobs, "messages")


def _given(body: Any, known: frozenset[str]) -> dict[str, Any]:
    """The body's fields that are not null, each one this endpoint knows."""
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object; got {type(body).__name__}")
    for name in body:
        if name not in known:
            raise BadRequest(f"Unrecognized request argument supplied: {name}", name)
    return {k: v for k, v in body.items() if v is not None}


def _job(
    chat: bool,
    prompts: tuple[tuple[int, ...], ...],
    given: Mapping[str, Any],
    facts: ModelFacts,
    logprobs: bool,
    prompt_field: str,
) -> Job:
    if "model" in given:
        f.string(given["model"], "model")
    limit = facts.max_prompt_tokens
    for ids in prompts:
        if limit is not None and len(ids) > limit:
            raise BadRequest(
                f"this model takes at most {limit} prompt tokens; the prompt has {len(ids)}",
                prompt_field,
                code="context_length_exceeded",
            )
    top_p = f.number(given.get("top_p", 1.0), "top_p", 0.0, 1.0)
    if top_p == 0:
        raise BadRequest("top_p must be > 0; got 0", "top_p")
    top_k = f.integer(given.get("top_k", 0), "top_k", -1)
    for name in ("presence_penalty", "frequency_penalty"):
        if name in given:
            f.number(given[name], name)
            f.neutral(given[name], name, (0, 0.0), "other than 0")
    if "logit_bias" in given and f.obj(given["logit_bias"], "logit_bias"):
        raise BadRequest("logit_bias is not supported by this server", "logit_bias")
    if "user" in given:
        f.string(given["user"], "user")
    stream = f.boolean(given.get("stream", False), "stream")
    include_usage = False
    if "stream_options" in given:
        if not stream:
            raise BadRequest("stream_options is only allowed when stream is true", "stream_options")
        options = f.obj(given["stream_options"], "stream_options")
        for name in options:
            if name != "include_usage":
                raise BadRequest(f"stream_options.{name} is not supported", "stream_options")
        include_usage = f.boolean(options.get("include_usage", False), "stream_options")
    ignore_eos = f.boolean(given.get("ignore_eos", False), "ignore_eos")
    extra: tuple[int, ...] = ()
    if "stop_token_ids" in given and f.array(given["stop_token_ids"], "stop_token_ids"):
        extra = f.token_ids(given["stop_token_ids"], "stop_token_ids", facts.vocab_size)
    ids = tuple(dict.fromkeys((*(() if ignore_eos else facts.eos_ids), *extra)))
    seed = given.get("seed")
    values: dict[str, Any] = {
        "max_tokens": f.integer(given.get("max_tokens", facts.default_max_tokens), "max_tokens", 1),
        "stop_ids": ids,
        "temperature": f.number(given.get("temperature", 0.0), "temperature", 0.0),
        "top_p": top_p,
        "top_k": max(top_k, 0),
        "seed": None if seed is None else f.integer(seed, "seed") % 2**64,
        "logprobs": logprobs,
    }
    try:
        params = RequestParams(**values)
    except StateError as error:  # an engine's own bounds, past the checks above
        field = getattr(error, "field", None)  # the engine's name for it, when it says
        raise BadRequest(
            f"the engine refused the parameters: {error}", field if isinstance(field, str) else None
        ) from error
    return Job(
        chat=chat,
        prompts=prompts,
        n=f.integer(given.get("n", 1), "n", 1),
        params=params,
        stop=f.stop_strings(given["stop"], "stop") if "stop" in given else (),
        stream=stream,
        include_usage=include_usage,
        logprobs=logprobs,
        return_token_ids=f.boolean(given.get("return_token_ids", False), "return_token_ids"),
    )


def _completion_prompts(prompt: Any, facts: ModelFacts) -> tuple[tuple[int, ...], ...]:
    tokenizer, vocab = facts.tokenizer, facts.vocab_size
    if isinstance(prompt, str):
        return (text_ids(tokenizer, prompt, "prompt"),)
    items = f.array(prompt, "prompt")
    if not items:
        raise BadRequest(
            "prompt is empty; give a string, an array of strings or token ids", "prompt"
        )
    if all(isinstance(x, int) and not isinstance(x, bool) for x in items):
        return (f.token_ids(items, "prompt", vocab),)
    out = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            out.append(text_ids(tokenizer, item, "prompt"))
        elif isinstance(item, list):
            out.append(f.token_ids(item, f"prompt[{i}]", vocab))
        else:
            raise BadRequest(
                f"prompt[{i}] must be a string or an array of token ids; got {type(item).__name__}",
                "prompt",
            )
    return tuple(out)


def _messages(value: Any) -> list[dict[str, str]]:
    if value is None:
        raise BadRequest("messages is required", "messages")
    messages = f.array(value, "messages")
    if not messages:
        raise BadRequest("messages is empty; give at least one message", "messages")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        m = f.obj(message, where)
        for name in m:
            if name not in ("role", "content", "name"):
                raise BadRequest(f"{where}.{name} is not supported by this server", where)
        role = m.get("role")
        if role not in _ROLES:
            raise BadRequest(f"{where}.role must be one of {list(_ROLES)}; got {role!r:.40}", where)
        entry = {"role": role, "content": _content(m.get("content"), f"{where}.content")}
        if "name" in m:
            entry["name"] = f.string(m["name"], f"{where}.name")
        out.append(entry)
    return out


def _content(value: Any, where: str) -> str:
    """A message's text: a string, or an array of `{"type": "text", "text": ...}` parts
    (joined); null is the empty text (an assistant turn may have none)."""
    if value is None or isinstance(value, str):
        return value or ""
    parts = f.array(value, where)
    texts = []
    for i, part in enumerate(parts):
        p = f.obj(part, f"{where}[{i}]")
        if p.get("type") != "text":
            raise BadRequest(
                f"{where}[{i}]: only text parts are supported; got type {p.get('type')!r:.40}",
                where,
            )
        texts.append(f.string(p.get("text"), f"{where}[{i}].text"))
    return "".join(texts)
