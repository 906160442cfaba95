"""The model boundary: mlx-lm cache objects <-> kvstate states, `wrap(model)`, and
`load_model(name_or_path)` (the packaged real models, or an mlx-lm model directory).

mlx-vlm's caches and models: `kvstate.adapters.vlm` (imported on demand: `wrap` and
`from_mlx_lm` hand mlx-vlm objects to it; importing this package never imports mlx_vlm).
"""

from .caches import from_mlx_lm, to_mlx_lm
from .instruments.routing import route_attention
from .models.drafts import early_exit_draft, quantized_draft
from .models.loading import ModelNotInstalledError, load_model, model_cache
from .models.mtp_head import MTPHead
from .wrapped.model import WrappedModel
from .wrapped.options import wrap_options
from .wrapped.wrap import wrap

__all__ = [
    "MTPHead",
    "ModelNotInstalledError",
    "WrappedModel",
    "early_exit_draft",
    "from_mlx_lm",
    "load_model",
    "model_cache",
    "quantized_draft",
    "route_attention",
    "to_mlx_lm",
    "wrap",
    "wrap_options",
]
