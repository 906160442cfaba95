"""INTERIM SCAFFOLDING, to be replaced by the real `kvstate.engine` at merge (issue 23,
items 1-2). It implements the engine interface the server is written against
(/work/notes/engine_interface.md: `RequestParams`, `Request`, `Output`, `Engine` with
`submit` / `cancel` / `step` / `has_work` / `stats`, `vocab_size`, `max_prompt_tokens`)
honestly but without batching: each running request is its own
`kvstate.speculative.generate` over a batch of one, and `step()` advances every running
request by one round of its own generator, in turn. Tokens are exactly those of
`generate` for the prompt alone; throughput is not the real engine's.

What it does not do: no batch of rows (no `merge` / `filter` between requests), no prefix
cache (`prefix_cache_bytes` is accepted and holds nothing; every request is a miss),
no quantized states (`kv_bits` other than None is a NotSupportedError), no chunking
between requests (a prompt's prefill, in chunks of `prefill_chunk`, runs inside the step
that admits it).
"""

from __future__ import annotations

import math
import random
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs

from kvstate import NotSupportedError, StateError, TokenError
from kvstate.speculative import Drafter, NGramDrafter, Sampler, Token, generate

FinishReason = str  # "stop" | "length" | "cancelled"


@attrs.frozen
class RequestParams:
    """What one request asks for (the interface's fields and defaults)."""

    max_tokens: int = 256
    stop_ids: tuple[int, ...] = ()
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    logprobs: bool = False


class Request:
    """A submitted request: the engine appends to `tokens` (and `logprobs`) and sets
    `finished` / `finish_reason`; the caller only reads them."""

    def __init__(self, id: int, prompt: tuple[int, ...], params: RequestParams) -> None:
        self.id = id
        self.prompt = prompt
        self.params = params
        self.tokens: list[int] = []
        self.logprobs: list[float] | None = [] if params.logprobs else None
        self.finished = False
        self.finish_reason: FinishReason | None = None
        self.cached_tokens = 0
        self.cancel_requested = False  # set by cancel; the next step finishes the request


@attrs.frozen
class Output:
    """One request's new tokens of a step (empty when it only finishes)."""

    request: Request
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...] | None
    finished: bool
    finish_reason: FinishReason | None


class _Running:
    """A running request and the generator that makes its tokens."""

    def __init__(self, request: Request, rounds: Iterator[list[Token]]) -> None:
        self.request = request
        self.rounds = rounds


class Engine:
    """The interface's engine, one generator per request (see the module docstring)."""

    def __init__(
        self,
        target: Any,
        drafter: str | Callable[[], Drafter] | None = None,
        *,
        max_batch: int = 32,
        prefill_chunk: int = 512,
        prefix_cache_bytes: int = 0,
        kv_bits: Any = None,
        k: int = 4,
        seed: int = 0,
    ) -> None:
        for name, value, low in (("max_batch", max_batch, 1), ("prefill_chunk", prefill_chunk, 1),
                                 ("prefix_cache_bytes", prefix_cache_bytes, 0), ("k", k, 1)):  # fmt: skip
            if not _is_int(value) or value < low:
                raise StateError(f"Engine: {name} must be an int >= {low}; got {value!r}")
        if kv_bits is not None:
            raise NotSupportedError(
                "Engine (interim, one generator per request): kv_bits is not supported; pass "
                "kv_bits=None"
            )
        if drafter is not None and drafter != "ngram" and not callable(drafter):
            raise StateError(
                f"Engine: drafter must be None, 'ngram' or a callable that makes a drafter; got "
                f"{drafter!r:.60}"
            )
        self.target = target
        self.vocab_size: int = int(target.vocab_size)
        self.max_prompt_tokens: int | None = _max_positions(target)
        self._drafter = drafter
        self._max_batch, self._chunk, self._k = max_batch, prefill_chunk, k
        self._seeds = random.Random(seed)
        self._next_id = 0
        self._queued: deque[Request] = deque()
        self._running: list[_Running] = []
        self._generated = 0
        self._misses = 0
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens) of recent steps

    def submit(self, prompt: Sequence[int], params: RequestParams | None = None) -> Request:
        """Queue a request (first come, first served); bad input is refused here, before
        anything is queued: a TokenError for the prompt, a StateError naming the field."""
        params = RequestParams() if params is None else params
        if not isinstance(params, RequestParams):
            raise StateError(f"Engine.submit: params must be RequestParams; got {params!r:.60}")
        ids = self._checked_prompt(prompt)
        self._check_params(params)
        request = Request(self._next_id, ids, params)
        self._next_id += 1
        self._queued.append(request)
        self._misses += 1
        return request

    def cancel(self, request: Request) -> None:
        """Ask to stop `request` (idempotent); the next step finishes it ("cancelled")."""
        if not request.finished:
            request.cancel_requested = True

    def has_work(self) -> bool:
        return bool(self._queued or self._running)

    def step(self) -> list[Output]:
        """Finish cancelled requests, admit queued ones up to `max_batch`, and run one round
        of every running request's generator."""
        outputs = self._retire_cancelled()
        while self._queued and len(self._running) < self._max_batch:
            request = self._queued.popleft()
            self._running.append(_Running(request, self._rounds(request)))
        still = []
        for run in self._running:
            out = self._advance(run)
            outputs.append(out)
            if not out.finished:
                still.append(run)
        self._running = still
        self._count(sum(len(o.tokens) for o in outputs))
        return outputs

    def stats(self) -> dict[str, Any]:
        now = time.monotonic()
        recent = [(t, n) for t, n in self._recent if now - t <= _WINDOW_S]
        span = now - recent[0][0] if len(recent) > 1 else 0.0
        per_s = sum(n for _, n in recent[1:]) / span if span > 0 else 0.0
        return {
            "running": len(self._running),
            "queued": len(self._queued),
            "tokens_per_s": per_s,
            "prefix_hits": 0,
            "prefix_misses": self._misses,
            "prefix_bytes": 0,
            "generated_tokens": self._generated,
        }

    def _rounds(self, request: Request) -> Iterator[list[Token]]:
        p = request.params
        drafter = self._drafter
        made = NGramDrafter() if drafter == "ngram" else drafter() if callable(drafter) else None
        seed = p.seed if p.seed is not None else self._seeds.getrandbits(63)
        return generate(
            self.target,
            [list(request.prompt)],
            made,
            k=self._k,
            max_tokens=p.max_tokens,
            sampler=Sampler(p.temperature, p.top_p, p.top_k),
            eos=p.stop_ids,
            seed=seed,
            prefill_step_size=self._chunk,
        )

    def _advance(self, run: _Running) -> Output:
        request, p = run.request, run.request.params
        new = next(run.rounds, [])
        tokens = tuple(t.token for t in new)
        logprobs = (
            tuple(float(t.logprobs[..., t.token].item()) for t in new)  # type: ignore[arg-type]
            if p.logprobs
            else None
        )
        request.tokens.extend(tokens)
        if request.logprobs is not None and logprobs is not None:
            request.logprobs.extend(logprobs)
        reason: FinishReason | None = None
        if request.tokens and request.tokens[-1] in p.stop_ids:
            reason = "stop"
        elif len(request.tokens) >= p.max_tokens or not new:
            reason = "length"
        if reason is not None:
            _finish(request, reason)
            run.rounds = iter(())  # drop the generator (and its state) now
        return Output(request, tokens, logprobs, request.finished, request.finish_reason)

    def _retire_cancelled(self) -> list[Output]:
        outputs = []
        for request in [r for r in self._queued if r.cancel_requested]:
            self._queued.remove(request)
            outputs.append(_cancelled(request))
        for run in [r for r in self._running if r.request.cancel_requested]:
            self._running.remove(run)
            outputs.append(_cancelled(run.request))
        return outputs

    def _count(self, tokens: int) -> None:
        self._generated += tokens
        now = time.monotonic()
        self._recent.append((now, tokens))
        while self._recent and now - self._recent[0][0] > _WINDOW_S:
            self._recent.popleft()

    def _checked_prompt(self, prompt: Sequence[int]) -> tuple[int, ...]:
        if isinstance(prompt, str | bytes) or not isinstance(prompt, Sequence):
            raise TokenError(f"Engine.submit: prompt must be a sequence of ids; got {prompt!r:.60}")
        ids = tuple(prompt)
        if not ids:
            raise TokenError("Engine.submit: prompt is empty; give at least one token id")
        bad = [t for t in ids if not _is_int(t) or not 0 <= t < self.vocab_size]
        if bad:
            raise TokenError(
                f"Engine.submit: prompt ids must be ints in [0, {self.vocab_size}); got {bad[:5]!r}"
            )
        limit = self.max_prompt_tokens
        if limit is not None and len(ids) > limit:
            raise TokenError(
                f"Engine.submit: prompt has {len(ids)} tokens; the model takes at most {limit}"
            )
        return tuple(int(t) for t in ids)

    def _check_params(self, p: RequestParams) -> None:
        bad = []
        if not _is_int(p.max_tokens) or p.max_tokens < 1:
            bad.append(f"max_tokens={p.max_tokens!r} (an int >= 1)")
        if not isinstance(p.stop_ids, tuple) or not all(
            _is_int(t) and 0 <= t < self.vocab_size for t in p.stop_ids
        ):
            bad.append(f"stop_ids={p.stop_ids!r:.60} (a tuple of ids in [0, {self.vocab_size}))")
        t = p.temperature
        if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or t < 0:
            bad.append(f"temperature={t!r} (a finite number >= 0)")
        if (
            isinstance(p.top_p, bool)
            or not isinstance(p.top_p, int | float)
            or not 0 < p.top_p <= 1
        ):
            bad.append(f"top_p={p.top_p!r} (a number in (0, 1])")
        if not _is_int(p.top_k) or p.top_k < 0:
            bad.append(f"top_k={p.top_k!r} (an int >= 0)")
        if p.seed is not None and (not _is_int(p.seed) or not 0 <= p.seed < 2**64):
            bad.append(f"seed={p.seed!r} (None or an int in 0..2**64-1)")
        if not isinstance(p.logprobs, bool):
            bad.append(f"logprobs={p.logprobs!r} (a bool)")
        if bad:
            raise StateError(f"Engine.submit: RequestParams: {', '.join(bad)}")


_WINDOW_S = 10.0  # tokens/s is measured over the last 10 seconds


def _finish(request: Request, reason: FinishReason) -> None:
    request.finished, request.finish_reason = True, reason


def _cancelled(request: Request) -> Output:
    _finish(request, "cancelled")
    return Output(request, (), () if request.params.logprobs else None, True, "cancelled")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _max_positions(target: Any) -> int | None:
    """The longest prompt the wrapped model's config admits (`max_position_embeddings`),
    None when it states none."""
    args = getattr(getattr(target, "model", None), "args", None)
    limit: Any = getattr(args, "max_position_embeddings", None)
    return int(limit) if _is_int(limit) and limit > 0 else None
