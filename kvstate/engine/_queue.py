"""Requests waiting for a row: first come, first served."""

from __future__ import annotations

from collections import deque

from ._params import Request


class WaitQueue:
    """Submitted requests not yet admitted, oldest first."""

    def __init__(self) -> None:
        self._waiting: deque[Request] = deque()

    def __len__(self) -> int:
        return len(self._waiting)

    def push(self, request: Request) -> None:
        self._waiting.append(request)

    def admit(self, free: int) -> list[Request]:
        """Up to `free` requests, oldest first, out of the queue."""
        return [self._waiting.popleft() for _ in range(min(free, len(self._waiting)))]

    def drop_cancelled(self) -> list[Request]:
        """The cancelled requests, out of the queue (the others keep their order)."""
        gone = [r for r in self._waiting if r.cancel_requested]
        if gone:
            self._waiting = deque(r for r in self._waiting if not r.cancel_requested)
        return gone
