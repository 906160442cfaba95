"""Small random-init mlx-lm models built in code (no downloads), for tests, demos and benchmarks.

Random-init models tend to repeat one token under greedy decoding; scaling the weight
matrices up (x4) spreads the logits enough for greedy-token comparisons to mean something.
"""

from __future__ import annotations

import importlib
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

VOCAB = 256

_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}

CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {**_COMMON, "model_type": "llama", "head_dim": 16},
    "qwen3": {**_COMMON, "model_type": "qwen3", "head_dim": 16, "rope_theta": 10000.0},
    "gemma3_text": {
        **_COMMON,
        "model_type": "gemma3_text",
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "sliding_window": 8,
        "sliding_window_pattern": 2,
        "num_hidden_layers": 4,
    },
    "qwen3_next": {
        **_COMMON,
        "model_type": "qwen3_next",
        "head_dim": 16,
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "shared_expert_intermediate_size": 64,
        "mlp_only_layers": [],
        "moe_intermediate_size": 32,
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
        "full_attention_interval": 2,
    },
    "mamba2": {
        "model_type": "mamba2",
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_heads": 8,
        "head_dim": 16,
        "state_size": 16,
        "num_hidden_layers": 3,
        "layer_norm_epsilon": 1e-5,
        "conv_kernel": 4,
        "n_groups": 2,
        "use_bias": False,
        "use_conv_bias": True,
        "tie_word_embeddings": False,
        "time_step_limit": (0.0, float("inf")),
        "time_step_rank": "auto",
    },
    "nemotron_h": {
        "model_type": "nemotron_h",
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "max_position_embeddings": 4096,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "attention_bias": False,
        "mamba_num_heads": 8,
        "mamba_head_dim": 16,
        "mamba_proj_bias": False,
        "ssm_state_size": 16,
        "conv_kernel": 4,
        "n_groups": 2,
        "mlp_bias": False,
        "layer_norm_epsilon": 1e-5,
        "use_bias": False,
        "use_conv_bias": True,
        "hybrid_override_pattern": ["M", "*", "M", "-"],
        "tie_word_embeddings": False,
    },
    "falcon_h1": {
        "model_type": "falcon_h1",
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "mamba_d_conv": 4,
        "mamba_d_head": 16,
        "mamba_d_ssm": 128,
        "mamba_d_state": 16,
        "mamba_n_groups": 1,
        "mamba_n_heads": 8,
        "mamba_chunk_size": 16,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    },
    "lfm2": {
        "model_type": "lfm2",
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "norm_eps": 1e-5,
        "conv_bias": False,
        "conv_L_cache": 3,
        "block_dim": 64,
        "block_ff_dim": 128,
        "block_multiple_of": 16,
        "block_ffn_dim_multiplier": 1.0,
        "block_auto_adjust_ff_dim": False,
        "full_attn_idxs": [1, 3],
    },
}


def tiny_model(
    name: str, *, seed: int = 0, scale: float = 4.0, dtype: mx.Dtype = mx.float32, **overrides: Any
) -> nn.Module:
    """A random-init model of mlx-lm architecture `name` (a key of CONFIGS), evaluated."""
    config = {**CONFIGS[name], **overrides}
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    args = module.ModelArgs.from_dict(config)
    mx.random.seed(seed)
    model = module.Model(args)
    params: list[tuple[str, mx.array]] = tree_flatten(model.parameters())  # type: ignore[assignment]
    scaled = [
        (k, (v * scale if v.ndim >= 2 and "norm" not in k else v).astype(dtype)) for k, v in params
    ]
    model.update(tree_unflatten(scaled))
    mx.eval(model.parameters())
    return model
