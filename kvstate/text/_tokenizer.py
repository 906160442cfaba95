"""Any tokenizer as mlx-lm's `TokenizerWrapper`, with the streaming detokenizer that fits it.

mlx-lm's `mlx_lm.tokenizer_utils.load` picks the detokenizer from a model folder's
`tokenizer.json` (its `decoder`): byte-level BPE -> `BPEStreamingDetokenizer`, SentencePiece
-> `SPMStreamingDetokenizer`, anything else -> `NaiveStreamingDetokenizer`. `text_tokenizer`
does the same from a tokenizer object: a `TokenizerWrapper` is taken as it is; a
`transformers` fast tokenizer is read from its backend; a `tokenizers.Tokenizer`, or an
object holding one as `backend` (the GGUF tokenizer of `kvstate.adapters.real_models`, with
its `bos_token_id` / `eos_token_id` / `chat_template`), becomes a transformers
`PreTrainedTokenizerFast` first. Each of those detokenizers holds back a multi-byte
character until its last byte has come, so streamed text never holds a partial one.
"""

from __future__ import annotations

import json
from functools import partial
from typing import Any

from mlx_lm.tokenizer_utils import (
    BPEStreamingDetokenizer,
    NaiveStreamingDetokenizer,
    SPMStreamingDetokenizer,
    TokenizerWrapper,
)
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from .. import StateError

_SPM_STEPS = [
    {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
    {"type": "ByteFallback"},
    {"type": "Fuse"},
]
_SPM_STRIP = {"type": "Strip", "content": " ", "start": 1, "stop": 0}


def text_tokenizer(tokenizer: Any) -> TokenizerWrapper:
    """`tokenizer` as an mlx-lm `TokenizerWrapper` with its streaming detokenizer (see the
    module docstring). Raises a StateError for anything else."""
    if isinstance(tokenizer, TokenizerWrapper):
        return tokenizer
    if isinstance(tokenizer, PreTrainedTokenizerBase):
        hf = tokenizer
    elif isinstance(tokenizer, Tokenizer):
        hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer)
    elif isinstance(getattr(tokenizer, "backend", None), Tokenizer):
        hf = _from_backend(tokenizer)
    else:
        raise StateError(
            f"text_tokenizer: expected a transformers tokenizer, an mlx-lm TokenizerWrapper "
            f"(mlx_lm.load's), a tokenizers.Tokenizer or kvstate.adapters.real_models' GGUF "
            f"tokenizer; got a {type(tokenizer).__name__}"
        )
    return TokenizerWrapper(hf, detokenizer_class(hf))


def _from_backend(tokenizer: Any) -> PreTrainedTokenizerFast:
    """A tokenizer holding a `tokenizers.Tokenizer` as `backend` (the GGUF one), as a
    transformers fast tokenizer with its special tokens and chat template."""
    backend: Tokenizer = tokenizer.backend
    names = {}
    for role in ("bos", "eos"):
        token_id = getattr(tokenizer, f"{role}_token_id", None)
        if token_id is not None:
            names[f"{role}_token"] = backend.id_to_token(int(token_id))
    hf = PreTrainedTokenizerFast(tokenizer_object=backend, **names)
    template = getattr(tokenizer, "chat_template", None)
    if template is not None:
        hf.chat_template = template
    return hf


def detokenizer_class(tokenizer: PreTrainedTokenizerBase) -> Any:
    """The mlx-lm streaming detokenizer class for `tokenizer`, from its backend's decoder
    (as `mlx_lm.tokenizer_utils.load` reads it from tokenizer.json)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not isinstance(backend, Tokenizer):
        return NaiveStreamingDetokenizer
    decoder = json.loads(backend.to_str()).get("decoder")
    if not isinstance(decoder, dict):
        return NaiveStreamingDetokenizer
    if decoder.get("type") == "ByteLevel":
        return BPEStreamingDetokenizer
    steps = decoder.get("decoders") if decoder.get("type") == "Sequence" else None
    if steps == [*_SPM_STEPS, _SPM_STRIP]:
        return SPMStreamingDetokenizer
    if steps == _SPM_STEPS:
        return partial(SPMStreamingDetokenizer, trim_space=False)
    return NaiveStreamingDetokenizer
