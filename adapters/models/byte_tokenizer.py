"""A byte-level tokenizer for the tiny models (vocabulary `VOCAB` = 256): id i is byte i.

    from kvstate.adapters.tiny_models import byte_tokenizer
    tokenizer = byte_tokenizer()
    tokenizer.encode("héllo")        # [104, 195, 169, 108, 108, 111]: the UTF-8 bytes
    detokenizer = tokenizer.detokenizer  # mlx-lm's BPE streaming detokenizer

It is mlx-lm's `TokenizerWrapper` around a Hugging Face fast tokenizer (byte-level BPE with
no merges, the 256 bytes spelled in GPT-2's byte alphabet), so text goes through the same
code as a real byte-level BPE model's: `encode`, `decode`, `eos_token_ids` (none),
`detokenizer` (`BPEStreamingDetokenizer`, which holds back an incomplete UTF-8 character).
It has no chat template and no special tokens: every id of a tiny model is a byte.
"""

from __future__ import annotations

from typing import Any


def byte_tokenizer() -> Any:
    """mlx-lm's `TokenizerWrapper` over the 256-byte tokenizer (id == byte value)."""
    # Imported here: transformers takes a second or two to import, and only text needs it.
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, TokenizerWrapper
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # GPT-2's byte alphabet: the printable bytes stand for themselves, the others for
    # chr(256 + n), as byte-level BPE vocabularies spell them.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    spelled, n = {}, 0
    for b in range(256):
        if b in printable:
            spelled[b] = chr(b)
        else:
            spelled[b] = chr(256 + n)
            n += 1
    backend = Tokenizer(models.BPE(vocab={c: b for b, c in spelled.items()}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return TokenizerWrapper(
        PreTrainedTokenizerFast(tokenizer_object=backend), BPEStreamingDetokenizer
    )
