"""The engine the server drives: the one place it imports the engine from."""

from kvstate.engine import Engine, Output, Request, RequestParams

__all__ = ["Engine", "Output", "Request", "RequestParams"]
