"""The options both commands take, and what they build: the model, the drafter, the sampler
and `generate`'s keywords."""

from __future__ import annotations

import argparse
from typing import Any

from .. import StateError
from ..speculative import ModelDrafter, NGramDrafter, Sampler
from ..text import DEFAULT_MODEL, load_text_model


def add_model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        "-m",
        default=DEFAULT_MODEL,
        help="a packaged model's name (smollm2-135m, gemma3-270m), a local mlx-lm model "
        "directory or tiny:<architecture> (a random-init test model with a byte tokenizer). "
        f"Default: {DEFAULT_MODEL}",
    )
    p.add_argument(
        "--draft",
        help="speculative decoding: 'ngram' (prompt lookup), or a draft model (a local mlx-lm "
        "directory, a packaged name or tiny:<architecture>) of the target's vocabulary",
    )
    p.add_argument(
        "--num-draft-tokens", type=int, default=4, help="drafts per round at most (k; default 4)"
    )
    p.add_argument("--system", "--system-prompt", dest="system", help="a system message")
    p.add_argument("--quiet", "-q", action="store_true", help="print the text only, no summary")


def add_sampling_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256, help="tokens to generate at most")
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1: off)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: off)")
    p.add_argument("--min-p", type=float, default=0.0, help="min-p filter (0: off)")
    p.add_argument("--seed", type=int, default=0, help="the generation's seed (default 0)")
    p.add_argument("--kv-bits", type=int, help="quantize the KV cache to this many bits")
    p.add_argument("--kv-group-size", type=int, default=64, help="quantization group size")
    p.add_argument(
        "--quantized-kv-start",
        type=int,
        default=0,
        help="quantize the KV cache once it holds this many tokens (default 0: at once)",
    )
    p.add_argument("--max-kv-size", type=int, help="a rotating KV cache of this many tokens")
    p.add_argument(
        "--prefill-step-size", type=int, default=2048, help="prompt tokens per prefill chunk"
    )


def loaded_model(spec: str) -> tuple[Any, Any]:
    """(the wrapped target, its `TokenizerWrapper`) for `--model`."""
    from kvstate.adapters import wrap

    loaded = load_text_model(spec)
    return wrap(loaded.model), loaded.tokenizer


def drafter_of(spec: str | None) -> Any:
    """The drafter `--draft` names: None, an NGramDrafter or a ModelDrafter over a model."""
    if spec is None or spec == "none":
        return None
    if spec == "ngram":
        return NGramDrafter()
    from kvstate.adapters import wrap

    try:
        draft = load_text_model(spec).model
    except StateError as error:
        raise StateError(f"--draft: {error} (or give 'ngram' for prompt lookup)") from None
    return ModelDrafter(wrap(draft))


def generate_options(args: argparse.Namespace) -> dict[str, Any]:
    """`generate`'s keywords (through `stream_text` / `Chat`) from the options."""
    if args.num_draft_tokens < 1:
        raise StateError(f"--num-draft-tokens must be >= 1; got {args.num_draft_tokens}")
    try:
        sampler = Sampler(
            temperature=args.temp, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p
        )
    except StateError as error:  # name the options, not Sampler's fields
        raise StateError(
            f"{error} (--temp, --top-p, --top-k, --min-p: temperature >= 0, top-p in (0, 1], "
            "top-k >= 0, min-p in [0, 1])"
        ) from None
    options: dict[str, Any] = {
        "max_tokens": args.max_tokens,
        "sampler": sampler,
        "seed": args.seed,
        "k": args.num_draft_tokens,
        "prefill_step_size": args.prefill_step_size,
    }
    if args.kv_bits is not None:
        options |= {
            "kv_bits": args.kv_bits,
            "kv_group_size": args.kv_group_size,
            "quantized_kv_start": args.quantized_kv_start,
        }
    if args.max_kv_size is not None:
        options["max_kv_size"] = args.max_kv_size
    return options
