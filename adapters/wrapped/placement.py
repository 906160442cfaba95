"""Which part of a distributed mlx-lm model this process runs, read off the model itself.

mlx-lm splits a model in place: `model.shard(group)` swaps linear layers for mlx's
`AllToShardedLinear` / `ShardedToAllLinear` (which keep their group) or marks modules with a
`sharding_group`; `model.model.pipeline(group)` sets `pipeline_rank`, `pipeline_size`,
`start_idx` and `end_idx` on the inner model (its `Model.layers` then lists only this rank's
layers, and so does its `make_cache`). Nothing else is needed: wrap the model after splitting.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import (
    AllToShardedLinear,
    QuantizedAllToShardedLinear,
    QuantizedShardedToAllLinear,
    ShardedToAllLinear,
)

from kvstate import NotSupportedError
from kvstate.distributed import Placement

_SHARDED = (
    AllToShardedLinear,
    ShardedToAllLinear,
    QuantizedAllToShardedLinear,
    QuantizedShardedToAllLinear,
)


def model_placement(model: nn.Module) -> tuple[Placement | None, Any]:
    """(this process's placement, its group) for a split model; (None, None) for a whole one."""
    tensor_group, pipeline = None, None
    for _, module in model.named_modules():
        if isinstance(module, _SHARDED):
            tensor_group = tensor_group or module.group
        group = getattr(module, "sharding_group", None)
        if isinstance(group, mx.distributed.Group):
            tensor_group = tensor_group or group
        if getattr(module, "pipeline_size", 1) > 1:
            pipeline = module
    if tensor_group is not None and tensor_group.size() == 1:
        tensor_group = None
    if tensor_group is not None and pipeline is not None:
        raise NotSupportedError(
            "wrap: this model is both tensor-sharded and pipelined; kvstate supports one of "
            "the two per model (shard(group) or pipeline(group))"
        )
    if tensor_group is not None:
        return Placement("tensor", tensor_group.rank(), tensor_group.size()), tensor_group
    if pipeline is None:
        return None, None
    start = int(pipeline.start_idx)
    stop = int(pipeline.end_idx if pipeline.end_idx is not None else len(pipeline.layers))
    placed = Placement(
        "pipeline",
        int(pipeline.pipeline_rank),
        int(pipeline.pipeline_size),
        (start, stop),
        _layer_count(model),
    )
    # mlx-lm's pipeline sends and receives over the global group.
    return placed, mx.distributed.init()


def _layer_count(model: nn.Module) -> int | None:
    args = getattr(model, "args", None)
    count = getattr(args, "num_hidden_layers", None)
    if count is None:
        count = (getattr(args, "text_config", None) or {}).get("num_hidden_layers")
    return int(count) if isinstance(count, int) else None
