"""`wrap(model)`: a pure view of an mlx-lm model, `logits, state = m(tokens, state)`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.generate import _merge_caches
from mlx_lm.models.cache import make_prompt_cache

from kvstate import (
    ConfigMismatchError,
    ModelState,
    ShapeError,
    StateError,
    TokenError,
    check,
    tree_flatten,
)
from kvstate import eval as evaluate
from kvstate.distributed import with_placement
from kvstate.kinds import as_int, batch_size_of, fit_config_of, vouch, vouched

from ._chain import ID_DTYPES
from ._chain import chain as _chain
from ._fit import layer_mismatches
from ._forward import run
from ._kept import KeptCaches
from ._options import chosen
from ._placement import model_placement
from .caches.convert import from_mlx_lm
from .caches.registry import from_cache
from .instruments.capture import Mixer, known_mixers
from .instruments.hidden import Projection, output_projections


class WrappedModel:
    """An mlx-lm model as a pure function of (tokens, state).

    Each call builds fresh mlx-lm cache objects from the state (O(1): the arrays are new
    objects over the same buffers), runs the model, and reads the caches back into a new
    state; a plain forward from the state the previous plain forward returned runs on that
    forward's cache objects instead (`_kept`). When the caller rebinds (`state = ...`)
    nothing else holds the old buffers and MLX updates them in place; when the caller keeps
    the old state, MLX copies on write.

    Every call first checks, without a device sync, that the state fits the model (one part
    per layer, of the kind and configuration the model's own `make_cache` gives) and that the
    tokens are integer ids of the state's batch. States this wrapped model returned, and
    states the kvstate transforms made from those alone, are known to fit (`kinds.vouch`):
    a decode loop, or a speculative loop of verify and commit_prefix, pays for none of it.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        buckets: bool | None = None,
        verify_kernel: bool | None = None,
        record_mixers: bool | None = None,
    ) -> None:
        self.model = model
        # Options (see `kvstate.adapters.wrap_options`), decided once for this model.
        self.bucketing, self._record_mixers = chosen(buckets, verify_kernel, record_mixers)
        self._layers: tuple[dict[str, Any], ...] | None = None  # fit configs, from a probe
        self._vocab = 0
        self._voucher = object()  # marks the states known to fit this model
        # A model split with mx.distributed (shard / pipeline, done before wrap): the part
        # this rank runs, recorded in every state; `group` is None in a single process.
        self.placement, self.group = model_placement(model)
        self._mixers: list[tuple[nn.Module, Mixer]] | None = None  # found at the first capture
        self._projections: list[Projection] | None = None  # found at the first hidden=True
        self._ropes: list[nn.Module] | None = None  # found at the first tree forward
        self._kept = KeptCaches()  # the last plain forward's caches (see `_kept`)

    def init_state(self, batch_size: int = 1) -> ModelState:
        """An empty state for `batch_size` rows, built by the model's own `make_cache`
        (batched through mlx-lm's own merge, exactly like its BatchGenerator)."""
        rows = as_int(batch_size, "init_state: batch_size", ShapeError)
        if rows < 1:
            raise ShapeError(f"init_state: batch_size must be an int >= 1; got {batch_size!r}")
        if rows == 1:
            return self._ours(from_mlx_lm(make_prompt_cache(self.model)))
        caches = [make_prompt_cache(self.model) for _ in range(rows)]
        return self._ours(from_mlx_lm(_merge_caches(caches)))

    @property
    def vocab_size(self) -> int:
        """The ids the model takes are 0 .. vocab_size - 1."""
        self._probe()
        return self._vocab

    def tree_forward(
        self, tokens: Any, state: ModelState, parents: Sequence[int]
    ) -> tuple[mx.array, ModelState, Any]:
        """One forward of `tokens` (1, T) arranged as a tree over one copy of a batch-1
        `state`: token q's parent is position `parents[q]` (-1 for q = 0 only; parents come
        first). Logits at q are those of a linear forward of q's root-to-q path. Returns
        `(logits, state with all T appended, checkpoints by position)`: keep one path with
        `kvstate.speculative.verify_tree` (see `_tree_forward`)."""
        from ._tree_forward import tree_run
        from .instruments.tree import check_parents, rope_modules

        if type(self.model).__module__.startswith("mlx_vlm."):
            raise StateError(
                "tree_forward: mlx-lm models only (an mlx-vlm model's own caches and output "
                "type are not wired into the tree forward); verify linearly instead"
            )
        self._check_fits(state)
        tokens, bad = self._tokens(tokens, state)
        if tokens.shape[0] != 1:
            raise StateError(f"tree_forward: takes one row of tokens; got {tokens.shape[0]}")
        links = check_parents(parents, tokens.shape[1])
        if self._mixers is None:
            self._mixers = self._known_mixers()
        if self._ropes is None:
            self._ropes = rope_modules(self.model)
        logits, new, checkpoints = tree_run(
            self.model, tokens, state, links, self._mixers, self._ropes, self.bucketing
        )
        return _poisoned(logits, bad), self._ours(new, logits), checkpoints

    def __call__(
        self,
        tokens: Any,
        state: ModelState,
        *,
        lengths: Sequence[int] | None = None,
        capture: bool = False,
        hidden: bool = False,
    ) -> Any:
        """Run `tokens` (B, K) int through the model from `state`.

        `tokens`: an mx.array, a NumPy array or nested lists of ints; (K,) means batch 1.
        Ids from lists or NumPy are checked against the vocabulary here. Ids in an mx.array
        are not read back (that would stall the device pipeline): an id outside the
        vocabulary gives NaN logits for its position (instead of reading out of bounds),
        and the state then holds id 0 there, so discard it.
        `lengths`: for a right-padded batch of prompts, each row's real length; rows are
        re-aligned to left padding afterwards, as in mlx-lm's batch generation.
        `capture=True` also returns per-token checkpoints for `commit_prefix`.
        `hidden=True` also returns the final hidden states (B, K, D), the input of the
        model's output projection (`lm_head`, or the tied embedding's `as_linear`).
        Returns `(logits (B, K, vocab), state)` or `(logits, state, checkpoints)`, with
        `hidden` appended when asked for.
        """
        self._check_fits(state)
        tokens, bad = self._tokens(tokens, state)
        if lengths is not None:
            _check_lengths(lengths, tokens.shape, capture)
        if capture and self._mixers is None:
            self._mixers = self._known_mixers()
        if hidden:
            return self._with_hidden(tokens, bad, state, lengths, capture)
        if capture or lengths is not None:
            mixers = self._mixers
            out = run(
                self.model,
                tokens,
                state,
                lengths=lengths,
                capture=capture,
                mixers=mixers,
                policy=self.bucketing,
            )
            logits, new = _poisoned(out.logits, bad), self._ours(out.state, out.logits)
            return (logits, new, out.checkpoints) if capture else (logits, new)
        # A plain forward (every decode step): from the caches of the last one when `state`
        # is what that returned, and keep this one's for the next.
        out = run(self.model, tokens, state, caches=self._kept.take(state), policy=self.bucketing)
        logits, new = _poisoned(out.logits, bad), self._ours(out.state, out.logits)
        self._kept.keep(new, out.caches)
        return logits, new

    # `logits, picks, state = m.chain(tokens, state, steps, pick)`: a draft model's steps on
    # its own caches, read back once (see `_chain.chain`). A plain function, not a method
    # that calls one: a wrapper's frame would hold the state while the chain runs.
    chain = _chain

    def _with_hidden(
        self,
        tokens: mx.array,
        bad: mx.array | None,
        state: ModelState,
        lengths: Sequence[int] | None,
        capture: bool,
    ) -> tuple[Any, ...]:
        """`__call__` with hidden=True, kept apart so the decode path stays as it was."""
        if self._projections is None:
            self._projections = output_projections(self.model)
        out = run(
            self.model,
            tokens,
            state,
            lengths=lengths,
            capture=capture,
            mixers=self._mixers,
            projections=self._projections,
            policy=self.bucketing,
        )
        logits, new = _poisoned(out.logits, bad), self._ours(out.state, out.logits)
        assert out.hidden is not None
        hidden = _poisoned(out.hidden, bad)
        return (logits, new, out.checkpoints, hidden) if capture else (logits, new, hidden)

    def _known_mixers(self) -> list[tuple[nn.Module, Mixer]]:
        """The mixers a capturing forward records (none with record_mixers=False)."""
        return known_mixers(self.model) if self._record_mixers else []

    # -- checks ------------------------------------------------------------------------------

    def _ours(self, state: ModelState, *outputs: mx.array) -> ModelState:
        if self.placement is not None:
            state = with_placement(state, self.placement)
            # Run this forward's collectives now: those of forwards built side by side and
            # evaluated together could run in a different order on each rank (and mix up
            # their messages: a pipeline's send / recv of different prompts).
            mx.eval(*outputs)
            evaluate(state)
        return vouch(state, self._voucher)

    def _probe(self) -> tuple[dict[str, Any], ...]:
        """What each layer's state looks like for this model: the model's own caches after
        a one-token forward, read as shapes only (the graph is built, never evaluated)."""
        if self._layers is None:
            caches = make_prompt_cache(self.model)
            logits = self.model(mx.array([[0]]), cache=caches)
            layers = [from_cache(c) for c in caches]
            self._layers = tuple(fit_config_of(layer) for layer in layers)
            vocab = getattr(getattr(self.model, "args", None), "vocab_size", None)
            self._vocab = int(vocab) if isinstance(vocab, int) else int(logits.shape[-1])
        return self._layers

    def _check_fits(self, state: Any) -> None:
        if not isinstance(state, ModelState):
            raise StateError(
                f"wrapped model: state must be a kvstate.ModelState; got {type(state).__name__} "
                "(start from m.init_state(batch) or kvstate.adapters.from_mlx_lm(caches))"
            )
        if vouched(state, self._voucher):
            return
        check(state, values=False)
        found = layer_mismatches(self._probe(), state)
        if state.placement != str(self.placement or ""):
            # Ranks' states can have the same shapes (pipeline runs of alike layers, equal
            # shares of heads): only the recorded placement tells them apart.
            found.insert(
                0,
                f"the state holds {state.placement or 'a single-process model'}, this model "
                f"runs {self.placement or 'in a single process'} (load the file this rank "
                "saved, or gather / scatter with kvstate.distributed)",
            )
        if found:
            raise ConfigMismatchError(
                f"this state does not fit the wrapped model: {'; '.join(found[:12])}. Start "
                "from m.init_state(batch), or from states this model (or one of the same "
                "architecture and size) produced"
            )

    def _tokens(self, tokens: Any, state: ModelState) -> tuple[mx.array, mx.array | None]:
        """Tokens as a checked (B, K) integer array, and for mx.array ids the mask of ids
        outside the vocabulary (None when the ids were checked on the host)."""
        if type(tokens) is mx.array and tokens.dtype in ID_DTYPES and tokens.ndim == 2:
            # A decode step's ids: only the batch and the vocabulary are left to check.
            rows, width = tokens.shape
            if rows and width:
                _check_batch(rows, state)
                return _guarded(tokens, self.vocab_size)
        if not isinstance(tokens, mx.array):
            return self._host_tokens(_host_ids(tokens), state), None
        ids = tokens
        if not mx.issubdtype(ids.dtype, mx.integer):
            raise TokenError(f"token ids must be integers; got dtype {ids.dtype}")
        if ids.ndim == 1:
            ids = ids[None]
        _check_shape(ids.shape)
        _check_batch(ids.shape[0], state)
        return _guarded(ids, self.vocab_size)

    def _host_tokens(self, host: np.ndarray, state: ModelState) -> mx.array:
        """Ids from lists or NumPy (a verify's drafts), checked on the host: one int32 array
        made once they passed (no cast in the graph)."""
        if host.dtype.kind not in "iu":
            raise TokenError(f"token ids must be integers; got dtype {host.dtype}")
        if host.ndim == 1:
            host = host[None]
        _check_shape(host.shape)
        _check_batch(host.shape[0], state)
        vocab = self.vocab_size
        flat = host.ravel().tolist()  # Python ints: faster to compare than NumPy's
        if min(flat) < 0 or max(flat) >= vocab:
            outside = sorted({i for i in flat if not 0 <= i < vocab})
            raise TokenError(f"token ids {outside[:8]} are outside the vocabulary (0..{vocab - 1})")
        return mx.array(host, mx.int32)


def _host_ids(tokens: Any) -> np.ndarray:
    try:
        host = np.asarray(tokens)
    except ValueError:  # ragged nested lists
        raise TokenError(
            "tokens must be a rectangular (batch, K) array of ids; rows of different lengths "
            "need right padding and lengths= (see WrappedModel.__call__)"
        ) from None
    if host.dtype == object:
        raise TokenError(f"token ids must be integers; got {tokens!r:.80}")
    return host


def _check_shape(shape: tuple[int, ...]) -> None:
    if len(shape) != 2 or shape[0] == 0 or shape[1] == 0:
        raise TokenError(
            f"tokens must be a non-empty (batch, K) array of ids; got shape {tuple(shape)}"
        )


def _check_batch(rows: int, state: ModelState) -> None:
    batch = batch_size_of(state.layers[0]) if state.layers else 1
    if rows == batch:
        return
    # A state that holds no arrays yet (init_state()) takes its batch from the first forward.
    if batch == 1 and not any(_holds_arrays(layer) for layer in state.layers):
        return
    raise TokenError(
        f"tokens have {rows} rows but the state has {batch}; give one row of tokens per row "
        "of the state (tile / row_select / merge the state to change its rows)"
    )


def _holds_arrays(layer: Any) -> bool:
    return bool(tree_flatten(layer)[0])


@mx.compile
def _guarded(ids: mx.array, vocab: int) -> tuple[mx.array, mx.array]:
    """Ids outside 0..vocab-1 replaced by 0 (neither MLX's CPU nor its CUDA gather checks
    bounds), and where they were. Compiled (`vocab` a constant of it, one per model): one
    fused kernel instead of four ops on every step."""
    wide = ids.astype(mx.int64)  # an int8 / uint8 / int16 id cannot hold the vocab size
    bad = (wide < 0) | (wide >= vocab)
    return mx.where(bad, 0, ids), bad


@mx.compile
def _nan_where(bad: mx.array, logits: mx.array) -> mx.array:
    return mx.where(bad[..., None], mx.array(float("nan"), logits.dtype), logits)


def _poisoned(logits: mx.array, bad: mx.array | None) -> mx.array:
    return logits if bad is None else _nan_where(bad, logits)


def _check_lengths(lengths: Sequence[int], shape: tuple[int, ...], capture: bool) -> None:
    batch, width = shape
    if capture:
        raise StateError(
            "capture=True with lengths=: a right-padded prompt batch is not a verify forward; "
            "prefill with lengths= first, then verify with capture=True"
        )
    bad = [n for n in lengths if not isinstance(n, int) or not 1 <= n <= width]
    if len(lengths) != batch or bad:
        raise ShapeError(
            f"lengths must give one int in 1..{width} (the padded width) per row of the "
            f"{batch}-row batch; got {list(lengths)}"
        )


def wrap(
    model: nn.Module,
    *,
    buckets: bool | None = None,
    verify_kernel: bool | None = None,
    record_mixers: bool | None = None,
) -> WrappedModel:
    """A pure view of an mlx-lm model: `logits, state = wrap(model)(tokens, state)`.
    An mlx-vlm model gets `kvstate.adapters.vlm.wrap` (its caches, its language model).
    Options (None: the defaults in effect, see `kvstate.adapters.wrap_options`): `buckets`,
    `verify_kernel` (how multi-token forwards attend on CUDA), `record_mixers` (False: every
    recurrent layer's checkpoints by replay)."""
    options = {"buckets": buckets, "verify_kernel": verify_kernel, "record_mixers": record_mixers}
    if any(c.__module__.startswith("mlx_vlm.") for c in type(model).__mro__):
        from .vlm import wrap as wrap_vlm  # imports mlx_vlm, which this model already did

        return wrap_vlm(model, **options)
    return WrappedModel(model, **options)
