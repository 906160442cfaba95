"""The model a server serves: a wrapped target and its tokenizer, from one `--model` value.

    served = load_served_model("tiny:llama")          # a random-init test model, byte tokenizer
    served = load_served_model("/path/to/mlx-model")  # a local mlx-lm model directory
    served = load_served_model("smollm2-135m")        # packaged

The spec is resolved where the CLI resolves it too (`kvstate.text.load_text_model`); this
module only wraps the model and names it.
"""

from __future__ import annotations

from typing import Any

import attrs

import kvstate.adapters
from kvstate.text import DEFAULT_MODEL, TINY, load_text_model

__all__ = ["DEFAULT_MODEL", "TINY", "ServedModel", "load_served_model"]


@attrs.frozen
class ServedModel:
    """`name`: the model id the server reports (`/v1/models`, each response's `model`);
    `target`: the wrapped model (`kvstate.adapters.wrap`); `tokenizer`: mlx-lm's
    `TokenizerWrapper` or anything with its `encode`, `decode`, `detokenizer`,
    `eos_token_ids`, `has_chat_template` and `apply_chat_template`."""

    name: str
    target: Any
    tokenizer: Any


def load_served_model(spec: str, *, name: str | None = None) -> ServedModel:
    """The model `spec` names (see `kvstate.text.load_text_model`: "tiny:<architecture>", a
    local mlx-lm model directory, or a packaged model's name). `name` overrides the id the
    server reports (default: `spec`). A StateError says what is wrong with `spec` and what
    would be accepted."""
    loaded = load_text_model(spec)
    return ServedModel(name or spec, kvstate.adapters.wrap(loaded.model), loaded.tokenizer)
