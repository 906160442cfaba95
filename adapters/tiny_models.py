"""Small random-init mlx-lm models built in code (no downloads), for tests, demos and
benchmarks: `tiny_model(name)` for a key of `CONFIGS`, every one of vocabulary `VOCAB`.
(Defined in `kvstate.adapters.models.tiny`.)"""

from .models.tiny import CONFIGS, VOCAB, tiny_model

__all__ = ["CONFIGS", "VOCAB", "tiny_model"]
