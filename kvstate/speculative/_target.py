"""What the generator and the drafters need of a model: the `Target` protocol (a wrapped model,
`kvstate.adapters.wrap(model)`, is one), the optional abilities a target may add, and
`Abilities.of`, the one place that probes for them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import mlx.core as mx

from ..distributed import group_of

Pick = Callable[[mx.array], mx.array]
"""(B, vocab) logits of a step's last position -> (B,) or (B, 1) integer ids: the next input."""

Progress = Callable[[int, int], None]
"""`progress(processed, total)`: prompt tokens a prefill has run through the model so far."""


class Target(Protocol):
    """A model as the generator, the verify functions and `ModelDrafter` call it: a pure view
    whose forward takes a kvstate state and returns a new one.

    Optional abilities (see `Abilities`): `tree_forward` (`TreeTarget`: tree verification),
    `chain` (`ChainTarget`: a draft model's steps on its own caches), `prefill`
    (`PrefillTarget`: a prompt's forward in chunks; without it the generator runs the same
    chunks through the calls) and `group` (a model split over processes with
    `mx.distributed`: its ranks' decisions are checked to agree).
    """

    @property
    def vocab_size(self) -> int:
        """The ids the model takes are 0 .. vocab_size - 1 (a target may leave it out: tree
        rounds then do not check the drafted ids against it)."""
        ...

    def init_state(self, batch_size: int = 1) -> Any:
        """An empty state for `batch_size` rows. (`generate(max_kv_size=n)` calls
        `init_state(batch, max_kv_size=n)`, which a wrapped model takes: rotating caches of
        n positions, as mlx-lm's `make_prompt_cache(model, max_kv_size)`.)"""
        ...

    def __call__(
        self, tokens: Any, state: Any, *, capture: bool = False, hidden: bool = False
    ) -> Any:
        """`tokens` (B, T) int ids from `state` -> `(logits (B, T, vocab), state)`, then the
        checkpoints `commit_prefix` needs when `capture`, then the final hidden states
        (B, T, D) when `hidden`: `logits, state[, checkpoints][, hidden]`."""
        ...


class TreeTarget(Target, Protocol):
    """A target that verifies a token tree in one forward (`verify_tree`)."""

    def tree_forward(
        self, tokens: Any, state: Any, parents: Sequence[int]
    ) -> tuple[mx.array, Any, Any]:
        """One forward of `tokens` (1, T) over a batch-1 `state`, token q attending to its
        ancestors only (`parents[q]`, -1 for q = 0): `(logits (1, T, vocab), state with all
        T appended, checkpoints by input position)`."""
        ...


class ChainTarget(Target, Protocol):
    """A target that runs a draft model's one-token steps on its own caches."""

    def chain(
        self, tokens: Any, state: Any, steps: int, pick: Pick
    ) -> tuple[mx.array, mx.array, Any]:
        """`tokens` (B, T) from `state`, then `steps - 1` one-token forwards each fed
        `pick(last logits)`, and one pick more: `(logits (B, steps, vocab), picks (B, steps),
        state)`, the state as the plain calls would give it."""
        ...


class PrefillTarget(Target, Protocol):
    """A target with its own prefill (a wrapped model's `prefill`)."""

    def prefill(
        self,
        tokens: Any,
        state: Any,
        *,
        step: int = 2048,
        progress: Progress | None = None,
        hidden: bool = False,
    ) -> Any:
        """`tokens` (B, L) from `state` as mlx-lm's `generate_step` prefills: chunks of
        `step` positions, each evaluated as it is built, the logits of the last position
        only: `(logits (B, vocab), state)`, then the final hidden states (B, L, D) when
        `hidden`, evaluated; `progress(processed, total)` with 0 first and `total` last."""
        ...


class Abilities(NamedTuple):
    """The optional parts of a target, probed once (at `generate()` and `ModelDrafter()`
    entry, or where a public verify function starts) instead of wherever they are used."""

    vocab_size: int | None  # None: the target does not say (tree rounds skip the id check)
    tree_forward: Callable[..., tuple[mx.array, Any, Any]] | None
    chain: Callable[..., tuple[mx.array, mx.array, Any]] | None
    group: Any  # the distributed group of a split model; None in one process
    prefill: Callable[..., Any] | None = None  # PrefillTarget.prefill

    @classmethod
    def of(cls, target: Target) -> Abilities:
        return cls(
            getattr(target, "vocab_size", None),
            getattr(target, "tree_forward", None),
            getattr(target, "chain", None),
            group_of(target),
            getattr(target, "prefill", None),
        )
