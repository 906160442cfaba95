"""A DeepSeek-V3-style multi-token-prediction head for any mlx-lm model, as a draft head for
`kvstate.speculative.MTPDrafter`.

    head(hidden (B, K, D), tokens (B, K), state) -> (logits, hidden, state)

Position i of the head takes the target's final hidden state at i - 1 and token i, and
predicts token i + 1 (DeepSeek-V3, section 2.2):

    x = eh_proj(enorm(embed(token)) ++ hnorm(hidden))        (2D -> D)
    h = the target's architecture, its first N layers         (own weights, random init)
    hidden_out = the target's final norm (h); logits = the target's output projection

The embedding, final norm and output projection are the target's own modules (shared, not
copied). N is the fewest layers the architecture's own forward accepts (1 for llama or
mamba2; 2 for hybrids whose forward needs one layer of each kind, e.g. qwen3_next's linear
and full attention), so the head is a small model of the target's class and runs through
`wrap`: its state is a kvstate state, rolled back by `commit_prefix` (capture=True) like the
target's.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.cache import make_prompt_cache

from kvstate import ModelState, NotSupportedError, ShapeError, StateError, TokenError

from ..instruments.hidden import hidden_states, output_projections, recording_hidden
from ..wrapped.wrap import wrap

_LAYER = re.compile(r"(^|\.)layers\.\d+(\.|$)")
_FED: ContextVar[mx.array | None] = ContextVar("kvstate_mtp_hidden", default=None)


class FusedInput(nn.Module):
    """Stands in for the head's embedding: eh_proj(enorm(embed(ids)) ++ hnorm(hidden)), the
    hidden states being those `feeding` gives for the length of one forward (zeros when
    none: the shape probe `wrap` runs). `as_linear` is the embedding's (tied heads)."""

    def __init__(self, embedding: nn.Module, dims: int, eps: float, dtype: mx.Dtype) -> None:
        super().__init__()
        self.enorm = nn.RMSNorm(dims, eps=eps)
        self.hnorm = nn.RMSNorm(dims, eps=eps)
        self.eh_proj = nn.Linear(2 * dims, dims, bias=False)
        self.set_dtype(dtype)  # before the embedding joins: the target's module stays as it is
        self.embedding = embedding

    def __call__(self, ids: mx.array) -> mx.array:
        embedded = self.embedding(ids)
        hidden = _FED.get()
        if hidden is None:
            hidden = mx.zeros(embedded.shape, embedded.dtype)
        joined = mx.concatenate([self.enorm(embedded), self.hnorm(hidden)], axis=-1)
        return self.eh_proj(joined)

    def as_linear(self, x: mx.array) -> mx.array:
        return self.embedding.as_linear(x)


@contextmanager
def feeding(hidden: mx.array) -> Iterator[None]:
    token = _FED.set(hidden)
    try:
        yield
    finally:
        _FED.reset(token)


class MTPHead(nn.Module):
    """A draft head for `target_model` (an mlx-lm model), sharing its embedding, final norm
    and output projection. `trainable_parameters()` are the head's own: the fusion (norms,
    eh_proj) and its layers. `layers`: how many of the architecture's first layers to use
    (default: the fewest its forward accepts)."""

    _fused: str  # the path of the FusedInput

    def __init__(self, target_model: nn.Module, layers: int | None = None) -> None:
        super().__init__()
        args = getattr(target_model, "args", None)
        if not dataclasses.is_dataclass(args) or not hasattr(args, "num_hidden_layers"):
            raise NotSupportedError(
                f"MTPHead: {type(target_model).__name__} has no mlx-lm `args` dataclass with "
                "num_hidden_layers; build the head's block yourself (any module with the "
                "DraftHead call) instead"
            )
        self.inner = _smallest_model(target_model, args, layers)
        _share_outer_modules(self.inner, target_model)
        self._fused = "inner." + _fuse_embedding(self.inner, args) + "."
        self._wrapped = wrap(self.inner)
        self.vocab_size = self._wrapped.vocab_size  # wrap's shape probe, run before any feeding
        self.hidden_size = int(
            cast(Any, args).hidden_size
        )  # the width of the hidden states it takes

    def init_state(self, batch_size: int = 1) -> ModelState:
        return self._wrapped.init_state(batch_size)

    def __call__(
        self, hidden: mx.array, tokens: mx.array, state: ModelState, *, capture: bool = False
    ) -> tuple[Any, ...]:
        """(logits, hidden, state), or (logits, hidden, state, checkpoints) with capture."""
        if not (isinstance(tokens, mx.array) and tokens.ndim == 2):
            shown = f"shape {tuple(tokens.shape)}" if isinstance(tokens, mx.array) else (
                f"a {type(tokens).__name__}: pass mx.array(tokens)")  # fmt: skip
            raise TokenError(f"MTPHead: tokens must be an mx.array (B, K) of ids; got {shown}")
        if not mx.issubdtype(tokens.dtype, mx.integer):
            raise TokenError(f"MTPHead: tokens must be integer ids; got dtype {tokens.dtype}")
        if not isinstance(hidden, mx.array):
            raise ShapeError(
                f"MTPHead: hidden must be an mx.array (B, K, D) of the target's hidden states; "
                f"got a {type(hidden).__name__}"
            )
        if hidden.ndim != 3 or tuple(hidden.shape[:2]) != tuple(tokens.shape):
            raise ShapeError(
                f"MTPHead: hidden {tuple(hidden.shape)} must be (B, K, D) for tokens "
                f"{tuple(tokens.shape)}"
            )
        if hidden.shape[-1] != self.hidden_size:
            raise ShapeError(
                f"MTPHead: hidden is {hidden.shape[-1]} wide but this head's model has "
                f"hidden_size {self.hidden_size}: a head takes the hidden states of the model "
                "it was built for (MTPHead(target_model))"
            )
        with feeding(hidden):
            out = self._wrapped(tokens, state, capture=capture, hidden=True)
        if capture:
            logits, new, checkpoints, hidden_out = out
            return logits, hidden_out, new, checkpoints
        logits, new, hidden_out = out
        return logits, hidden_out, new

    def forward(self, hidden: mx.array, tokens: mx.array) -> tuple[mx.array, mx.array]:
        """(logits, hidden) over whole sequences without a state (teacher forcing, for
        training: position i takes the target's hidden state at i - 1 and token i)."""
        with feeding(hidden), recording_hidden(output_projections(self.inner)) as sink:
            logits = self.inner(tokens)
        return logits, hidden_states(sink, logits, self.inner)

    def trainable_parameters(self) -> dict[str, Any]:
        shared = self._fused + "embedding."
        trainable = super().trainable_parameters()
        every: list[tuple[str, mx.array]] = tree_flatten(trainable)  # type: ignore[assignment]
        own = [
            (k, v)
            for k, v in every
            if _LAYER.search(k) or (k.startswith(self._fused) and not k.startswith(shared))
        ]
        return dict(tree_unflatten(own))


def _head_args(args: Any, n: int) -> Any:
    """The target's args with its first `n` layers: per-layer lists (layer types, block
    patterns) cut to n entries."""
    depth = args.num_hidden_layers
    changes: dict[str, Any] = {"num_hidden_layers": n}
    for field in dataclasses.fields(args):
        value = getattr(args, field.name)
        if isinstance(value, (list, tuple)) and len(value) == depth:
            changes[field.name] = type(value)(value[:n])
    return dataclasses.replace(args, **changes)


def _smallest_model(target: nn.Module, args: Any, layers: int | None) -> nn.Module:
    """A model of the target's class with its first N layers: `layers`, or the fewest for
    which a one-token forward of the architecture's own code runs."""
    depth = args.num_hidden_layers
    if layers is not None and not (
        isinstance(layers, int) and not isinstance(layers, bool) and 1 <= layers <= depth
    ):
        raise StateError(
            f"MTPHead: layers must be an int in 1..{depth} (the target's num_hidden_layers: "
            f"the head uses the architecture's first layers); got {layers!r}"
        )
    tried = [layers] if layers is not None else range(1, args.num_hidden_layers + 1)
    failure: Exception | None = None
    build: Any = type(target)
    for n in tried:
        try:
            model = build(_head_args(args, n))
            mx.eval(model(mx.array([[0]]), cache=make_prompt_cache(model)))
            return model
        except (IndexError, KeyError, ValueError, TypeError) as error:
            failure = error
    counts = str(layers) if layers is not None else f"1 to {args.num_hidden_layers}"
    raise NotSupportedError(
        f"MTPHead: no model of {type(target).__name__}'s architecture with {counts} layers "
        f"runs ({failure!r}); build a head yourself (any module with the DraftHead call)"
    )


def _share_outer_modules(inner: nn.Module, target: nn.Module) -> None:
    """Every leaf module of `inner` outside its layers (embedding, final norm, lm_head)
    becomes the target's module at the same path."""
    targets = dict(target.named_modules())
    for name, module in list(inner.named_modules()):
        if _LAYER.search(name) or _has_submodules(module):
            continue
        if name not in targets:
            raise NotSupportedError(f"MTPHead: the target has no module `{name}` to share")
        _set_path(inner, name, targets[name])


def _has_submodules(module: nn.Module) -> bool:
    return any(isinstance(m, nn.Module) for _, m in module.named_modules() if m is not module)


def _fuse_embedding(inner: nn.Module, args: Any) -> str:
    """Replace the inner model's (shared) embedding by a FusedInput around it; its path."""
    found = [
        (name, m)
        for name, m in inner.named_modules()
        if not _LAYER.search(name) and callable(getattr(type(m), "as_linear", None))
    ]
    if len(found) != 1:
        raise NotSupportedError(
            f"MTPHead: expected one embedding (a module with `as_linear`) outside the layers; "
            f"found {[name for name, _ in found]}"
        )
    name, embedding = found[0]
    dtype = embedding(mx.array([[0]])).dtype
    eps = float(getattr(args, "rms_norm_eps", None) or getattr(args, "norm_eps", None) or 1e-5)
    fused = FusedInput(embedding, args.hidden_size, eps, dtype)
    for layer in getattr(inner, "layers", []):
        layer.set_dtype(dtype)
    _set_path(inner, name, fused)
    return name


def _set_path(root: nn.Module, path: str, module: nn.Module) -> None:
    *parents, last = path.split(".")
    owner: Any = root
    for part in parents:
        owner = owner[int(part)] if isinstance(owner, list) else getattr(owner, part)
    setattr(owner, last, module)
