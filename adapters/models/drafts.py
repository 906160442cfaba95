"""Draft models made from the target's own checkpoint: self-speculation with one set of weights
and one tokenizer.

    from kvstate.adapters import early_exit_draft, load_model, quantized_draft, wrap
    from kvstate.speculative import ModelDrafter

    target, tokenizer = load_model("gemma3-270m", dtype="bfloat16")
    drafter = ModelDrafter(wrap(quantized_draft(target, bits=4)))  # or
    drafter = ModelDrafter(wrap(early_exit_draft(target, layers=6)))

Both are new mlx-lm model objects of the target's class; they share the target's arrays where
they keep them as they are (MLX arrays are values: nothing a forward does changes them), so
an early-exit draft costs no memory and a quantized one only its packed matrices.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import mlx.nn as nn
from mlx.utils import tree_flatten

from kvstate import StateError


def _rebuilt(model: nn.Module, args: Any, weights: dict[str, Any]) -> nn.Module:
    """A model of `model`'s class from `args`, holding `weights`; the modules the target holds
    quantized are built quantized the same way (their packed arrays are among `weights`)."""
    model_class: Any = type(model)  # mlx-lm's Model(args)
    draft: nn.Module = model_class(args)
    modules = dict(model.named_modules())
    quantized = {name.removesuffix(".scales") for name in weights if name.endswith(".scales")}

    def spec(path: str, _: nn.Module) -> Any:
        if path not in quantized:
            return False
        m = modules[path]
        return {"group_size": m.group_size, "bits": m.bits, "mode": getattr(m, "mode", "affine")}

    if quantized:
        nn.quantize(draft, class_predicate=spec)
    if hasattr(draft, "sanitize"):
        weights = draft.sanitize(dict(weights))  # e.g. drops a tied lm_head
    draft.load_weights(list(weights.items()), strict=True)
    draft.eval()
    return draft


def quantized_draft(model: nn.Module, bits: int = 4, group_size: int = 64) -> nn.Module:
    """A copy of `model` with its linear and embedding layers quantized by `nn.quantize`
    (`bits`, `group_size`; affine). The target should be a float model (bf16 / fp16 / fp32):
    layers it already holds quantized stay as they are."""
    weights = dict(tree_flatten(model.parameters()))
    draft = _rebuilt(model, model.args, weights)
    nn.quantize(draft, group_size=group_size, bits=bits)
    return draft


def early_exit_draft(model: nn.Module, layers: int) -> nn.Module:
    """The first `layers` transformer blocks of `model`, then its final norm and output head
    (an early exit, sharing the target's arrays). Gemma 3 needs `layers` >= its
    `sliding_window_pattern` (6): its mask is built from the first global layer's cache."""
    args = model.args
    total = int(args.num_hidden_layers)
    if not 0 < layers < total:
        raise StateError(f"early_exit_draft: layers must be in [1, {total}); got {layers}")
    pattern = getattr(args, "sliding_window_pattern", None)
    if pattern is not None and layers < pattern:
        raise StateError(
            f"early_exit_draft: a {args.model_type} model needs at least its "
            f"sliding_window_pattern ({pattern}) layers; got {layers}"
        )
    changes: dict[str, Any] = {"num_hidden_layers": layers}
    if isinstance(getattr(args, "layer_types", None), list):
        changes["layer_types"] = args.layer_types[:layers]
    kept = {
        name: w
        for name, w in dict(tree_flatten(model.parameters())).items()
        if not (name.startswith("model.layers.") and int(name.split(".")[2]) >= layers)
    }
    return _rebuilt(model, dataclasses.replace(args, **changes), kept)
