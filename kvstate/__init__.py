"""kvstate: functional, immutable LLM cache state for MLX.

States are frozen attrs pytrees (batch-leading arrays + hashable statics); transforms are
pure functions. Convert to and from mlx-lm caches with `kvstate.adapters`.
"""

# Importing the kind modules registers their transforms.
from . import _chunked, _dense, _quantized, _recurrent, _rotating  # noqa: F401
from ._errors import (
    CheckpointRequiredError,
    CommitError,
    ConfigMismatchError,
    FileFormatError,
    RowError,
    ShapeError,
    StateError,
)
from ._io import load, save
from ._quantized import quantize
from ._states import (
    ChunkedKV,
    DenseKV,
    LayerState,
    ListState,
    ModelState,
    QuantizedKV,
    RecurrentState,
    RotatingKV,
    State,
)
from ._transforms import (
    batch_size,
    commit_prefix,
    extend,
    extract,
    filter,
    merge,
    row_select,
    snapshot,
    tile,
)
from ._tree import eval, nbytes, static_field, tree_flatten, tree_map, tree_unflatten

__all__ = [
    "CheckpointRequiredError",
    "ChunkedKV",
    "CommitError",
    "ConfigMismatchError",
    "DenseKV",
    "FileFormatError",
    "LayerState",
    "ListState",
    "ModelState",
    "QuantizedKV",
    "RecurrentState",
    "RotatingKV",
    "RowError",
    "ShapeError",
    "State",
    "StateError",
    "batch_size",
    "commit_prefix",
    "eval",
    "extend",
    "extract",
    "filter",
    "load",
    "merge",
    "nbytes",
    "quantize",
    "row_select",
    "save",
    "snapshot",
    "static_field",
    "tile",
    "tree_flatten",
    "tree_map",
    "tree_unflatten",
]
