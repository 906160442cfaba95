"""The ASGI app (Starlette): HTTP to engine calls and back, nothing more.

    POST /v1/completions, /v1/chat/completions   OpenAI's, streaming (SSE) or not
    GET  /v1/models, /v1/models/{id}             the served model
    GET  /health                                 200 while the engine thread runs
    GET  /v1/status                              JSON: running, queued, tokens/s, prefix cache, ...
    GET  /metrics                                the same as Prometheus text

Every error is OpenAI's JSON (`{"error": {"message", "type", "param", "code"}}`): 400 for a
bad request, naming the field; 404 / 405 for a wrong path or method; 500 when the engine
failed a request (the server goes on: see `loop`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import attrs
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import Receive

from .engine import Engine
from .errors import BadRequest, error_body
from .jobs import EngineFailure, RunningJob
from .loading import ServedModel
from .loop import EngineLoop
from .metrics import prometheus_text, status
from .protocol import Job, ModelFacts, parse_chat, parse_completion
from .responses import Shaper
from .sse import DONE, EventStream, event

log = logging.getLogger("kvstate.serve")


@attrs.define
class Counters:
    """Requests by outcome, counted on the event loop."""

    completed: int = 0
    rejected: int = 0  # refused with a 4xx
    disconnected: int = 0  # the client left before the reply ended
    failed: int = 0  # the engine failed them


def create_app(
    served: ServedModel,
    make_engine: Callable[[], Engine],
    *,
    default_max_tokens: int = 256,
) -> Starlette:
    """The server's app for `served`, its engine made by `make_engine` (called again to
    replace an engine whose step failed). `default_max_tokens`: a request's `max_tokens`
    when it gives none. The engine thread starts and stops with the app's lifespan."""
    engine = EngineLoop(make_engine)
    tokenizer = served.tokenizer
    facts = ModelFacts(
        tokenizer=tokenizer,
        vocab_size=engine.vocab_size,
        max_prompt_tokens=engine.max_prompt_tokens,
        eos_ids=tuple(sorted(int(t) for t in getattr(tokenizer, "eos_token_ids", ()) or ())),
        default_max_tokens=default_max_tokens,
    )
    counters = Counters()
    created = int(time.time())

    async def serve(request: Request, parse: Callable[[Any, ModelFacts], Job]) -> Response:
        if not engine.alive:  # its submits would never be answered
            counters.failed += 1
            message = "the engine thread has stopped; restart the server"
            return JSONResponse(error_body(message, kind="server_error"), status_code=503)
        try:
            job = parse(await _json_body(request), facts)
            running = RunningJob(job, engine, tokenizer)
            try:
                await running.start()
            except BaseException:
                running.close()
                raise
        except BadRequest as error:
            counters.rejected += 1
            return _error(error)
        shaper = Shaper(running, served.name, tokenizer)
        if job.stream:
            return EventStream(_stream(running, shaper, counters))
        return await _whole(request.receive, running, shaper, counters)

    async def completions(request: Request) -> Response:
        return await serve(request, parse_completion)

    async def chat(request: Request) -> Response:
        return await serve(request, parse_chat)

    def model_card() -> dict[str, Any]:
        return {"id": served.name, "object": "model", "created": created, "owned_by": "kvstate"}

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [model_card()]})

    async def one_model(request: Request) -> Response:
        if request.path_params["model"] != served.name:
            return _error(
                BadRequest(
                    f"no model {request.path_params['model']!r}; this server serves "
                    f"{served.name!r}",
                    "model",
                    code="model_not_found",
                    status=404,
                )
            )
        return JSONResponse(model_card())

    async def health(request: Request) -> Response:
        if not engine.alive:
            return JSONResponse({"status": "engine thread stopped"}, status_code=503)
        return JSONResponse({"status": "ok", "model": served.name})

    async def status_json(request: Request) -> Response:
        return JSONResponse(status(served.name, engine.stats(), attrs.asdict(counters)))

    async def metrics(request: Request) -> Response:
        text = prometheus_text(engine.stats(), attrs.asdict(counters))
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            engine.stop()

    async def http_error(request: Request, error: Exception) -> Response:
        assert isinstance(error, HTTPException)
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        message = f"{error.detail}: {request.method} {request.url.path}"
        return JSONResponse(error_body(message, kind=kind), status_code=error.status_code)

    async def server_error(request: Request, error: Exception) -> Response:
        # Starlette logs the traceback after this answer; the server goes on.
        message = f"internal error: {type(error).__name__}: {error}"
        return JSONResponse(error_body(message, kind="server_error"), status_code=500)

    return Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/models/{model:path}", one_model, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/v1/status", status_json, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
        ],
        exception_handlers={HTTPException: http_error, Exception: server_error},
        lifespan=lifespan,
    )


async def _json_body(request: Request) -> Any:
    raw = await request.body()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise BadRequest(f"the request body is not valid JSON: {error}") from error


def _error(error: BadRequest) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


async def _stream(running: RunningJob, shaper: Shaper, counters: Counters) -> AsyncIterator[bytes]:
    """The job's SSE events; a disconnect closes this iterator (EventStream), and `finally`
    cancels what still runs."""
    finished = False
    try:
        for opening in shaper.first_chunks():
            yield event(opening)
        try:
            async for e in running.events():
                chunk = shaper.chunk(e)
                if chunk is not None:
                    yield event(chunk)
        except EngineFailure as error:
            counters.failed += 1
            yield event(error_body(str(error), kind="server_error"))
            finished = True
            return
        if running.job.include_usage:
            yield event(shaper.usage_chunk())
        yield DONE
        finished = True
        counters.completed += 1
    finally:
        if not finished:
            counters.disconnected += 1
        running.close()


async def _whole(
    receive: Receive, running: RunningJob, shaper: Shaper, counters: Counters
) -> Response:
    """The whole response, or, when the client leaves first, its requests cancelled at once."""

    async def collect() -> None:
        async for _ in running.events():
            pass

    collected = asyncio.ensure_future(collect())
    gone = asyncio.ensure_future(_disconnect(receive))
    try:
        await asyncio.wait({collected, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not collected.done():
            counters.disconnected += 1
            return Response(status_code=499)  # nobody reads it: the client has left
        try:
            collected.result()
        except EngineFailure as error:
            counters.failed += 1
            return JSONResponse(error_body(str(error), kind="server_error"), status_code=500)
        counters.completed += 1
        return JSONResponse(shaper.whole())
    finally:
        for task in (collected, gone):
            task.cancel()
        running.close()


async def _disconnect(receive: Receive) -> None:
    """Returns when the client disconnects (the body is read already: the server's next
    message is the disconnect)."""
    while (await receive())["type"] != "http.disconnect":
        pass
