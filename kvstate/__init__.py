"""kvstate: functional, immutable LLM cache state for MLX.

States are frozen attrs pytrees (batch-leading arrays + hashable statics); transforms are
pure functions. Convert to and from mlx-lm caches with `kvstate.adapters`; declare a new
kind of state with `kvstate.kinds`.
"""

# Importing the kind modules registers them (`kvstate.kinds.kinds()` lists them).
from ._buffered_window import BufferedWindowKV
from ._checkpoints import ConvWindow, StepStates, checkpoint_at
from ._chunked import ChunkedKV
from ._composite import ListState, ModelState
from ._dense import DenseKV
from ._errors import (
    CheckpointRequiredError,
    CommitError,
    ConfigMismatchError,
    DivergenceError,
    FileFormatError,
    NotSupportedError,
    PlacementError,
    RowError,
    ShapeError,
    StateError,
    TokenError,
)
from ._io import load, save
from ._pooled import PooledKV
from ._quantize import quantize
from ._quantized import QuantizedKV, packed_width
from ._quantized_attention import quantized_attention
from ._quantized_rotating import QuantizedRotatingKV
from ._recurrent import RecurrentState
from ._rotating import RotatingKV
from ._static_prefix import StaticPrefixKV
from ._transforms import (
    batch_size,
    capabilities,
    commit_prefix,
    extend,
    extract,
    filter,
    merge,
    row_select,
    snapshot,
    tile,
)
from ._tree import State, eval, nbytes, tree_flatten, tree_map
from ._turboquant import TurboQuantKV
from ._validation import check, tree_unflatten
from .kinds import Capabilities

__all__ = [
    "BufferedWindowKV",
    "Capabilities",
    "CheckpointRequiredError",
    "ChunkedKV",
    "CommitError",
    "ConfigMismatchError",
    "ConvWindow",
    "DenseKV",
    "DivergenceError",
    "FileFormatError",
    "ListState",
    "ModelState",
    "NotSupportedError",
    "PlacementError",
    "PooledKV",
    "QuantizedKV",
    "QuantizedRotatingKV",
    "RecurrentState",
    "RotatingKV",
    "RowError",
    "ShapeError",
    "State",
    "StateError",
    "StaticPrefixKV",
    "StepStates",
    "TokenError",
    "TurboQuantKV",
    "batch_size",
    "capabilities",
    "check",
    "checkpoint_at",
    "commit_prefix",
    "eval",
    "extend",
    "extract",
    "filter",
    "load",
    "merge",
    "nbytes",
    "packed_width",
    "quantize",
    "quantized_attention",
    "row_select",
    "save",
    "snapshot",
    "tile",
    "tree_flatten",
    "tree_map",
    "tree_unflatten",
]
