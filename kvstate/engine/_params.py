"""What a caller hands the engine and gets back: a request's parameters (checked when they
are built, each refusal naming its field), the request handle, and a step's outputs."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

from .. import StateError, TokenError
from ..speculative import Sampler

SEED_LIMIT = 2**64  # mx.random.key takes 0 .. 2**64 - 1


def refusal(cls: type[StateError], field: str, message: str) -> StateError:
    """A `cls` error about `field` (its `field` attribute: "max_tokens", "prompt", ...), for
    a caller that reports which field was wrong (the server's 400s)."""
    error = cls(message)
    error.field = field  # type: ignore[attr-defined]
    return error


def _integer(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _number(x: Any) -> bool:
    return _integer(x) or (isinstance(x, (float, np.floating)) and math.isfinite(x))


@attrs.frozen
class RequestParams:
    """How one request generates.

    max_tokens: the most tokens it emits (>= 1). stop_ids: token ids that end it (emitted
    with finish reason "stop"): the tokenizer's eos ids, if the caller wants them.
    temperature (0: greedy), top_p (in (0, 1]), top_k (0: off): its sampler, applied as
    `kvstate.speculative.Sampler` applies it. seed: its randomness (an int in 0..2**64-1;
    None: the engine draws one). logprobs: report the log-probability of each emitted token
    under the target (its raw logits' log-softmax, as mlx-lm's `logprobs`).
    """

    max_tokens: int = 256
    stop_ids: tuple[int, ...] = ()
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    logprobs: bool = False

    def __attrs_post_init__(self) -> None:
        bad: list[tuple[str, str]] = []
        if not (_integer(self.max_tokens) and self.max_tokens >= 1):
            bad.append(("max_tokens", f"max_tokens={self.max_tokens!r} (must be an int >= 1)"))
        if not (_number(self.temperature) and self.temperature >= 0):
            bad.append(
                ("temperature", f"temperature={self.temperature!r} (must be a finite number >= 0)")
            )
        if not (_number(self.top_p) and 0 < self.top_p <= 1):
            bad.append(("top_p", f"top_p={self.top_p!r} (must be a number in (0, 1])"))
        if not (_integer(self.top_k) and self.top_k >= 0):
            bad.append(("top_k", f"top_k={self.top_k!r} (must be an int >= 0)"))
        if self.seed is not None and not (_integer(self.seed) and 0 <= self.seed < SEED_LIMIT):
            bad.append(("seed", f"seed={self.seed!r} (must be None or an int in 0..2**64-1)"))
        if not isinstance(self.logprobs, (bool, np.bool_)):
            bad.append(("logprobs", f"logprobs={self.logprobs!r} (must be a bool)"))
        if bad:
            shown = ", ".join(message for _, message in bad)
            raise refusal(StateError, bad[0][0], f"RequestParams: {shown}")
        stops = self.stop_ids
        if isinstance(stops, (str, bytes)) or not isinstance(stops, (tuple, list)):
            raise refusal(
                TokenError,
                "stop_ids",
                f"RequestParams: stop_ids={stops!r:.60} (must be a tuple of token ids)",
            )
        wrong = [s for s in stops if not (_integer(s) and s >= 0)]
        if wrong:
            raise refusal(
                TokenError,
                "stop_ids",
                f"RequestParams: stop_ids holds {wrong[:8]!r} (each must be an int token id >= 0)",
            )
        # Normalised to plain ints in a tuple (frozen: through object.__setattr__, once).
        object.__setattr__(self, "stop_ids", tuple(int(s) for s in stops))

    @property
    def sampler(self) -> Sampler:
        """The `Sampler` of these parameters."""
        return Sampler(float(self.temperature), float(self.top_p), int(self.top_k))


class Request:
    """A handle on one submitted request: the engine updates its fields as it runs.

    tokens: the tokens emitted so far; logprobs: their log-probabilities (with
    `params.logprobs`, else None); finished / finish_reason: "stop" (a stop id), "length"
    (`max_tokens`) or "cancelled"; cached_tokens: the prompt tokens the prefix cache served
    (not prefilled again). Times (`time.perf_counter`): submitted_at, first_token_at,
    finished_at (None until then).
    """

    def __init__(self, id: int, prompt: tuple[int, ...], params: RequestParams) -> None:
        self.id = id
        self.prompt = prompt
        self.params = params
        self.tokens: list[int] = []
        self.logprobs: list[float] | None = [] if params.logprobs else None
        self.finished = False
        self.finish_reason: str | None = None
        self.cached_tokens = 0
        self.submitted_at = time.perf_counter()
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self.cancel_requested = False  # set by Engine.cancel; the engine frees it next step

    def __repr__(self) -> str:
        state = self.finish_reason if self.finished else "running"
        return (
            f"Request(id={self.id}, prompt={len(self.prompt)} tokens, "
            f"{len(self.tokens)} emitted, {state})"
        )


@attrs.frozen
class Output:
    """What a step did for one request: the tokens it emitted this step (maybe none, when it
    only finished), their log-probabilities (None unless asked for), and whether it
    finished, and why ("stop", "length", "cancelled")."""

    request: Request
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...] | None
    finished: bool
    finish_reason: str | None


def checked_prompt(prompt: Any, vocab: int, most: int | None) -> tuple[int, ...]:
    """A prompt as a tuple of ids: a non-empty sequence (or 1-d array) of ints in
    0..vocab-1, at most `most` long, else a TokenError naming `prompt`."""
    if isinstance(prompt, (str, bytes)) or not isinstance(prompt, (Sequence, np.ndarray)):
        raise refusal(
            TokenError,
            "prompt",
            f"submit: prompt must be a sequence of token ids; got {type(prompt).__name__} "
            f"{prompt!r:.60}",
        )
    if isinstance(prompt, np.ndarray) and prompt.ndim != 1:
        raise refusal(
            TokenError, "prompt", f"submit: prompt must be 1-d token ids; got shape {prompt.shape}"
        )
    if len(prompt) == 0:
        raise refusal(TokenError, "prompt", "submit: prompt is empty; give at least one token id")
    wrong = [t for t in prompt if not _integer(t)]
    if wrong:
        raise refusal(
            TokenError, "prompt", f"submit: prompt holds {wrong[:4]!r:.60}, not int token ids"
        )
    ids = tuple(int(t) for t in prompt)
    outside = [t for t in ids if not 0 <= t < vocab]
    if outside:
        raise refusal(
            TokenError,
            "prompt",
            f"submit: prompt holds ids {outside[:8]} outside the vocabulary 0..{vocab - 1}",
        )
    if most is not None and len(ids) > most:
        raise refusal(
            TokenError,
            "prompt",
            f"submit: prompt has {len(ids)} tokens; the model takes at most {most} "
            "(max_prompt_tokens)",
        )
    return ids


def checked_params(params: Any, vocab: int) -> RequestParams:
    """`params` (None: the defaults) as RequestParams whose stop ids are in the vocabulary."""
    if params is None:
        return RequestParams()
    if not isinstance(params, RequestParams):
        raise refusal(
            StateError,
            "params",
            f"submit: params must be a kvstate.engine.RequestParams or None; got "
            f"{type(params).__name__}",
        )
    outside = [s for s in params.stop_ids if s >= vocab]
    if outside:
        raise refusal(
            TokenError,
            "stop_ids",
            f"submit: params.stop_ids holds ids {outside[:8]} outside the vocabulary "
            f"0..{vocab - 1}",
        )
    return params
