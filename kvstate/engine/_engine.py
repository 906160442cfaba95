"""The engine: requests in, tokens out, one round at a time over a batch that changes
between rounds.

Each `step()`:

1. frees the rows of cancelled requests (`filter`; queued and prefilling ones are dropped);
2. admits queued requests, first come first served, while the running and prefilling
   requests are fewer than `max_batch`; each starts from the longest prefix the prefix
   cache holds of its prompt;
3. prefills up to `prefill_rows` prompts together (oldest first; see `_prefilling`): a
   forward of every one's next chunk (chunks ending at block boundaries, right-padded to
   one width), more while the budget lasts, then one one-token forward of the prompts that
   reached their last positions, whose logits draw their first tokens: `prefill_chunk`
   prompt positions in all per step;
4. runs one round for every running row: a plain step, or with a drafter a verify of every
   row's drafts and a ragged commit of each row's accepted prefix; rows emit up to their
   own `max_tokens` and first stop id; a plain step is pipelined (the next plain step is
   built from its unread tokens before they are read, as mlx-lm's `BatchGenerator` does),
   unless rows join in 6;
5. retires the rows that finished (`filter`, in the same step: the batch never holds a
   finished row), keeping each one's state in the prefix cache as a turn end;
6. joins the prompts prefilled in 3 to the batch (`extend`: ragged lengths, left padding)
   and to the drafter (`add_rows`).

The stall prefills cause the running rows is bounded by `prefill_chunk` prompt positions
per step (at most `prefill_chunk // 2` prompts prefill at once, each running a position or
two at least; with a right-padded forward the pads cost compute beside them: at most
`prefill_rows` rows of the widest chunk). With a draft model, the draft model also prefills
the whole prompt at the join: a small model's forward over it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from .. import (
    ConfigMismatchError,
    NotSupportedError,
    ShapeError,
    StateError,
    batch_size,
    capabilities,
    extract,
    filter,
    nbytes,
)
from ..distributed import agree, group_of
from ..kinds import config_mismatches, config_of, host_ints
from ..speculative import CostAwarePolicy, Target, generation_keys, round_plan
from ..speculative._policy import check_policy_arguments
from ..speculative._position_keys import fold_in, rows_of, token_keys
from ._drafting import Drafting, resolve
from ._kv import empty_state
from ._params import Output, Request, RequestParams, checked_params, checked_prompt
from ._prefilling import PrefillGroup, Prefilling, joined, last_positions, pads_exactly
from ._prefix_cache import PrefixCache
from ._queue import WaitQueue
from ._round import chosen_logprobs, cut, run_round
from ._rows import Batch, Row
from ._stats import Counters

_WAIT_GAIN = 32  # prompt positions worth waiting a step or two for


def _positive(x: Any, name: str, low: int = 1) -> int:
    if not isinstance(x, (int, np.integer)) or isinstance(x, bool) or x < low:
        raise StateError(f"Engine: {name} must be an int >= {low}; got {x!r}")
    return int(x)


class Engine:
    """A continuous-batching engine over a wrapped `target` and an optional `drafter`.

    `drafter`: None (plain decoding), "ngram" (`NGramDrafter()`), a drafter
    (`NGramDrafter`, `ModelDrafter(wrap(draft_model))`, `MTPDrafter(head)`: anything with
    `add_rows`) or a factory of one. `max_batch`: rows running or prefilling at most (the
    rest wait in the queue). `prefill_chunk`: prompt positions prefilled per step (the stall
    bound), also the block size of the prefix cache's boundaries. `prefill_rows`: prompts
    prefilled together in one forward at most (mlx-lm's `prefill_batch_size`). `prefix_cache_bytes`: the
    prefix cache's bound (`kvstate.nbytes` of its states; 0: no cache). `kv_bits`,
    `kv_group_size`, `kv_scheme`: quantized attention states (see `_kv.empty_state`). `k`:
    the most drafts per round. `adaptive` (the default, as in `generate`): with a drafter,
    a `CostAwarePolicy` (`policy`, or a fresh one, kept for the engine's life: its cost
    timings and each row's acceptance) chooses each round how many drafts each row
    verifies, 0 .. k (0 for every row: a plain step, the drafter not even asked), for the
    most tokens per unit of time; `adaptive=False`: every round asks for k drafts (fewer
    near the rows' ends) and verifies them all (benchmarks, tests). On a model split over
    processes the default is fixed k (each rank would time its rounds and choose
    differently), as `generate`'s. The policy's estimates: `Engine.policy`. `seed`: the
    engine's randomness (the drafter's keys and the seeds of requests that give none). `max_prompt_tokens`: the longest prompt taken (default: the
    model's `max_position_embeddings` when it has one, else unbounded).

    Exact: a greedy request's tokens are the target's argmax continuation of its prompt, a
    sampled one's are distributed as the target alone samples them (each request draws with
    its own key, from its seed, each token with its key of its position), whatever else runs
    in the batch, whatever the prefix cache served; without a drafter or with the n-gram
    drafter they are the tokens of `generate([prompt], sampler=..., seed=its seed)`.
    Not thread-safe: drive it from one thread.
    """

    def __init__(
        self,
        target: Target,
        drafter: Any = None,
        *,
        max_batch: int = 32,
        prefill_chunk: int = 512,
        prefill_rows: int = 8,
        prefix_cache_bytes: int = 0,
        kv_bits: Any = None,
        k: int = 4,
        seed: int = 0,
        kv_group_size: int = 64,
        kv_scheme: str = "uniform",
        adaptive: bool = True,
        policy: CostAwarePolicy | None = None,
        max_prompt_tokens: int | None = None,
    ) -> None:
        if not (callable(target) and callable(getattr(target, "init_state", None))):
            raise StateError(
                f"Engine: target must be a wrapped model (kvstate.adapters.wrap(model)); got "
                f"{type(target).__name__}"
            )
        self.target = target
        self.max_batch = _positive(max_batch, "max_batch")
        self.prefill_chunk = _positive(prefill_chunk, "prefill_chunk")
        self.prefill_rows = _positive(prefill_rows, "prefill_rows")
        self.k = _positive(k, "k")
        _positive(prefix_cache_bytes, "prefix_cache_bytes", 0)
        _positive(kv_group_size, "kv_group_size")
        check_policy_arguments("Engine", adaptive, policy)
        if not (isinstance(seed, (int, np.integer)) and 0 <= seed < 2**64):
            raise StateError(f"Engine: seed must be an int in 0..2**64-1; got {seed!r}")
        self.adaptive = adaptive
        self.vocab_size: int = int(target.vocab_size)
        self.max_prompt_tokens = (
            _model_limit(target) if max_prompt_tokens is None
            else _positive(max_prompt_tokens, "max_prompt_tokens")
        )  # fmt: skip
        self._empty = empty_state(target, kv_bits, kv_group_size, kv_scheme)
        made = resolve(drafter)
        _, drafter_key = generation_keys(int(seed))
        self._drafting = None if made is None else Drafting(made, self.prefill_chunk, drafter_key)
        if self._drafting is not None and self._drafting.hidden and prefix_cache_bytes:
            raise NotSupportedError(
                "Engine: an MTP drafter takes the target's hidden states over the whole "
                "prompt, which a prefix-cache hit does not prefill; use prefix_cache_bytes=0 "
                "with it"
            )
        empty = self._empty()
        self._plan = round_plan(empty, made)
        self._cache = (
            PrefixCache(prefix_cache_bytes, cuts=capabilities(empty).joinable_forwards)
            if prefix_cache_bytes
            else None
        )
        self._seeds = np.random.default_rng(int(seed))
        self._queue = WaitQueue()
        self._prefilling: list[Prefilling] = []
        self._group = PrefillGroup(pads=pads_exactly(target, self._empty), hidden=self._plan.hidden)
        self._batch = Batch()
        self._depth = 0  # the depth the last round asked the drafter for
        self._next_id = 0
        self._counters = Counters()
        self._reference: Any = None  # a one-token state: what loaded cache states must match
        self._ranks = group_of(target)  # a split model: every step's decisions are agreed
        self._policy = None
        if made is not None and adaptive and (policy is not None or self._ranks is None):
            self._policy = CostAwarePolicy() if policy is None else policy
            self._policy.begin(0)

    # -- the interface ----------------------------------------------------------------------

    def submit(self, prompt: Sequence[int], params: RequestParams | None = None) -> Request:
        """Queue a request (checked first: a `StateError` / `TokenError` whose `field`
        attribute names what is wrong, and nothing queued)."""
        ids = checked_prompt(prompt, self.vocab_size, self.max_prompt_tokens)
        checked = checked_params(params, self.vocab_size)
        request = Request(self._next_id, ids, checked)
        self._next_id += 1
        self._queue.push(request)
        return request

    def cancel(self, request: Request) -> None:
        """Stop `request` (idempotent; nothing for a finished one): its row, its state and
        its bytes are freed at the next step, whose outputs say it finished "cancelled"."""
        if not isinstance(request, Request):
            raise StateError(f"cancel: expected a Request; got {type(request).__name__}")
        if not request.finished:
            request.cancel_requested = True

    def has_work(self) -> bool:
        """Whether anything is queued, prefilling or running."""
        return bool(len(self._queue) or self._prefilling or len(self._batch))

    def step(self) -> list[Output]:
        """One round (see the module docstring): the outputs of every request that emitted
        tokens or finished."""
        started = time.perf_counter()
        out = _Outputs()
        self._free_cancelled(out)
        self._admit()
        forwards = self._counters.prefill_forwards
        rows, state, keys, ready = self._prefill(out)
        if len(self._batch):
            self._decode(out, joining=bool(rows), quiet=forwards == self._counters.prefill_forwards)
        if rows:
            self._join(rows, state, keys, ready)
        if self._ranks is not None:
            agree(self._decisions(out), self._ranks, what="the engine step's decisions")
        self._counters.step(started, out.tokens)
        return out.outputs()

    def stats(self) -> dict[str, Any]:
        """What a user would watch: rows running / prefilling, requests queued, tokens/s
        (over the last seconds), totals, draft acceptance, and the prefix cache's hits,
        misses, tokens served, entries and bytes."""
        c, cache = self._counters, self._cache
        return {
            "running": len(self._batch),
            "running_bytes": 0 if self._batch.state is None else nbytes(self._batch.state),
            "prefilling": len(self._prefilling),
            "queued": len(self._queue),
            "tokens_per_s": c.tokens_per_s(),
            "generated_tokens": c.generated_tokens,
            "prompt_tokens": c.prompt_tokens,
            "prefilled_tokens": c.prefilled_tokens,
            "prefill_forwards": c.prefill_forwards,
            "finished": c.finished,
            "cancelled": c.cancelled,
            "steps": c.steps,
            "rounds": c.rounds,
            "busy_s": c.busy_s,
            "drafted": c.drafted,
            "accepted": c.accepted,
            "acceptance": c.accepted / c.drafted if c.drafted else 0.0,
            "prefix_hits": cache.hits if cache else 0,
            "prefix_misses": cache.misses if cache else 0,
            "prefix_hit_tokens": cache.hit_tokens if cache else 0,
            "prefix_entries": len(cache) if cache else 0,
            "prefix_bytes": cache.nbytes if cache else 0,
            "prefix_max_bytes": cache.max_bytes if cache else 0,
            "prefix_evictions": cache.evictions if cache else 0,
        }

    @property
    def running(self) -> tuple[Request, ...]:
        """The requests of the running batch, in row order (none finished)."""
        return tuple(r.request for r in self._batch.rows)

    @property
    def prefilling(self) -> tuple[Request, ...]:
        """The requests being prefilled, oldest first."""
        return tuple(p.request for p in self._prefilling)

    @property
    def policy(self) -> CostAwarePolicy | None:
        """The drafting policy (None: no drafter, or fixed k): its `acceptance` per running
        row, `cost_ratio(w)` and `last` decision say why the rounds draft what they do."""
        return self._policy

    @property
    def prefix_cache(self) -> PrefixCache | None:
        """The prefix cache (None without one)."""
        return self._cache

    def save_prefix_cache(self, path: str | os.PathLike[str]) -> None:
        """Write the prefix cache to one file (`kvstate.save`)."""
        self._cache_or_raise("save_prefix_cache").save(path)

    def load_prefix_cache(self, path: str | os.PathLike[str]) -> int:
        """Add the entries of a file `save_prefix_cache` wrote (each state checked to fit this
        engine's model and states first); the number kept within the byte bound."""
        return self._cache_or_raise("load_prefix_cache").load(path, self._check_cached)

    # -- a step's phases --------------------------------------------------------------------

    def _free_cancelled(self, out: _Outputs) -> None:
        gone = self._queue.drop_cancelled()
        dropped = [p.request for p in self._prefilling if p.request.cancel_requested]
        if dropped:
            self._group.drop({r.id for r in dropped})
            self._prefilling = [p for p in self._prefilling if not p.request.cancel_requested]
        gone += dropped
        rows = self._batch.rows
        if any(r.request.cancel_requested for r in rows):
            alive = [i for i, r in enumerate(rows) if not r.request.cancel_requested]
            gone += [r.request for r in rows if r.request.cancel_requested]
            self._leave(alive)
        for request in gone:
            self._counters.cancelled += 1
            out.emit(request, [], None, "cancelled")

    def _admit(self) -> None:
        free = self.max_batch - len(self._batch) - len(self._prefilling)
        for request in self._queue.admit(free):
            self._counters.prompt_tokens += len(request.prompt)
            self._prefilling.append(
                Prefilling(
                    request,
                    block=self.prefill_chunk,
                    exact=self._cache is not None and not self._cache.cuts,
                    hidden=self._plan.hidden,
                )
            )

    def _begin(self, p: Prefilling) -> None:
        """Start a prompt's prefill from the longest prefix the cache holds (looked up when
        its first chunk is due, so it finds what the prompts admitted with it kept)."""
        hit = None
        if self._cache is not None:
            hit = self._cache.lookup(p.tokens, len(p.tokens) - 1)
        state, done = hit if hit is not None else (self._empty(), 0)
        p.request.cached_tokens = done
        p.begin(state, done)

    def _prefill(self, out: _Outputs) -> tuple[list[Row], Any, list[mx.array], list[Prefilling]]:
        """Begin prompts (oldest first) while fewer than `prefill_rows` prefill, run forwards
        of their next chunks and one of the last positions due (`prefill_chunk` positions in
        all); the prompts done, with their first token drawn, as rows ready to join
        (their batched state, their keys, their prefills)."""
        group = self._group
        starting: list[Prefilling] = []
        # Each prompt runs a position or two per step at least (a chunk, its last position):
        # at most half the budget's prompts at once keeps a step within the budget.
        limit = min(self.prefill_rows, max(1, self.prefill_chunk // 2))
        for p in self._prefilling:
            if len(group) + len(starting) >= limit:
                break
            if not p.begun and not self._waits(p, [*group.prompts, *starting]):
                self._begin(p)
                starting.append(p)
        group.add([p for p in starting if p.chunk > 0])
        due = [p for p in starting if p.chunk == 0]  # only the last position left
        states = [p.start for p in due]
        for p in due:
            p.start = None
        ran = 0
        reached: list[Prefilling] = []
        ends: list[Any] = []
        left = self.prefill_chunk - len(due)
        first = True
        while len(group) and left > 0:  # more forwards while chunks stopped short of budget
            n, state, done = group.advance(self.target, left, first=first)
            if n == 0:
                break
            first = False
            self._counters.prefill_forwards += 1
            ran += n
            left -= n + len(done)
            if done:
                ends.append(state)
                reached += done
        states = ends + states
        prompts = reached + due
        state = None
        if prompts:
            state = last_positions(self.target, joined(states), prompts, self._plan.hidden)
            self._counters.prefill_forwards += 1
        self._counters.prefilled_tokens += ran + len(prompts)
        for p in [*group.prompts, *prompts]:
            self._keep_snapshots(p)
        rows: list[Row] = []
        keys: list[mx.array] = []
        kept: list[int] = []
        for b, p in enumerate(prompts):
            self._prefilling.remove(p)
            row, key, reason = self._first_token(p, out)
            if reason is None:
                rows.append(row)
                keys.append(key)
                kept.append(b)
        if not kept:
            return [], None, [], []
        if len(kept) < len(prompts):
            state = filter(state, kept)
        return rows, state, keys, [prompts[b] for b in kept]

    def _waits(self, p: Prefilling, ahead: list[Prefilling]) -> bool:
        """Whether `p` had better wait for a prompt `ahead` of it to pass their common prefix
        (at least `_WAIT_GAIN` positions the prefix cache will then serve it) than prefill
        that prefix beside it."""
        if self._cache is None:
            return False
        body = p.tokens[:-1]
        for q in ahead:
            common = _common(q.tokens, body)
            if self._cache.cuts:
                served = min(common, len(q.tokens))
            elif common >= q.last:
                served = q.last  # its last-but-one position's state
            else:
                served = common // q.block * q.block  # a block boundary's
            if served >= min(_WAIT_GAIN, q.block) and q.done < served:
                return True
        return False

    def _first_token(self, p: Prefilling, out: _Outputs) -> tuple[Row, mx.array, str | None]:
        """Draw a prefilled request's first token with its own key; its row, its key after
        the draw, and why it finished at once (None: it goes on)."""
        request, logits = p.request, p.logits
        assert logits is not None
        params = request.params
        seed = params.seed if params.seed is not None else int(self._seeds.integers(2**63))
        # Row 0's key of `generate([prompt], seed=seed)`: a request alone draws its tokens.
        key = rows_of(generation_keys(seed)[0], 1)
        sampler = params.sampler
        if sampler.greedy:
            token = host_ints(logits.argmax(-1))[0]
        else:
            first_key = token_keys(fold_in(key, 0))
            token = host_ints(sampler.sample(sampler.probs(logits), first_key))[0]
        key = key[0]
        tokens, reason = cut([token], params.max_tokens, params.stop_ids)
        logprobs = chosen_logprobs(logits[:, None], {0: tokens})[0] if params.logprobs else None
        out.emit(request, tokens, logprobs, reason)
        self._finished(request, reason)
        return Row(request, token, list(request.prompt)), key, reason

    def _decode(self, out: _Outputs, *, joining: bool, quiet: bool) -> None:
        """One round for every running row; the finished ones leave. Its plain steps run
        pipelined (`run_round`'s `ahead`) unless rows join after it, or the model is split
        (each rank's step reads and agrees on every round) or the drafter takes hidden
        states (they come from the step's forward). `quiet`: no prefill forward ran this
        step."""
        ahead = not joining and self._ranks is None and not self._plan.hidden
        emitted, self._depth = run_round(
            self.target,
            self._batch,
            self._drafting,
            self._policy,
            k=self.k,
            plan=self._plan,
            vocab=self.vocab_size,
            counters=self._counters,
            ahead=ahead,
            quiet=quiet,
        )
        alive = []
        for b, (row, e) in enumerate(zip(self._batch.rows, emitted, strict=True)):
            out.emit(row.request, e.tokens, e.logprobs, e.reason)
            self._finished(row.request, e.reason)
            if e.reason is None:
                alive.append(b)
            elif self._cache is not None:  # a turn end: prompt and output, as the state holds
                turn = extract(self._batch.state, b)
                self._cache.insert(tuple(self._batch.held(b)), turn, cuttable=False)
        if len(alive) < len(self._batch):
            self._leave(alive)

    def _join(
        self, rows: list[Row], state: Any, keys: list[mx.array], ready: list[Prefilling]
    ) -> None:
        self._batch.join(rows, state, keys)
        if self._policy is not None:
            self._policy.join(len(rows))
        if self._drafting is not None:
            prompts = [list(p.tokens) for p in ready]
            hidden = [p.hidden_states() for p in ready] if self._drafting.hidden else []
            self._drafting.join(prompts, hidden)

    def _leave(self, alive: list[int]) -> None:
        self._batch.keep(alive)
        if self._policy is not None:
            self._policy.keep(alive)
        if self._drafting is not None:
            self._drafting.keep(alive)

    def _finished(self, request: Request, reason: str | None) -> None:
        if reason is not None:
            self._counters.finished += 1

    def _keep_snapshots(self, p: Prefilling) -> None:
        if self._cache is not None:
            for n, state in p.snapshots:
                self._cache.insert(p.tokens[:n], state)
        p.snapshots.clear()

    def _decisions(self, out: _Outputs) -> list[int]:
        """What every rank of a split model must have decided alike in a step (one list for
        `agree`): requests taken, rows running / prefilling / queued, the depth asked, and per
        output its request id, finish, and tokens (first tokens, accepted drafts, next
        tokens). Checked after the step's forwards and before its outputs are returned."""
        finishes = {None: 0, "stop": 1, "length": 2, "cancelled": 3}
        decided = [self._next_id, len(self._batch), len(self._prefilling), len(self._queue)]
        decided.append(self._depth)
        for o in out.outputs():
            decided += [o.request.id, finishes.get(o.finish_reason, 4), len(o.tokens), *o.tokens]
        return decided

    # -- the prefix cache's files -----------------------------------------------------------

    def _cache_or_raise(self, where: str) -> PrefixCache:
        if self._cache is None:
            raise StateError(f"{where}: this engine has no prefix cache (prefix_cache_bytes=0)")
        return self._cache

    def _check_cached(self, state: Any) -> None:
        """Refuse a loaded state that is not one row of this engine's states."""
        if batch_size(state) != 1:
            raise ShapeError(
                f"load_prefix_cache: a cached state must be one row; got {batch_size(state)}"
            )
        check_fits = getattr(self.target, "check_fits", None)
        if check_fits is not None:
            check_fits(state)
        if self._reference is None:
            _, self._reference = self.target(mx.array([[0]], mx.int32), self._empty())
        found = config_mismatches(config_of(self._reference), config_of(state))
        if config_of(self._reference) != config_of(state) and found:
            raise ConfigMismatchError(
                f"load_prefix_cache: a cached state does not match this engine's states "
                f"({'; '.join(found)}): it was saved by an engine of another model or kv_bits"
            )


class _Outputs:
    """A step's outputs, one per request, in the order they first emitted."""

    def __init__(self) -> None:
        self._by_id: dict[int, Output] = {}
        self.tokens = 0

    def emit(
        self, request: Request, tokens: list[int], logprobs: list[float] | None, reason: str | None
    ) -> None:
        """Record `request`'s new tokens and finish on the request and in the outputs."""
        now = time.perf_counter()
        if tokens and request.first_token_at is None:
            request.first_token_at = now
        request.tokens += tokens
        if request.logprobs is not None and logprobs is not None:
            request.logprobs += logprobs
        if reason is not None:
            request.finished, request.finish_reason, request.finished_at = True, reason, now
        self.tokens += len(tokens)
        before = self._by_id.get(request.id)
        if before is not None:
            tokens = [*before.tokens, *tokens]
            if before.logprobs is not None:
                logprobs = [*before.logprobs, *(logprobs or [])]
        self._by_id[request.id] = Output(
            request,
            tuple(tokens),
            None if logprobs is None else tuple(logprobs),
            request.finished,
            request.finish_reason,
        )

    def outputs(self) -> list[Output]:
        return list(self._by_id.values())


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of `a` and `b`'s common prefix."""
    n = min(len(a), len(b))
    if tuple(a[:n]) == tuple(b[:n]):
        return n
    return int(np.argmin(np.asarray(a[:n]) == np.asarray(b[:n])))


def _model_limit(target: Any) -> int | None:
    """The model's `max_position_embeddings` (a wrapped mlx-lm model's args), else None."""
    args = getattr(getattr(target, "model", None), "args", None)
    limit = getattr(args, "max_position_embeddings", None)
    return int(limit) if isinstance(limit, int) and limit > 0 else None
