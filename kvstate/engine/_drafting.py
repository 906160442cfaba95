"""The engine's drafter: which one (None, "ngram", a drafter, a factory of one), and its rows
kept in step with the running batch's as rows join (`start`, then `add_rows`) and leave
(`keep_rows`; when the last row leaves, the next join starts it afresh with a new key)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from .. import NotSupportedError, StateError
from ..speculative import NGramDrafter


def resolve(drafter: Any) -> Any:
    """A drafter instance from the engine's `drafter` argument: None, "ngram" (an
    `NGramDrafter()`), a drafter (anything with `propose`), or a callable that builds one.
    It must be able to admit rows between rounds (`add_rows`)."""
    if drafter is None:
        return None
    if isinstance(drafter, str):
        if drafter != "ngram":
            raise StateError(
                f"Engine: drafter must be None, 'ngram', a drafter or a factory of one; got "
                f"{drafter!r}"
            )
        return NGramDrafter()
    is_drafter = not isinstance(drafter, type) and callable(getattr(drafter, "propose", None))
    made = drafter if is_drafter else None
    if made is None and callable(drafter):
        made = drafter()
    if made is None or not callable(getattr(made, "propose", None)):
        raise StateError(
            f"Engine: drafter must be None, 'ngram', a drafter (with propose / accept / "
            f"keep_rows) or a factory of one; got {type(drafter).__name__}"
        )
    if not callable(getattr(made, "add_rows", None)):
        raise NotSupportedError(
            f"Engine: the drafter {type(made).__name__} cannot admit rows between rounds (it "
            "has no add_rows(prompts)); a serving batch changes every round. NGramDrafter, "
            "ModelDrafter and MTPDrafter can"
        )
    return made


class Drafting:
    """`drafter` over the running rows. `prefills`: it runs a model of its own over the
    prompts (told the engine's chunk size); `hidden`: it takes the target's hidden states
    (an MTP head). `key`: the drafter side of the engine's seed, split for each start."""

    def __init__(self, drafter: Any, chunk: int, key: mx.array) -> None:
        self.drafter = drafter
        self.rows = 0
        self.chunk = chunk
        self.key = key
        self.prefills = bool(getattr(drafter, "prefills", False))
        self.hidden = bool(getattr(drafter, "uses_hidden", False))

    def join(self, prompts: list[list[int]], hidden: list[mx.array]) -> None:
        """Rows for these prompts (the target prefilled them) after the current ones."""
        extra: dict[str, Any] = {"prefill_step_size": self.chunk} if self.prefills else {}
        if self.hidden:
            extra["hidden"] = hidden
        if self.rows == 0:
            self.key, key = mx.random.split(self.key)
            self.drafter.start(prompts, key=key, **extra)
        else:
            self.drafter.add_rows(prompts, **extra)
        self.rows += len(prompts)

    def keep(self, alive: list[int]) -> None:
        """Only the rows at positions `alive` stay (none: the drafter is started again at the
        next join)."""
        if alive:
            self.drafter.keep_rows(alive)
        self.rows = len(alive)

    def accept(self, fed: mx.array, kept: list[int], hidden: mx.array | None) -> None:
        self.drafter.accept(fed, kept, **({"hidden": hidden} if self.hidden else {}))
