"""A job in flight: its choices submitted to the engine thread, their outputs turned into
per-choice text events, and every unfinished request cancelled when the job is dropped
(a client gone, a stop string met, an error)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import attrs

from kvstate import StateError

from .engine import Request
from .errors import BadRequest
from .loop import EngineLoop, Failure, Sink
from .protocol import Job
from .text import Delta, TextStream


class EngineFailure(Exception):
    """The engine failed this job's requests (see `loop`); the message says how."""


@attrs.frozen
class Event:
    """Choice `index` got `delta`; `finish_reason` is set on the choice's last event."""

    index: int
    delta: Delta
    finish_reason: str | None


class _Choice:
    def __init__(self, index: int, prompt: tuple[int, ...], text: TextStream) -> None:
        self.index, self.prompt, self.text = index, prompt, text
        self.request: Request | None = None
        self.finish_reason: str | None = None


class RunningJob:
    """`await start()` submits every choice (a BadRequest when the engine refuses one, and
    none is left running); `events()` yields each choice's deltas as they come; `close()`
    cancels what is still running (always call it: `async with` does)."""

    def __init__(self, job: Job, engine: EngineLoop, tokenizer: Any) -> None:
        self.job, self._engine = job, engine
        self._choices = [
            _Choice(index, prompt, TextStream(tokenizer, job.stop, job.hidden_ids))
            for index, prompt, _ in job.choices()
        ]
        self._sink: Sink | None = None

    async def __aenter__(self) -> RunningJob:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    async def start(self) -> None:
        self._sink = Sink()
        for (index, prompt, params), choice in zip(self.job.choices(), self._choices, strict=True):
            try:
                choice.request = await self._engine.submit(prompt, params, self._sink, index)
            except StateError as error:
                raise BadRequest(
                    f"the engine refused the request: {error}", self._param(error)
                ) from error

    def _param(self, error: StateError) -> str | None:
        """The request field an engine refusal names (its `field`, when it has one)."""
        field = getattr(error, "field", None)
        if not isinstance(field, str):
            return None
        if field == "prompt" and self.job.chat:
            return "messages"
        return "stop_token_ids" if field == "stop_ids" else field

    def close(self) -> None:
        for choice in self._choices:
            if choice.request is not None and choice.finish_reason is None:
                self._engine.cancel(choice.request)

    @property
    def choices(self) -> list[_Choice]:
        return self._choices

    def usage(self) -> dict[str, Any]:
        prompt = sum(len(p) for p in self.job.prompts)
        completion = sum(len(c.text.tokens) for c in self._choices)
        cached = sum(c.request.cached_tokens for c in self._choices[:: self.job.n] if c.request)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    async def events(self) -> AsyncIterator[Event]:
        assert self._sink is not None, "start() first"
        while any(c.finish_reason is None for c in self._choices):
            item = await self._sink.queue.get()
            if isinstance(item, Failure):
                for c in self._choices:
                    c.finish_reason = c.finish_reason or "error"
                raise EngineFailure(item.message)
            for index, out in item:
                choice = self._choices[index]
                if choice.finish_reason is not None:
                    continue  # outputs after a stop string, before its cancel took effect
                delta = choice.text.feed(out.tokens, out.logprobs)
                if not choice.text.stopped and out.finished:
                    delta = _joined(delta, choice.text.finish())
                if choice.text.stopped:
                    choice.finish_reason = "stop"
                    self._engine.cancel(out.request)
                elif out.finished:
                    choice.finish_reason = _REASONS.get(out.finish_reason or "", out.finish_reason)
                if delta.text or delta.tokens or choice.finish_reason is not None:
                    yield Event(index, delta, choice.finish_reason)


# The engine's reasons as OpenAI's; "cancelled" reaches a client only when the engine
# cancelled a request by itself, and is passed on as it is.
_REASONS: dict[str, str | None] = {"stop": "stop", "length": "length"}


def _joined(a: Delta, b: Delta) -> Delta:
    return Delta(a.text + b.text, a.tokens, a.logprobs, a.offsets)
