"""A serving engine on kvstate: continuous batching with speculative decoding and an exact
prefix cache, over every model `kvstate.adapters.wrap` takes.

    from kvstate.adapters import wrap
    from kvstate.engine import Engine, RequestParams

    engine = Engine(wrap(model), "ngram", max_batch=32, prefix_cache_bytes=2**30)
    request = engine.submit(prompt_ids, RequestParams(max_tokens=64, temperature=0.7))
    while engine.has_work():
        for out in engine.step():
            print(out.request.id, out.tokens, out.finish_reason)

Requests arrive and leave at any step; each step admits, prefills a bounded chunk, runs one
round (plain or speculative, ragged) for every running row, retires finished and cancelled
rows and joins the prefilled ones (`Engine`'s module docstring has the order). Built on
`kvstate.speculative` and the core transforms; no threads (drive it from one).
"""

from ._engine import Engine
from ._params import Output, Request, RequestParams
from ._prefix_cache import PrefixCache

__all__ = ["Engine", "Output", "PrefixCache", "Request", "RequestParams"]
