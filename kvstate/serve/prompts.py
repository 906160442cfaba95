"""Prompt token ids from a request: a completion's text or ids, a chat's messages.

A chat is rendered with the tokenizer's chat template (`apply_chat_template`, with the
generation prompt). A tokenizer without one gets the plain fallback template
`FALLBACK_TEMPLATE`: each message on its own line as `<role>: <content>`, then `assistant:`
for the reply, encoded like a completion's text.
"""

from __future__ import annotations

from typing import Any

from .errors import BadRequest

FALLBACK_TEMPLATE = "each message as '<role>: <content>\\n', then 'assistant:'"


def text_ids(tokenizer: Any, text: str, field: str) -> tuple[int, ...]:
    """The ids of a completion prompt's text (the tokenizer's own special tokens, such as
    a BOS, included as it adds them)."""
    ids = tuple(int(t) for t in tokenizer.encode(text))
    if not ids:
        raise BadRequest(f"{field} is empty; give at least one token of text", field)
    return ids


def chat_ids(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[int, ...]:
    """The ids of a conversation (each message `{"role", "content"}`, content text)."""
    if getattr(tokenizer, "has_chat_template", False):
        try:
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except Exception as error:  # a template's own refusal (roles out of order, ...)
            raise BadRequest(
                f"messages: the model's chat template refused them: {error}", "messages"
            ) from error
        if isinstance(ids, str):  # a template that renders text
            ids = tokenizer.encode(ids)
        return tuple(int(t) for t in ids)
    return text_ids(tokenizer, fallback_text(messages), "messages")


def fallback_text(messages: list[dict[str, str]]) -> str:
    """The conversation in the plain fallback template (`FALLBACK_TEMPLATE`)."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
