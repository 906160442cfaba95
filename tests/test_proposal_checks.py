"""What the generator takes from a drafter besides the plain `Proposal` of an mx.array: drafts
as lists or NumPy (checked on the host), more drafts than the round asked for (cut to its
depth, up to `k`), filler past a row's count (never checked), and drafters written before
`start` took a key. Greedy output stays mlx-lm's."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from kvstate.adapters import wrap
from kvstate.adapters.tiny_models import tiny_model
from kvstate.speculative import Proposal, Sampler, generate

from .test_speculative import greedy

PROMPT = [3, 17, 42, 99, 7]
NEW = 12


class Oracle:
    """Proposes the true continuation, `width` drafts a round whatever it is asked, as
    `form` (mx / list / numpy), with `filler` past `used` drafts."""

    def __init__(self, truth: list[int], width: int, form: str, used: int | None = None) -> None:
        self.truth, self.width, self.form, self.used = truth, width, form, used
        self.at = 1
        self.asked: list[int] = []
        self.keys: list[Any] = []

    def start(self, prompts: list[list[int]], **kw: Any) -> None:
        self.keys.append(kw.get("key"))

    def propose(self, last: list[int], k: int, sampler: Sampler) -> Proposal:
        self.asked.append(k)
        used = self.width if self.used is None else self.used
        row = (self.truth + [0] * 16)[self.at : self.at + used] + [-1] * (self.width - used)
        tokens: Any = [row]
        if self.form == "mx":
            tokens = mx.array(tokens)
        elif self.form == "numpy":
            tokens = np.array(tokens, np.int64)
        return Proposal(tokens, [used], None)

    def accept(self, fed: mx.array, kept: list[int]) -> None:
        self.at += kept[0]

    def keep_rows(self, rows: list[int]) -> None:
        pass


@pytest.fixture(scope="module")
def model() -> Any:
    return tiny_model("llama", num_hidden_layers=2)


def run(model: Any, drafter: Any, k: int = 3) -> list[int]:
    target = wrap(model)
    return [t.token for r in generate(target, [PROMPT], drafter, k=k, max_tokens=NEW) for t in r]


@pytest.mark.parametrize("form", ["mx", "list", "numpy"])
def test_drafts_in_any_form_decode_like_greedy(model, form):
    truth = greedy(model, PROMPT, NEW + 8)
    assert run(model, Oracle(truth, 3, form)) == truth[:NEW]


def test_drafts_past_the_rounds_depth_are_cut_to_it(model):
    """The oracle proposes k = 3 drafts every round; near the end the generator asks for
    fewer and verifies only those."""
    truth = greedy(model, PROMPT, NEW + 8)
    drafter = Oracle(truth, 3, "mx")
    assert run(model, drafter) == truth[:NEW]
    assert min(drafter.asked) < 3  # the last rounds asked for fewer than it gave


@pytest.mark.parametrize("form", ["mx", "list"])
def test_filler_past_a_rows_count_is_not_checked(model, form):
    """Filler ids (-1 here) past counts[b] are never verified, so never refused."""
    truth = greedy(model, PROMPT, NEW + 8)
    assert run(model, Oracle(truth, 3, form, used=2)) == truth[:NEW]


def test_a_drafter_taking_keywords_is_handed_the_generators_key(model):
    drafter = Oracle(greedy(model, PROMPT, NEW + 8), 3, "mx")
    run(model, drafter)
    key = drafter.keys[0]
    assert isinstance(key, mx.array) and key.shape == (2,) and key.dtype == mx.uint32
