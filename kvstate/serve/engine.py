"""The engine the server drives: the one place it imports the engine from.

At merge this becomes `from kvstate.engine import Engine, Output, Request, RequestParams`
(the real, batched engine); until then the interim scaffolding stands in for it.
"""

from ._interim_engine import Engine, Output, Request, RequestParams

__all__ = ["Engine", "Output", "Request", "RequestParams"]
