"""An OpenAI-compatible HTTP server on kvstate's engine (the `serve` extra: starlette, uvicorn).

    kvstate-serve --model PATH|NAME|tiny:ARCH --port 8000     # or python -m kvstate.serve

`create_app(served, make_engine)` is the ASGI app (Starlette) for a `ServedModel`
(`load_served_model(spec)`). The app translates HTTP to engine calls and nothing more: one
engine thread drives `engine.step()` (`loop`), requests reach it through a thread-safe
inbox, outputs come back to each request's asyncio queue, and a client that disconnects
cancels its requests at once. Modules, one job each:

    cli        the command line                 loading    --model -> wrapped model + tokenizer
    app        routes and handlers              protocol   request bodies -> checked Jobs
    fields     one JSON field's check           prompts    chat template / fallback -> ids
    loop       the engine thread                jobs       a job's choices in flight
    text       detokenized text, stop strings   responses  OpenAI's response objects
    sse        server-sent events               metrics    /v1/status, /metrics
    errors     OpenAI-style errors              engine     where the engine comes from
"""

from .app import create_app
from .loading import ServedModel, load_served_model
from .prompts import FALLBACK_TEMPLATE

__all__ = ["FALLBACK_TEMPLATE", "ServedModel", "create_app", "load_served_model"]
