"""A conversation over one state: each turn runs only its new tokens (what a CLI's `chat`
sits on)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ..speculative import Drafter, Target
from ._stream import Response, stream_text
from ._tokenizer import text_tokenizer


class Chat:
    """Messages, the state that holds them and its ids. `send(content)` adds a user message,
    streams the reply (`Response`s) and keeps the state for the next turn.

    A turn's prompt is the part of the chat template's rendering of the whole conversation
    that follows the text the state holds (the earlier turns as the model saw them, its
    replies' end tokens included): only those tokens run through the model. When the
    template renders the past otherwise (it rewrites an earlier message), the turn starts
    over from the whole rendering. `drafter`: a drafter for every turn (a `ModelDrafter`
    is started on the whole history each turn). `system`: a first system message.
    `options`: `stream_text` / `generate` keywords for every turn (`max_tokens`,
    `sampler`, ...), which `send` can override.
    """

    def __init__(
        self,
        target: Target,
        tokenizer: Any,
        drafter: Drafter | None = None,
        *,
        system: str | None = None,
        **options: Any,
    ) -> None:
        self.target = target
        self.tokenizer = text_tokenizer(tokenizer)
        self.drafter = drafter
        self.options = options
        self.messages: list[dict[str, Any]] = (
            [] if system is None else [{"role": "system", "content": system}]
        )
        self.state: Any = None  # holds `history`
        self.history: list[int] = []

    def prompt(self, messages: list[dict[str, Any]]) -> tuple[list[int], bool]:
        """The ids a turn over `messages` runs, and whether they continue `state`."""
        rendered = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        if self.state is not None:
            held = self.tokenizer.decode(self.history)
            if rendered.startswith(held) and len(rendered) > len(held):
                new = self.tokenizer.encode(rendered[len(held) :], add_special_tokens=False)
                return list(new), True
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)), False

    def send(self, content: str, **options: Any) -> Iterator[Response]:
        """Add the user message `content` and stream the reply. Once the stream ends (or is
        stopped: a `break`), the reply is a message of the conversation and `state` holds
        it."""
        messages = [*self.messages, {"role": "user", "content": content}]
        ids, continues = self.prompt(messages)
        stream = stream_text(
            self.target,
            self.tokenizer,
            ids,
            self.drafter,
            state=self.state if continues else None,
            history=self.history if continues else None,
            keep_state=True,
            **{**self.options, **options},
        )
        try:
            yield from stream
        finally:
            if stream.tokens:
                self.state, self.history = stream.state, stream.history
                reply = {"role": "assistant", "content": stream.text}
                self.messages = [*messages, reply]
