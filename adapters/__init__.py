"""The model boundary: mlx-lm cache objects <-> kvstate states, and `wrap(model)`.

mlx-vlm's caches and models: `kvstate.adapters.vlm` (imported on demand: `wrap` and
`from_mlx_lm` hand mlx-vlm objects to it; importing this package never imports mlx_vlm).
"""

from .caches import from_mlx_lm, to_mlx_lm
from .instruments.routing import route_attention
from .models.mtp_head import MTPHead
from .wrapped.model import WrappedModel
from .wrapped.options import wrap_options
from .wrapped.wrap import wrap

__all__ = [
    "MTPHead",
    "WrappedModel",
    "from_mlx_lm",
    "route_attention",
    "to_mlx_lm",
    "wrap",
    "wrap_options",
]
