"""What the engine counts, for `Engine.stats()`."""

from __future__ import annotations

import time
from collections import deque

WINDOW_S = 10.0  # tokens_per_s: over the steps of the last WINDOW_S seconds


class Counters:
    """Totals since the engine started, and a window of recent steps for the rate."""

    def __init__(self) -> None:
        self.steps = 0
        self.generated_tokens = 0
        self.prompt_tokens = 0  # prompts admitted, all their tokens
        self.prefilled_tokens = 0  # prompt tokens run through the target
        self.prefill_forwards = 0  # the target's forwards over prompts (several per forward)
        self.finished = 0
        self.cancelled = 0
        self.rounds = 0
        self.drafted = 0  # drafts verified (each row's drafted count, summed)
        self.accepted = 0  # drafts accepted
        self.busy_s = 0.0  # time inside step()
        self._recent: deque[tuple[float, int, float]] = deque()  # (end, tokens, seconds)

    def step(self, started: float, tokens: int) -> None:
        """A step that began at `started` (time.perf_counter) and emitted `tokens`."""
        now = time.perf_counter()
        self.steps += 1
        self.generated_tokens += tokens
        self.busy_s += now - started
        self._recent.append((now, tokens, now - started))
        while self._recent and self._recent[0][0] < now - WINDOW_S:
            self._recent.popleft()

    def tokens_per_s(self) -> float:
        """Tokens emitted per second of wall time over the recent window (0 when idle)."""
        if not self._recent:
            return 0.0
        first_end, _, first_took = self._recent[0]
        span = self._recent[-1][0] - (first_end - first_took)
        tokens = sum(t for _, t, _ in self._recent)
        return tokens / span if span > 0 else 0.0
