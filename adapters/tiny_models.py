"""Small random-init mlx-lm models built in code (no downloads), for tests, demos and
benchmarks: `tiny_model(name)` for a key of `CONFIGS`, every one of vocabulary `VOCAB`, and
`byte_tokenizer()`, whose ids are the 256 bytes, for text in and out of them.
(Defined in `kvstate.adapters.models.tiny` and `kvstate.adapters.models.byte_tokenizer`.)"""

from .models.byte_tokenizer import byte_tokenizer
from .models.tiny import CONFIGS, VOCAB, tiny_model

__all__ = ["CONFIGS", "VOCAB", "byte_tokenizer", "tiny_model"]
