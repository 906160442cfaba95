"""The model boundary: mlx-lm cache objects <-> kvstate states, and `wrap(model)`."""

from . import _dense  # noqa: F401  (registers KVCache / BatchKVCache / ConcatenateKVCache)
from ._convert import from_mlx_lm, to_mlx_lm
from ._wrap import WrappedModel, wrap

__all__ = ["WrappedModel", "from_mlx_lm", "to_mlx_lm", "wrap"]
