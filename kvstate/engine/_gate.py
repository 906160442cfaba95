"""Which rows' drafts a round verifies.

A verify feeds every row 1 + span tokens, so one row's drafts cost every row their
positions; drafts that are rejected (an n-gram lookup on prose matches by chance) make a
round slower than a plain step. So each row keeps a running acceptance rate, and a row whose
drafts have been rejected lately drafts nothing (its count is cut to 0) except once every
`PROBE` rounds, so it finds out when its text turns repetitive again; drafts past a row's
remaining tokens are cut too. The held-back rows probe on the same rounds (one round in
`PROBE`), not each on its own: a verify costs every row alike, so probes spread over the
rounds would make every round a verify. Cutting counts never changes a token (a row that drafts
nothing takes the target's own next token), only what a round costs.
"""

from __future__ import annotations

from typing import Any

from ..speculative import Proposal, Sampler

START = 0.3  # a new row's acceptance rate: it drafts (two rejections stop it)
LEAST = 0.2  # below this a row stops drafting, but for probes
WEIGHT = 0.3  # of the last round in the running rate
PROBE = 16  # rounds between the held-back rows' probes


class RowGate:
    """Per row: its running acceptance rate; and the rounds so far (for the probes)."""

    def __init__(self) -> None:
        self.rates: list[float] = []
        self.rounds = 0
        self.counts: list[int] = []  # the drafts each row verified in the last round

    def join(self, n: int) -> None:
        self.rates += [START] * n

    def keep(self, alive: list[int]) -> None:
        self.rates = [self.rates[i] for i in alive]

    def gated(self, drafter: Any, remaining: list[int]) -> Any:
        """`drafter` whose proposals are cut as the module docstring says."""
        return _Gated(drafter, self, remaining)

    def cut(self, counts: list[int], remaining: list[int]) -> list[int]:
        probe = self.rounds % PROBE == PROBE - 1
        out = []
        for b, c in enumerate(counts):
            allowed = probe or self.rates[b] >= LEAST
            out.append(min(c, remaining[b] - 1) if allowed else 0)
        self.counts = out
        return out

    def update(self, accepted: list[int]) -> None:
        """After the round: each row's rate moves toward its accepted / drafted."""
        for b, d in enumerate(self.counts):
            if d > 0:
                self.rates[b] = (1 - WEIGHT) * self.rates[b] + WEIGHT * accepted[b] / d
        self.counts = []
        self.rounds += 1


class _Gated:
    """A drafter's `propose`, with each row's count cut by the gate."""

    def __init__(self, drafter: Any, gate: RowGate, remaining: list[int]) -> None:
        self.drafter, self.gate, self.remaining = drafter, gate, remaining

    def propose(self, last: list[int], k: int, sampler: Sampler) -> Proposal:
        proposal = self.drafter.propose(last, k, sampler)
        counts = getattr(proposal, "counts", None)
        if not isinstance(proposal, Proposal) or not isinstance(counts, (list, tuple)):
            return proposal  # the round's checks refuse it, naming what is wrong
        if len(counts) != len(last) or not all(isinstance(c, int) for c in counts):
            return proposal
        # The verify's span follows: the round cuts the tokens to max(counts).
        return Proposal(
            proposal.tokens, self.gate.cut(list(counts), self.remaining), proposal.probs
        )
