"""OpenAI's response objects: completions and chat completions, whole and as stream chunks.

    completion:  {"id": "cmpl-..", "object": "text_completion", "created", "model",
                  "choices": [{"index", "text", "logprobs", "finish_reason"}], "usage"}
    chat:        {"id": "chatcmpl-..", "object": "chat.completion", ...,
                  "choices": [{"index", "message": {"role", "content"}, "logprobs",
                  "finish_reason"}], "usage"}
    chat chunk:  "object": "chat.completion.chunk", each choice a `delta` ({"role"} first,
                 then {"content"}, {} with the finish_reason last)

Log-probabilities are the chosen token's only: a completion's `{"tokens", "token_logprobs",
"top_logprobs": null, "text_offset"}`, a chat's `{"content": [{"token", "logprob", "bytes",
"top_logprobs": []}]}`. With `return_token_ids`, each choice carries its `token_ids` (a
chunk: those it adds), and a whole response's choices their `prompt_token_ids` too.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from .jobs import Event, RunningJob
from .text import Delta


class Shaper:
    """Builds one job's response objects; `model` is the served model's name."""

    def __init__(self, running: RunningJob, model: str, tokenizer: Any) -> None:
        self.running, self.model, self.tokenizer = running, model, tokenizer
        self.chat = running.job.chat
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    def whole(self) -> dict[str, Any]:
        """The response once every choice has finished."""
        job = self.running.job
        choices = []
        for c in self.running.choices:
            text = c.text.text
            entry: dict[str, Any] = {"index": c.index}
            if self.chat:
                entry["message"] = {"role": "assistant", "content": text}
            else:
                entry["text"] = text
            entry["logprobs"] = None
            if job.logprobs:
                whole = Delta(
                    text, tuple(c.text.tokens), tuple(c.text.logprobs), tuple(c.text.offsets)
                )
                entry["logprobs"] = self._logprobs(whole)
            entry["finish_reason"] = c.finish_reason
            if job.return_token_ids:
                entry["token_ids"] = list(c.text.tokens)
                entry["prompt_token_ids"] = list(c.prompt)
            choices.append(entry)
        return {**self._head(final=True), "choices": choices, "usage": self.running.usage()}

    def first_chunks(self) -> list[dict[str, Any]]:
        """A chat stream's opening chunk per choice (the role); none for completions."""
        if not self.chat:
            return []
        return [
            self._chunk(self._choice(c.index, {"role": "assistant", "content": ""}, None, None))
            for c in self.running.choices
        ]

    def chunk(self, event: Event) -> dict[str, Any] | None:
        """The stream chunk of one event; None when it would say nothing (tokens whose text
        is held back, with neither log-probabilities nor token ids asked for)."""
        job, d = self.running.job, event.delta
        carries = d.tokens and (job.logprobs or job.return_token_ids)
        if not (d.text or carries or event.finish_reason is not None):
            return None
        body: dict[str, Any]
        if self.chat:
            body = {"content": d.text} if d.text or event.finish_reason is None else {}
        else:
            body = {"text": d.text}
        lps = self._logprobs(d) if job.logprobs and d.tokens else None
        choice = self._choice(event.index, body, lps, event.finish_reason)
        if job.return_token_ids:
            choice["token_ids"] = list(d.tokens)
        return self._chunk(choice)

    def usage_chunk(self) -> dict[str, Any]:
        return {**self._head(final=False), "choices": [], "usage": self.running.usage()}

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        head = self._head(final=False)
        if self.running.job.include_usage:
            head["usage"] = None
        return {**head, "choices": [choice]}

    def _choice(
        self, index: int, body: dict[str, Any], logprobs: Any, finish: str | None
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index}
        if self.chat:
            choice["delta"] = body
        else:
            choice.update(body)
        choice["logprobs"] = logprobs
        choice["finish_reason"] = finish
        return choice

    def _head(self, final: bool) -> dict[str, Any]:
        kind = "chat.completion" if self.chat else "text_completion"
        if self.chat and not final:
            kind = "chat.completion.chunk"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def _logprobs(self, d: Delta) -> dict[str, Any]:
        pieces = [self.tokenizer.decode([t]) for t in d.tokens]
        values = list(d.logprobs or ())
        if self.chat:
            return {
                "content": [
                    {"token": p, "logprob": v, "bytes": list(p.encode()), "top_logprobs": []}
                    for p, v in zip(pieces, values, strict=False)
                ]
            }
        return {
            "tokens": pieces,
            "token_logprobs": values,
            "top_logprobs": None,
            "text_offset": list(d.offsets),
        }
