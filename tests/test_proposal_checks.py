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


# ------------------------------------------------------------- values the generator made
# A kvstate drafter's proposal (`Drafted`) and the generator's own `last` / `kept` (`Made`)
# skip the checks a user's values get, but only where they fit: anything else is checked.


def test_kvstate_drafters_propose_made_drafts_bounded_by_their_logits(model):
    from kvstate.speculative import ModelDrafter, NGramDrafter
    from kvstate.speculative._drafter import Drafted

    drafter = ModelDrafter(wrap(model))
    drafter.start([PROMPT])
    made = drafter.propose([5], 3, Sampler())
    assert isinstance(made, Drafted) and made.bound == 256
    ngram = NGramDrafter()
    ngram.start([[3, 200, 3, 7]])
    looked_up = ngram.propose([3], 2, Sampler())
    assert isinstance(looked_up, Drafted) and looked_up.bound == 201
    assert looked_up.counts[0] > 0 and max(looked_up.tokens.tolist()[0]) < 201


@pytest.mark.parametrize("sampled", [False, True])
def test_a_made_proposal_past_its_bound_is_checked_in_full(model, sampled):
    """A `Drafted` whose bound is wider than the target's vocabulary (and than its probs)
    goes through the device check: an id past the vocabulary is refused, as a user's is."""
    from kvstate import TokenError
    from kvstate.speculative._drafter import Drafted

    class Wide(Oracle):
        def propose(self, last: list[int], k: int, sampler: Sampler) -> Proposal:
            probs = None
            if not sampler.greedy:
                probs = mx.full((1, 2, 256), 1 / 256)
            return Drafted(mx.array([[300, 5]]), [2], probs, 512)

    sampler = Sampler(temperature=1.0) if sampled else Sampler()
    with pytest.raises(TokenError, match="300"):
        list(generate(wrap(model), [PROMPT], Wide([], 2, "mx"), k=2, max_tokens=4,
                      sampler=sampler))  # fmt: skip


def test_the_generators_own_ids_are_still_checked_against_a_narrower_vocabulary():
    """`Made` ids skip the type checks, never the drafter's own vocabulary (a target's token
    past a draft model's vocabulary would be read out of bounds), nor the row count."""
    from kvstate import StateError, TokenError
    from kvstate.speculative._checks import checked_kept, checked_last
    from kvstate.speculative._values import Made

    assert checked_last(Made([3, 4]), 2, 256, "d") == [3, 4]
    with pytest.raises(TokenError, match="300"):
        checked_last(Made([300]), 1, 256, "d")
    with pytest.raises(TokenError, match="rows"):
        checked_last(Made([1, 2]), 1, 256, "d")
    fed = mx.array([[1, 2, 3]])
    assert checked_kept(fed, Made([2]), 1, 3, "d") == [2]
    with pytest.raises(StateError, match="kept"):
        checked_kept(fed, Made([3]), 1, 2, "d")  # more than the last proposal can keep
