"""OpenAI-style error bodies, and the exception a request handler raises to send one."""

from __future__ import annotations

from typing import Any


class BadRequest(Exception):
    """A request the server refuses: `status` (400 unless said), `message` (what is wrong,
    the value, what is accepted), `param` (the field, as OpenAI names it: "max_tokens",
    "messages[1].content"; None when no one field is to blame), `code` (OpenAI's, such as
    "context_length_exceeded"), `kind` (OpenAI's error type)."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        *,
        code: str | None = None,
        status: int = 400,
        kind: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.kind = (
            message,
            param,
            code,
            status,
            kind,
        )

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.param, code=self.code, kind=self.kind)


def error_body(
    message: str,
    param: str | None = None,
    *,
    code: str | None = None,
    kind: str = "invalid_request_error",
) -> dict[str, Any]:
    """`{"error": {"message", "type", "param", "code"}}`, as OpenAI's API answers."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
