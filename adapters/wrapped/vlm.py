"""`wrap(mlx_vlm model)`: the same pure view as for mlx-lm models, over mlx-vlm's own pieces.

What differs from an mlx-lm model, and where mlx-vlm's `generate_step` is the reference:
- the caches come from `mlx_vlm.models.cache.make_prompt_cache(model.language_model)` (the
  language model's own `make_cache`: sliding windows and recurrent layers as mlx-vlm builds
  them), and go to the model as mlx-vlm cache objects (`to_vlm_cache`);
- every forward calls `model.language_model(tokens, cache=caches, ...)`, whose output is a
  `LanguageModelOutput`: the wrapper returns its `.logits`;
- a forward may carry the model's extra inputs (pixel values, masks, embeddings...): then the
  embeddings come from `model.get_input_embeddings(tokens, pixel_values, mask=mask, **inputs)`
  and the language model gets `inputs_embeds` plus every other field that call returned, as
  `generate_step` does for a prompt. Later forwards are plain token steps, as there.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from types import MethodType
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx_vlm.models.cache import make_prompt_cache

from kvstate import ModelState, NotSupportedError, ShapeError, StateError, tree_flatten

from ..caches.vlm import to_vlm_cache
from ..caches.walk import arrays_caches
from .chain import chain_by_calls
from .forward import run
from .model import WrappedModel
from .prefill import PREFILL_STEP, Progress, checked_step, chunked
from .tokens import nan_where, poisoned


class _Unset:
    def __repr__(self) -> str:
        return "<unset>"


UNSET: Any = _Unset()  # `pixel_values=None` is a text-only prompt through the embedding path


class LanguageStep:
    """`model.language_model` as `forward.run` calls a model: `(tokens, cache=) -> logits`,
    with the extra keyword inputs of one forward."""

    def __init__(self, language_model: nn.Module, inputs: dict[str, Any]) -> None:
        self.language_model = language_model
        self.inputs = inputs

    def __call__(self, tokens: mx.array, cache: list[Any]) -> mx.array:
        out = self.language_model(tokens, cache=cache, **self.inputs)
        return logits_of(out)


def logits_of(out: Any) -> mx.array:
    """The logits of a language model's output: an array, or an object with `.logits`
    (mlx-vlm's LanguageModelOutput). Outputs that carry state to the next step (encoder
    outputs, cross-attention states) live outside the cache, so a state cannot hold them."""
    if isinstance(out, mx.array):
        return out
    for carried in ("cross_attention_states", "encoder_outputs"):
        if getattr(out, carried, None) is not None:
            raise NotSupportedError(
                f"this mlx-vlm model returns {carried}, which its generate loop feeds to every "
                "later step outside the cache; kvstate states cannot hold it, so the model "
                "cannot be wrapped"
            )
    logits = getattr(out, "logits", None)
    if not isinstance(logits, mx.array):
        raise NotSupportedError(
            f"the language model returned a {type(out).__name__} without .logits; expected "
            "an mx.array or mlx-vlm's LanguageModelOutput"
        )
    return logits


class VLMWrappedModel(WrappedModel):
    """An mlx-vlm model (`mlx_vlm.load` or built from its `Model(config)`) as a pure
    function of (tokens, state): `logits, state = m(tokens, state)`, plus the model's extra
    inputs on a forward that needs them:

        logits, state = m(prompt, m.init_state(), pixel_values=pixels, mask=mask)
        logits, state = m(next_token, state)

    A conversation's first forward always goes through the model's `get_input_embeddings`
    (as in mlx-vlm's `generate_step`), later ones are plain token steps. Everything else
    (checks, `lengths=`, `capture=`) is `WrappedModel`'s; `hidden=True` and `tree_forward`
    are not available for mlx-vlm models yet, and `chain` is the sequence of calls it stands
    for.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        buckets: bool | None = None,
        verify_kernel: bool | None = None,
        record_mixers: bool | None = None,
    ) -> None:
        super().__init__(
            model, buckets=buckets, verify_kernel=verify_kernel, record_mixers=record_mixers
        )
        self.language_model = cast(nn.Module, getattr(model, "language_model", model))

    def _new_caches(self, max_kv_size: int | None = None) -> list[Any]:
        return make_prompt_cache(self.language_model, max_kv_size=max_kv_size)

    def _merged(self, rows: list[list[Any]]) -> list[Any]:
        # Rows batched through mlx-vlm's cache classes' own `merge`.
        return [type(c[0]).merge(list(c)) for c in zip(*rows, strict=True)]

    def _probe_forward(self) -> tuple[mx.array, list[Any]]:
        caches = self._new_caches()
        with _module_state_kept(self.language_model):
            logits = LanguageStep(self.language_model, {})(mx.array([[0]]), caches)
        return logits, caches

    def _vocab_of(self, logits: mx.array) -> int:
        return _vocab_size(self.model, self.language_model, int(logits.shape[-1]))

    def __call__(
        self,
        tokens: Any,
        state: ModelState,
        *,
        lengths: Sequence[int] | None = None,
        capture: bool = False,
        pixel_values: Any = UNSET,
        mask: Any = None,
        inputs_embeds: mx.array | None = None,
        hidden: bool = False,
        **model_inputs: Any,
    ) -> Any:
        """Run `tokens` (B, K) through the language model from `state`; see
        `WrappedModel.__call__` for `lengths` and `capture`.

        Extra inputs (a prompt's): `pixel_values` (None for a text-only prompt), `mask` and
        any other keyword the model's `get_input_embeddings` takes (`image_grid_thw`...)
        run the embedding path of mlx-vlm's `generate_step`; `inputs_embeds` (B, K, D)
        replaces the token embeddings directly (the tokens still go along, as in mlx-vlm).
        """
        if hidden:
            raise NotSupportedError("hidden=True is not available for mlx-vlm models yet")
        ids, bad = self._checked(tokens, state, lengths, capture)
        inputs = self._inputs(ids, state, pixel_values, mask, inputs_embeds, model_inputs)
        if capture and inputs:
            raise NotSupportedError(
                "capture=True with a prompt's extra inputs (pixel_values, mask, "
                "inputs_embeds...): run the prompt first, then verify plain tokens with "
                "capture=True"
            )
        step = LanguageStep(self.language_model, inputs)
        out = run(
            step,  # type: ignore[arg-type]
            ids,
            state,
            lengths=lengths,
            capture=capture,
            mixers=self._mixers,
            convert=to_vlm_cache if lengths is None else padded_prompt_cache,
            policy=self.bucketing,
        )
        logits, new = poisoned(out.logits, bad), self.adopt(out.state)
        return (logits, new, out.checkpoints) if capture else (logits, new)

    def prefill(
        self,
        tokens: Any,
        state: ModelState,
        *,
        step: int = PREFILL_STEP,
        progress: Progress | None = None,
        hidden: bool = False,
        pixel_values: Any = UNSET,
        mask: Any = None,
        inputs_embeds: mx.array | None = None,
        **model_inputs: Any,
    ) -> Any:
        """A prompt's forward as mlx-vlm's `generate_step` runs it: the prompt's inputs
        (the embedding path, with the extra inputs `__call__` takes) computed once for the
        whole prompt, then all positions but the last in chunks of `step`, each chunk's
        state evaluated as it is built and its logits never computed, then the last
        position alone; every chunk gets its slice of `inputs_embeds` and the prompt's
        other inputs whole (mlx-vlm's language models slice positions by the cache offset).
        A model that refuses chunked prefill in mlx-vlm (`no_chunked_prefill`, or its
        `chunked_prefill_policy`) runs the whole prompt in one forward instead. See
        `WrappedModel.prefill` for `progress` and the result: `(last logits (B, vocab),
        state)`, evaluated.
        """
        if hidden:
            raise NotSupportedError("hidden=True is not available for mlx-vlm models yet")
        n = checked_step(step)
        ids, bad = self._checked(tokens, state, None, False)
        inputs = self._inputs(ids, state, pixel_values, mask, inputs_embeds, model_inputs)
        embeds = inputs.get("inputs_embeds")
        if not _chunks(self.model, self.language_model, ids, inputs) or (
            embeds is not None and embeds.shape[1] != ids.shape[1]  # chunks slice both alike
        ):
            return self._whole(ids, bad, state, inputs, progress)
        language_model = self.language_model

        def model_at(start: int, end: int, last: bool) -> Any:
            if embeds is None:  # a continued conversation's plain tokens
                return LanguageStep(language_model, inputs)
            extra = {} if last else {"n_to_process": end - start}  # as generate_step
            return LanguageStep(
                language_model, {**inputs, **extra, "inputs_embeds": embeds[:, start:end]}
            )

        done = chunked(
            model_at,
            ids,
            bad,
            state,
            step=n,
            progress=progress,
            adopt=self.adopt,
            convert=to_vlm_cache,
        )
        return done.logits, done.state

    def _whole(
        self,
        ids: mx.array,
        bad: mx.array | None,
        state: ModelState,
        inputs: dict[str, Any],
        progress: Progress | None,
    ) -> tuple[mx.array, ModelState]:
        """`prefill` for a model that refuses chunks: one forward of the whole prompt."""
        total = ids.size
        if progress is not None:
            progress(0, total)
        out = run(
            LanguageStep(self.language_model, inputs),  # type: ignore[arg-type]
            ids,
            state,
            convert=to_vlm_cache,
            policy=self.bucketing,
        )
        logits = out.logits[:, -1]
        if bad is not None:
            logits = nan_where(bad.any(axis=1), logits)
        new = self.adopt(out.state)
        mx.eval(logits, *tree_flatten(new)[0])
        if progress is not None:
            progress(total, total)
        return logits, new

    def tree_forward(self, tokens: Any, state: ModelState, parents: Sequence[int]) -> Any:
        """Not available for mlx-vlm models yet (the tree forward runs mlx-lm's caches)."""
        raise NotSupportedError("tree_forward is not available for mlx-vlm models yet")

    # The forwards of an mlx-vlm model go through its `__call__` (its own caches, its
    # language model): its chain is that sequence of calls.
    chain = chain_by_calls

    def _inputs(
        self,
        ids: mx.array,
        state: ModelState,
        pixel_values: Any,
        mask: Any,
        inputs_embeds: mx.array | None,
        model_inputs: dict[str, Any],
    ) -> dict[str, Any]:
        """The language model's keyword inputs for this forward ({} for a token step)."""
        if inputs_embeds is not None:
            if pixel_values is not UNSET:
                raise StateError("give pixel_values or inputs_embeds, not both")
            if tuple(inputs_embeds.shape[:2]) != tuple(ids.shape):
                raise ShapeError(
                    f"inputs_embeds must be (batch, K, hidden) for tokens {tuple(ids.shape)}; "
                    f"got {tuple(inputs_embeds.shape)}"
                )
            return {"inputs_embeds": inputs_embeds, **model_inputs}
        if pixel_values is UNSET and mask is None and not model_inputs and _started(state):
            return {}
        # A prompt (extra inputs, or the first forward of a conversation) takes the
        # embedding path, as in generate_step: models with mRoPE (Qwen-VL) compute their
        # positions there, and a plain forward would reuse the module's last ones.
        pixels = None if pixel_values is UNSET else pixel_values
        features = self.model.get_input_embeddings(ids, pixels, mask=mask, **model_inputs)
        extra = {
            k: v for k, v in features.to_dict().items() if k != "inputs_embeds" and v is not None
        }
        return {**model_inputs, **extra, "inputs_embeds": features.inputs_embeds}


def _chunks(
    model: nn.Module, language_model: nn.Module, ids: mx.array, inputs: dict[str, Any]
) -> bool:
    """Whether mlx-vlm's `generate_step` would prefill this prompt in chunks: a model's (or
    its language model's) `chunked_prefill_policy` decides, else `no_chunked_prefill` refuses
    (encoder-decoder models); without a draft model every other model chunks."""
    owners = [model] if language_model is model else [model, language_model]
    for owner in owners:
        policy = getattr(owner, "chunked_prefill_policy", None)
        if callable(policy):
            verdict = policy(
                input_ids=ids,
                inputs_embeds=inputs.get("inputs_embeds"),
                prompt_cache=None,
                draft_model=None,
                draft_kind=None,
                prefill_kwargs=inputs,
            )
            return bool(getattr(verdict, "enabled", verdict))
    return not any(getattr(owner, "no_chunked_prefill", False) for owner in owners)


def _started(state: ModelState) -> bool:
    """Whether the state holds anything yet (its first layer holds arrays)."""
    return bool(state.layers) and bool(tree_flatten(state.layers[0])[0])


@contextmanager
def _module_state_kept(module: nn.Module) -> Iterator[None]:
    """Run with the module's own entries put back afterwards: a probe forward must not
    leave state on the model (Qwen-VL language models keep `_position_ids` and
    `_rope_deltas` of the last prompt on themselves)."""
    entries, attributes = dict(module.items()), dict(vars(module))
    try:
        yield
    finally:
        for key in [k for k in module if k not in entries]:
            del module[key]
        for key, value in entries.items():
            dict.__setitem__(module, key, value)
        vars(module).clear()
        vars(module).update(attributes)


def padded_prompt_cache(layer: Any) -> Any:
    """`to_vlm_cache` for a right-padded prompt forward (`lengths=`): mlx-vlm's ArraysCache
    masks by its left padding alone whenever it has one (a merged empty cache has zeros),
    so the pad tokens after a short row would reach its recurrent state; its caches get
    mlx-lm's mask instead, left padding and lengths both, for this one forward."""
    cache = to_vlm_cache(layer)
    for recurrent in arrays_caches(cache):
        recurrent.make_mask = MethodType(_padded_mask, recurrent)
    return cache


def _padded_mask(self: Any, N: int) -> mx.array | None:
    """mlx-lm's ArraysCache.make_mask: positions after the left padding and before the
    row's length."""
    pos = mx.arange(N)
    mask = None
    if self.left_padding is not None:
        mask = pos >= self.left_padding[:, None]
    if self.lengths is not None:
        inside = pos < self.lengths[:, None]
        mask = inside if mask is None else mask & inside
    return mask


def _vocab_size(model: nn.Module, language_model: nn.Module, logits_width: int) -> int:
    for owner in (language_model, model):
        for name in ("args", "config"):
            vocab = getattr(getattr(owner, name, None), "vocab_size", None)
            if isinstance(vocab, int):
                return vocab
    return logits_width
