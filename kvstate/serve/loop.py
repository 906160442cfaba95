"""The engine thread: the one thread that touches the engine, driving `engine.step()`.

Requests reach it through a thread-safe inbox (submit, cancel); each step's outputs go
back to the asyncio queue of the job they belong to (`Sink`), on the server's event loop,
with `loop.call_soon_threadsafe`. Between two steps the thread takes every command waiting,
so a cancel takes effect at the next step; with no work it sleeps on the inbox.

An exception out of `engine.step()` (a bug, not bad input: `submit` refuses that) fails
the requests of that engine, each with an error its client receives, and a fresh engine
takes over: one broken round never takes the server down.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import attrs

from .engine import Engine, Output, Request, RequestParams

log = logging.getLogger("kvstate.serve")


@attrs.frozen
class Failure:
    """Put on a sink instead of outputs when the engine failed its request."""

    message: str


class Sink:
    """Where one job's outputs arrive: lists of (choice index, Output), or a Failure, on an
    asyncio queue of the event loop that made the sink."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[list[tuple[int, Output]] | Failure] = asyncio.Queue()

    def put(self, item: list[tuple[int, Output]] | Failure) -> None:
        """Called from the engine thread."""
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


@attrs.frozen
class _Submit:
    prompt: tuple[int, ...]
    params: RequestParams
    sink: Sink
    index: int
    future: asyncio.Future[Request]


@attrs.frozen
class _Cancel:
    request: Request


_STOP = object()


class EngineLoop:
    """Owns an engine (built by `make_engine`, again after a failed step) and its thread.
    `submit` and `cancel` are called on the event loop; `stats` from anywhere."""

    def __init__(self, make_engine: Callable[[], Engine]) -> None:
        self._make_engine = make_engine
        self._engine = make_engine()
        self.vocab_size: int = self._engine.vocab_size
        self.max_prompt_tokens: int | None = self._engine.max_prompt_tokens
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._sinks: dict[int, tuple[Sink, int]] = {}  # request id -> (sink, choice index)
        self._thread = threading.Thread(target=self._run, name="kvstate-engine", daemon=True)
        self._stats: dict[str, Any] = self._engine.stats()
        self._failures = 0
        self._started = time.monotonic()

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._inbox.put(_STOP)
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    async def submit(
        self, prompt: tuple[int, ...], params: RequestParams, sink: Sink, index: int
    ) -> Request:
        """The engine's Request for `prompt`, once queued; raises what `engine.submit` raised
        (a StateError for input it refuses). Outputs go to `sink`, tagged `index`."""
        future: asyncio.Future[Request] = sink.loop.create_future()
        self._inbox.put(_Submit(prompt, params, sink, index, future))
        return await future

    def cancel(self, request: Request) -> None:
        """Stop `request` at the next step (idempotent; a finished request is left alone)."""
        if not request.finished:
            self._inbox.put(_Cancel(request))

    def stats(self) -> dict[str, Any]:
        """The engine's stats as of its last step, with `engine_failures` and `uptime_s`."""
        return {
            **self._stats,
            "engine_failures": self._failures,
            "uptime_s": time.monotonic() - self._started,
        }

    def _run(self) -> None:
        while True:
            try:
                if not self._take_commands(block=not self._engine.has_work()):
                    return
                if not self._engine.has_work():
                    continue
                self._dispatch(self._engine.step())
                self._stats = self._engine.stats()
            except Exception as error:  # the engine's, never bad input: submit refuses that
                self._fail(error)

    def _take_commands(self, block: bool) -> bool:
        """Apply every waiting command (waiting for one first when `block`); False on stop."""
        try:
            command = self._inbox.get() if block else self._inbox.get_nowait()
            while True:
                if command is _STOP:
                    return False
                self._apply(command)
                command = self._inbox.get_nowait()
        except queue.Empty:
            return True

    def _apply(self, command: _Submit | _Cancel) -> None:
        if isinstance(command, _Cancel):
            try:
                self._engine.cancel(command.request)
            except Exception:  # a request of an engine replaced since: nothing to stop
                log.warning("cancel of request %s refused", command.request.id, exc_info=True)
            return
        loop = command.sink.loop
        try:
            request = self._engine.submit(command.prompt, command.params)
        except Exception as error:
            loop.call_soon_threadsafe(_settle, command.future, None, error, self)
            return
        self._sinks[request.id] = (command.sink, command.index)
        loop.call_soon_threadsafe(_settle, command.future, request, None, self)
        self._stats = self._engine.stats()

    def _dispatch(self, outputs: list[Output]) -> None:
        by_sink: dict[int, tuple[Sink, list[tuple[int, Output]]]] = {}
        for out in outputs:
            entry = self._sinks.get(out.request.id)
            if entry is None:
                continue
            sink, index = entry
            by_sink.setdefault(id(sink), (sink, []))[1].append((index, out))
            if out.finished:
                del self._sinks[out.request.id]
        for sink, items in by_sink.values():
            sink.put(items)

    def _fail(self, error: Exception) -> None:
        log.exception("engine step failed; its requests end with an error, a new engine starts")
        self._failures += 1
        message = f"the engine failed: {type(error).__name__}: {error}"
        failed = {id(s): s for s, _ in self._sinks.values()}.values()
        self._sinks.clear()
        try:  # the new engine first: a client told of the failure may send at once
            self._engine = self._make_engine()
            self._stats = self._engine.stats()
        finally:
            for sink in failed:
                sink.put(Failure(message))


def _settle(
    future: asyncio.Future[Request],
    request: Request | None,
    error: Exception | None,
    owner: EngineLoop,
) -> None:
    """On the event loop: hand the submit's result to its waiter; a waiter gone (its client
    disconnected while queued) means the request is cancelled at once."""
    if future.cancelled():
        if request is not None:
            owner.cancel(request)
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(request)  # type: ignore[arg-type]
