"""`WrappedModel`: a pure view of an mlx-lm model, `logits, state = m(tokens, state)`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import _merge_caches
from mlx_lm.models.cache import make_prompt_cache

from kvstate import ConfigMismatchError, ModelState, ShapeError, StateError, check
from kvstate import eval as evaluate
from kvstate.distributed import with_placement
from kvstate.kinds import as_int, fit_config_of, vouch, vouched

from ..caches.convert import from_mlx_lm
from ..caches.registry import from_cache
from ..instruments.capture import Mixer, known_mixers
from ..instruments.hidden import Projection, output_projections
from ..instruments.tree import check_parents, rope_modules
from .chain import chain
from .fit import layer_mismatches
from .forward import run
from .kept_caches import KeptCaches
from .options import chosen
from .placement import model_placement
from .prefill import PREFILL_STEP, Progress, checked_step, chunked
from .tokens import ID_DTYPES, check_batch, check_lengths, checked_ids, guarded, poisoned
from .tree_forward import tree_run


class WrappedModel:
    """An mlx-lm model as a pure function of (tokens, state).

    Each call builds fresh mlx-lm cache objects from the state (O(1): the arrays are new
    objects over the same buffers), runs the model, and reads the caches back into a new
    state; a plain forward from the state the previous plain forward returned runs on that
    forward's cache objects instead (`kept_caches`). When the caller rebinds (`state = ...`)
    nothing else holds the old buffers and MLX updates them in place; when the caller keeps
    the old state, MLX copies on write.

    Every call first checks, without a device sync, that the state fits the model (one part
    per layer, of the kind and configuration the model's own `make_cache` gives) and that the
    tokens are integer ids of the state's batch. States this wrapped model returned, and
    states the kvstate transforms made from those alone, are known to fit (`kinds.vouch`):
    a decode loop, or a speculative loop of verify and commit_prefix, pays for none of it.

    Options (`kvstate.adapters.wrap`, `wrap_options`), decided once here: `buckets`,
    `verify_kernel` (how multi-token forwards attend on CUDA), `record_mixers`.
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
        self.kept = KeptCaches()  # the last plain forward's caches (see `kept_caches`)

    def init_state(self, batch_size: int = 1, *, max_kv_size: int | None = None) -> ModelState:
        """An empty state for `batch_size` rows, built by the model's own cache factory
        (batched through the cache classes' own merge, exactly like mlx-lm's BatchGenerator).
        `max_kv_size`: as mlx-lm's `make_prompt_cache(model, max_kv_size)`, rotating caches
        of that size (keeping the first 4 tokens) for a model without a factory of its own."""
        rows = as_int(batch_size, "init_state: batch_size", ShapeError)
        if rows < 1:
            raise ShapeError(f"init_state: batch_size must be an int >= 1; got {batch_size!r}")
        if max_kv_size is not None:
            size = as_int(max_kv_size, "init_state: max_kv_size", StateError)
            if size < 5:  # the rotating cache keeps 4 tokens: a window must hold more
                raise StateError(f"init_state: max_kv_size must be an int > 4; got {size}")
        caches = [self._new_caches(max_kv_size) for _ in range(rows)]
        return self.adopt(from_mlx_lm(caches[0] if rows == 1 else self._merged(caches)))

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
        `kvstate.speculative.verify_tree` (see `tree_forward` and `instruments.tree`)."""
        ids, bad = self._checked(tokens, state, None, capture=True)  # a tree records too
        if ids.shape[0] != 1:
            raise StateError(f"tree_forward: takes one row of tokens; got {ids.shape[0]}")
        links = check_parents(parents, ids.shape[1])
        if self._ropes is None:
            self._ropes = rope_modules(self.model)
        assert self._mixers is not None
        logits, new, checkpoints = tree_run(
            self.model, ids, state, links, self._mixers, self._ropes, self.bucketing
        )
        return poisoned(logits, bad), self.adopt(new, logits), checkpoints

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
        ids, bad = self._checked(tokens, state, lengths, capture)
        if hidden:
            return self._with_hidden(ids, bad, state, lengths, capture)
        if capture or lengths is not None:
            out = run(
                self.model,
                ids,
                state,
                lengths=lengths,
                capture=capture,
                mixers=self._mixers,
                policy=self.bucketing,
            )
            logits, new = poisoned(out.logits, bad), self.adopt(out.state, out.logits)
            return (logits, new, out.checkpoints) if capture else (logits, new)
        # A plain forward (every decode step): from the caches of the last one when `state`
        # is what that returned, and keep this one's for the next.
        out = run(self.model, ids, state, caches=self.kept.take(state), policy=self.bucketing)
        logits, new = poisoned(out.logits, bad), self.adopt(out.state, out.logits)
        self.kept.keep(new, out.caches)
        return logits, new

    def prefill(
        self,
        tokens: Any,
        state: ModelState,
        *,
        step: int = PREFILL_STEP,
        progress: Progress | None = None,
        hidden: bool = False,
    ) -> Any:
        """A prompt's forward as mlx-lm's `generate_step` runs it: `tokens` (B, L) from
        `state` in chunks of `step` positions, each chunk's state evaluated as it is built
        (its activations freed before the next), the output projection at the last
        position only (see `prefill`). The state and the logits are those of
        `m(tokens, state)`, within rounding; memory is one chunk's, not L positions'
        logits.

        `tokens` as for `__call__` (an id outside the vocabulary in an mx.array makes the
        row's last logits NaN). `progress(processed, total)`: prompt tokens (rows x
        positions) through the model, 0 first, after each chunk, then `total` once all is
        evaluated. `hidden=True` also returns the final hidden states (B, L, D) at every
        position. Returns `(last logits (B, vocab), state)` or `(logits, state, hidden)`,
        evaluated; the state's last forward is the last position's one-token forward.
        """
        n = checked_step(step)
        ids, bad = self._checked(tokens, state, None, False)
        projections = None
        if hidden:
            if self._projections is None:
                self._projections = output_projections(self.model)
            projections = self._projections
        caches = self.kept.take(state)
        model = self.model
        done = chunked(
            lambda start, end, last: model,
            ids,
            bad,
            state,
            step=n,
            progress=progress,
            adopt=self.adopt,
            caches=caches,
            projections=projections,
        )
        self.kept.keep(done.state, done.caches)
        return (done.logits, done.state, done.hidden) if hidden else (done.logits, done.state)

    # `logits, picks, state = m.chain(tokens, state, steps, pick)`: a draft model's steps on
    # its own caches, read back once (see `chain.chain`). A plain function, not a method
    # that calls one: a wrapper's frame would hold the state while the chain runs.
    chain = chain

    def _with_hidden(
        self,
        ids: mx.array,
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
            ids,
            state,
            lengths=lengths,
            capture=capture,
            mixers=self._mixers,
            projections=self._projections,
            policy=self.bucketing,
        )
        logits, new = poisoned(out.logits, bad), self.adopt(out.state, out.logits)
        assert out.hidden is not None
        hidden = poisoned(out.hidden, bad)
        return (logits, new, out.checkpoints, hidden) if capture else (logits, new, hidden)

    # -- what every forward shares (the chain and the mlx-vlm model's forward too) -----------

    def check_fits(self, state: Any) -> None:
        """Refuse a state that does not fit this model (one part per layer, of the kind and
        configuration its own caches have, its placement); free for states it vouched for."""
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

    def checked_tokens(self, tokens: Any, state: ModelState) -> tuple[mx.array, mx.array | None]:
        """Tokens as a checked (B, K) integer array, and for mx.array ids the mask of ids
        outside the vocabulary (None when the ids were checked on the host): see `tokens`."""
        if type(tokens) is mx.array and tokens.dtype in ID_DTYPES and tokens.ndim == 2:
            # A decode step's ids: only the batch and the vocabulary are left to check.
            rows, width = tokens.shape
            if rows and width:
                check_batch(rows, state)
                return guarded(tokens, self.vocab_size)
        return checked_ids(tokens, state, lambda: self.vocab_size)

    def adopt(self, state: ModelState, *outputs: mx.array) -> ModelState:
        """`state` (a forward's result) as this model's: vouched for, so the next call skips
        its fit check; for a split model, marked with this rank's placement and evaluated
        with `outputs` (its collectives run in order)."""
        if self.placement is not None:
            state = with_placement(state, self.placement)
            # Run this forward's collectives now: those of forwards built side by side and
            # evaluated together could run in a different order on each rank (and mix up
            # their messages: a pipeline's send / recv of different prompts).
            mx.eval(*outputs)
            evaluate(state)
        return vouch(state, self._voucher)

    def _checked(
        self, tokens: Any, state: ModelState, lengths: Sequence[int] | None, capture: bool
    ) -> tuple[mx.array, mx.array | None]:
        """A forward's checks: the state fits, the tokens as checked ids (and the mask of ids
        outside the vocabulary), `lengths`; the model's recorded mixers, at the first capture."""
        self.check_fits(state)
        ids, bad = self.checked_tokens(tokens, state)
        if lengths is not None:
            check_lengths(lengths, ids.shape, capture)
        if capture and self._mixers is None:
            self._mixers = known_mixers(self.model) if self._record_mixers else []
        return ids, bad

    # -- what the mlx-vlm model changes ------------------------------------------------------

    def _new_caches(self, max_kv_size: int | None = None) -> list[Any]:
        """The model's own empty caches for one row."""
        return make_prompt_cache(self.model, max_kv_size=max_kv_size)

    def _merged(self, rows: list[list[Any]]) -> list[Any]:
        """One row's caches per element of `rows`, merged into one batch."""
        return _merge_caches(rows)

    def _probe_forward(self) -> tuple[mx.array, list[Any]]:
        """(logits, the model's own caches) of a one-token forward from empty caches."""
        caches = self._new_caches()
        return self.model(mx.array([[0]]), cache=caches), caches

    def _vocab_of(self, logits: mx.array) -> int:
        """The vocabulary size: the model's `args.vocab_size`, else the logits' width."""
        vocab = getattr(getattr(self.model, "args", None), "vocab_size", None)
        return int(vocab) if isinstance(vocab, int) else int(logits.shape[-1])

    def _probe(self) -> tuple[dict[str, Any], ...]:
        """What each layer's state looks like for this model: the model's own caches after
        a one-token forward, read as shapes only (the graph is built, never evaluated)."""
        if self._layers is None:
            logits, caches = self._probe_forward()
            self._layers = tuple(fit_config_of(from_cache(c)) for c in caches)
            self._vocab = self._vocab_of(logits)
        return self._layers
