"""Tiny random-init mlx-vlm models built in code, and mlx-vlm's own generation as the oracle.

Importing this module imports mlx_vlm: test modules import it after
`pytest.importorskip("mlx_vlm")`.
"""

from __future__ import annotations

import importlib
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten
from mlx_vlm.generate.ar import generate_step
from mlx_vlm.models import llava
from mlx_vlm.models.cache import make_prompt_cache

from kvstate.adapters.tiny_models import CONFIGS, VOCAB

IMAGE_TOKEN = VOCAB - 1  # inside the vocabulary: the embedding lookup runs before the merge
IMAGE_SIZE, PATCH = 28, 14
IMAGE_TOKENS = (IMAGE_SIZE // PATCH) ** 2  # llava's "default" strategy drops the CLS feature


def _scaled(model: nn.Module, seed: int, scale: float) -> nn.Module:
    """Random init under `seed`, weight matrices scaled up so greedy tokens vary."""
    params: list[tuple[str, mx.array]] = tree_flatten(model.parameters())  # type: ignore[assignment]
    model.update(
        tree_unflatten(
            [(k, v * scale if v.ndim >= 2 and "norm" not in k else v) for k, v in params]
        )
    )
    mx.eval(model.parameters())
    return model


def tiny_vlm(name: str, *, seed: int = 0, scale: float = 4.0) -> nn.Module:
    """mlx-vlm's model of architecture `name`, with the configuration of kvstate's tiny
    mlx-lm model of that name (`kvstate.adapters.tiny_models.CONFIGS`)."""
    config = CONFIGS[name]
    module = importlib.import_module(f"mlx_vlm.models.{config['model_type']}")
    mx.random.seed(seed)
    return _scaled(module.Model(module.ModelConfig.from_dict(config)), seed, scale)


def tiny_llava(*, seed: int = 0, scale: float = 4.0) -> nn.Module:
    """A llava: a 2-layer CLIP vision tower (28x28 images, 4 patches), a projector and a
    2-layer llama, random-init."""
    text = {
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": VOCAB,
        "rms_norm_eps": 1e-5,
    }
    vision = {
        "model_type": "clip_vision_model",
        "num_hidden_layers": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_attention_heads": 2,
        "image_size": IMAGE_SIZE,
        "patch_size": PATCH,
        "projection_dim": 32,
    }
    config = llava.ModelConfig.from_dict(
        {
            "model_type": "llava",
            "image_token_index": IMAGE_TOKEN,
            "vocab_size": VOCAB,
            "vision_feature_layer": -2,
            "text_config": llava.TextConfig.from_dict(text),
            "vision_config": llava.VisionConfig.from_dict(vision),
        }
    )
    mx.random.seed(seed)
    return _scaled(llava.Model(config), seed, scale)


def random_image(seed: int = 1) -> mx.array:
    """(1, 3, H, W) pixel values, as mlx-vlm's processors hand them to the model."""
    return mx.random.normal((1, 3, IMAGE_SIZE, IMAGE_SIZE), key=mx.random.key(seed))


def vlm_generate(
    model: nn.Module, prompt: list[int], n: int, pixel_values: Any = None
) -> tuple[list[int], list[mx.array]]:
    """mlx-vlm's own greedy generation (`generate_step`, what `generate` and
    `stream_generate` run): the tokens and each step's log-probabilities."""
    tokens, logprobs = [], []
    for token, lp in generate_step(
        mx.array([prompt]), model, pixel_values, None, max_tokens=n, temperature=0.0
    ):
        tokens.append(int(token))
        logprobs.append(lp)
    return tokens, logprobs


def vlm_logits(
    model: nn.Module, chunks: list[list[int]], pixel_values: Any = None
) -> list[mx.array]:
    """Logits of mlx-vlm's language model on its own caches, fed `chunks` in turn; the first
    chunk's embeddings come from `get_input_embeddings` (with the image), as in generate."""
    caches = make_prompt_cache(model.language_model)
    first = mx.array([chunks[0]])
    features = model.get_input_embeddings(first, pixel_values, mask=None)
    extra = {k: v for k, v in features.to_dict().items() if k != "inputs_embeds" and v is not None}
    out = [
        model.language_model(
            first, inputs_embeds=features.inputs_embeds, cache=caches, **extra
        ).logits
    ]
    for chunk in chunks[1:]:
        out.append(model.language_model(mx.array([chunk]), cache=caches).logits)
    return out


def tiny_qwen2_vl(*, seed: int = 0, scale: float = 4.0) -> nn.Module:
    """A qwen2_vl (mRoPE language model, one-block vision tower), random-init. Its language
    model keeps the last prompt's `_position_ids` / `_rope_deltas` on itself."""
    from mlx_vlm.models import qwen2_vl

    vision = qwen2_vl.VisionConfig.from_dict(
        {
            "depth": 1,
            "embed_dim": 32,
            "hidden_size": 64,
            "num_heads": 2,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        }
    )
    config = qwen2_vl.ModelConfig.from_dict(
        {
            "model_type": "qwen2_vl",
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "intermediate_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "rms_norm_eps": 1e-5,
            "vocab_size": VOCAB,
            "image_token_id": VOCAB - 6,
            "video_token_id": VOCAB - 5,
            "vision_start_token_id": VOCAB - 4,
            "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
            "vision_config": vision,
        }
    )
    config.text_config = qwen2_vl.TextConfig.from_dict(config.text_config)
    mx.random.seed(seed)
    return _scaled(qwen2_vl.Model(config), seed, scale)


def greedy_side_by_side(
    wrapped: Any, state: Any, lm: nn.Module, caches: list[Any], first: int, steps: int
) -> tuple[list[int], list[int]]:
    """Greedy tokens through `wrapped` from `state` and through mlx-vlm's language model `lm`
    on its own `caches` (the oracle), both starting from token `first`."""
    ours, theirs = [first], [first]
    for _ in range(steps):
        logits, state = wrapped(mx.array([[ours[-1]]]), state)
        ours.append(int(mx.argmax(logits[0, -1]).item()))
        reference = lm(mx.array([[theirs[-1]]]), cache=caches).logits
        theirs.append(int(mx.argmax(reference[0, -1]).item()))
    return ours, theirs
