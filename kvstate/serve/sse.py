"""Server-sent events: `data: <json>\\n\\n` per chunk and `data: [DONE]\\n\\n` at the end, as
OpenAI streams, in a response that notices a client leaving the moment it leaves."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

DONE = b"data: [DONE]\n\n"


def event(payload: dict[str, Any]) -> bytes:
    """One event whose data is `payload` as compact JSON (one line: JSON escapes newlines)."""
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


class EventStream(StreamingResponse):
    """A `text/event-stream` response of the async iterator `events` (bytes). It listens
    for the client's disconnect while it streams, whatever the server's ASGI version, and
    on a disconnect stops the iterator at once (`aclose`, so its `finally` runs: that is
    where the job cancels its requests) instead of at its next write."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes]) -> None:
        super().__init__(
            events,
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def stream() -> None:
                    # OSError: the client is gone (an ASGI 2.4 server says so this way).
                    with contextlib.suppress(OSError):
                        await self.stream_response(send)
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            aclose = getattr(self._events, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):  # even when the server cancels this task
                    await aclose()
