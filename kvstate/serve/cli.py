"""`kvstate-serve` / `python -m kvstate.serve`: load a model, build the engine, serve HTTP.

    kvstate-serve --model tiny:llama --port 8000
    kvstate-serve --model /path/to/mlx-model --max-batch 16 --draft ngram
    kvstate-serve                                   # the packaged SmolLM2-135M

`kvstate-serve --help` lists the options.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from kvstate import StateError

from .app import create_app
from .engine import Engine
from .loading import DEFAULT_MODEL, load_served_model


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvstate-serve",
        description="An OpenAI-compatible HTTP server on kvstate's engine.",
    )
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="a local mlx-lm model directory, a packaged model's name (smollm2-135m, "
        "gemma3-270m) or tiny:<architecture> (a random-init test model with a byte "
        f"tokenizer). Default: {DEFAULT_MODEL}",
    )
    p.add_argument("--served-model-name", help="the model id clients see (default: --model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-batch", type=int, default=32, help="requests decoded at once")
    p.add_argument("--prefill-chunk", type=int, default=512, help="prompt tokens per prefill step")
    p.add_argument(
        "--prefix-cache-mb", type=float, default=0.0, help="prefix cache bound in MiB (0: off)"
    )
    p.add_argument("--kv-bits", type=int, choices=(4, 8), help="quantize the KV cache")
    p.add_argument("--draft", choices=("none", "ngram"), default="none", help="the drafter")
    p.add_argument("--num-draft", type=int, default=4, help="drafts per round at most (k)")
    p.add_argument("--seed", type=int, default=0, help="the engine's seed for unseeded requests")
    p.add_argument(
        "--max-tokens", type=int, default=256, help="a request's max_tokens when it gives none"
    )
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    return p


def main(argv: Sequence[str] | None = None) -> None:
    import uvicorn

    args = parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s: %(message)s")
    try:
        served = load_served_model(args.model, name=args.served_model_name)

        def make_engine() -> Engine:
            return Engine(
                served.target,
                None if args.draft == "none" else args.draft,
                max_batch=args.max_batch,
                prefill_chunk=args.prefill_chunk,
                prefix_cache_bytes=int(args.prefix_cache_mb * 2**20),
                kv_bits=args.kv_bits,
                k=args.num_draft,
                seed=args.seed,
            )

        app = create_app(served, make_engine, default_max_tokens=args.max_tokens)
    except StateError as error:
        print(f"kvstate-serve: {error}", file=sys.stderr)
        raise SystemExit(2) from error
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
