"""Plain decoding (no drafter), pipelined like mlx-lm's `generate_step`: the next step's
forward is built and set evaluating before this step's tokens are read back, so the device
runs one step while the host reads, yields and builds the next."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import mlx.core as mx

from .. import filter
from ..distributed import agree
from ..kinds import host_ints
from ._emit import Token, logprobs_of
from ._generation import Finals, View
from ._kv_quantization import KVQuantization
from ._position_keys import fold_in, token_keys
from ._processors import Processors
from ._sampling import Sampler, pick
from ._target import Target


def decode(
    target: Target,
    first: mx.array,
    state: Any,
    *,
    max_tokens: int,
    sampler: Sampler,
    eos: Sequence[int],
    keys: mx.array | None,
    group: Any,
    processors: Processors | None = None,
    quantization: KVQuantization | None = None,
    finals: Finals | None = None,
) -> Iterator[list[Token]]:
    """`generate` without a drafter, after the prefill (`first`: its last logits (B, vocab),
    processed; `state`: the batched state): one token per live row each round, the same
    tokens as one synchronous step a round would give; row b's token at position t drawn
    with `fold_in(keys[b], t)` (`_position_keys`; `keys` None when greedy).
    `max_tokens` >= 1. `processors` / `quantization`: applied after every step's forward;
    `finals`: each row's final state is recorded there as it ends."""
    y = pick(sampler, first, _at(keys, 0))
    logprobs = logprobs_of(first)
    mx.async_eval(y, logprobs)
    rows = list(range(first.shape[0]))
    emitted = 0  # tokens so far, the same for every live row
    while True:
        more = emitted + 1 < max_tokens
        if more:  # the next step, from this step's unread tokens
            logits, state = target(y[:, None], state)
            if quantization is not None:
                state = quantization.after(state)
            last = logits[:, -1]
            if processors is not None:
                last = processors.step(last, y)
            y_next = pick(sampler, last, _at(keys, emitted + 1))
            logprobs_next = logprobs_of(last)
            mx.async_eval(y_next, logprobs_next)
        tokens = host_ints(y)
        if group is not None:
            agree(tokens, group, what="the sampled tokens" if emitted else "the first tokens")
        out = [
            Token(r, t, logprobs[i], False)
            for i, (r, t) in enumerate(zip(rows, tokens, strict=True))
        ]
        emitted += 1
        if finals is not None:  # the state holds this step's tokens once the next is built
            finals.hold(_fixed(state, rows, _pending(tokens, more)))
        yield out
        if finals is not None:
            finals.release()  # before the next forward: it writes the KV buffers in place
        alive = [i for i, t in enumerate(tokens) if t not in eos]
        if not more or not alive:
            if finals is not None:
                finals.finish(state, list(range(len(rows))), rows, _pending(tokens, more))
            return
        if len(alive) < len(rows):
            if finals is not None:
                ended = [i for i in range(len(rows)) if i not in alive]
                finals.finish(state, ended, [rows[i] for i in ended], [None] * len(ended))
            keep = mx.array(alive)
            state, y_next, logprobs_next = filter(state, alive), y_next[keep], logprobs_next[keep]
            keys = None if keys is None else keys[keep]
            rows = [rows[i] for i in alive]
            if processors is not None:
                processors.keep(alive)
        y, logprobs = y_next, logprobs_next


def _at(keys: mx.array | None, position: int) -> mx.array | None:
    """The keys (B, 2) the rows' tokens at `position` draw with (None when greedy)."""
    return None if keys is None else token_keys(fold_in(keys, position))


def _fixed(state: Any, rows: list[int], pending: list[int | None]) -> View:
    """The view of every row of `state` (see `Finals.hold`)."""
    positions = list(range(len(rows)))
    return lambda: (state, positions, rows, pending)


def _pending(tokens: list[int], more: bool) -> list[int | None]:
    """The tokens the state does not hold yet: this step's, unless the next step (which
    feeds them) was built."""
    return [None if more else t for t in tokens]
