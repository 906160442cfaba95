"""Plain decoding (no drafter), pipelined like mlx-lm's `generate_step`: the next step's
forward is built and set evaluating before this step's tokens are read back, so the device
runs one step while the host reads, yields and builds the next."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import mlx.core as mx

from .. import filter
from ..distributed import agree
from ..kinds import host_ints
from ._emit import Token, logprobs_of
from ._prefill import PREFILL_STEP, prefill
from ._sampling import Sampler, draw
from ._target import Target


def decode(
    target: Target,
    prompts: Sequence[Sequence[int]],
    *,
    max_tokens: int,
    sampler: Sampler,
    eos: Sequence[int],
    key: mx.array,
    group: Any,
    prefill_step_size: int = PREFILL_STEP,
    prompt_progress: Callable[[int, int], None] | None = None,
) -> Iterator[list[Token]]:
    """`generate` without a drafter: one token per live row each round, the same tokens (and
    the same draws of `key`) as one synchronous step a round would give."""
    logits, state, _ = prefill(target, prompts, step=prefill_step_size, progress=prompt_progress)
    key, y = draw(sampler, logits, key)
    logprobs = logprobs_of(logits)
    mx.async_eval(y, logprobs)
    rows = list(range(len(prompts)))
    emitted = 0  # tokens so far, the same for every live row
    while True:
        more = emitted + 1 < max_tokens
        if more:  # the next step, from this step's unread tokens
            logits, state = target(y[:, None], state)
            key, y_next = draw(sampler, logits[:, -1], key)
            logprobs_next = logprobs_of(logits[:, -1])
            mx.async_eval(y_next, logprobs_next)
        tokens = host_ints(y)
        if group is not None:
            agree(tokens, group, what="the sampled tokens" if emitted else "the first tokens")
        out = [
            Token(r, t, logprobs[i], False)
            for i, (r, t) in enumerate(zip(rows, tokens, strict=True))
        ]
        emitted += 1
        yield out
        alive = [i for i, t in enumerate(tokens) if t not in eos]
        if not more or not alive:
            return
        if len(alive) < len(rows):
            keep = mx.array(alive)
            state, y_next, logprobs_next = filter(state, alive), y_next[keep], logprobs_next[keep]
            rows = [rows[i] for i in alive]
        y, logprobs = y_next, logprobs_next
