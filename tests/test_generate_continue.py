"""`generate(..., states=..., keep_states=True)`: continuing from a state equals one generation
over the whole conversation (the first prompt, what was generated, the new prompt), for every
architecture of the tiny models, with and without speculation, greedy and sampled with the
same seed, for rows whose states differ in length (and rows that start fresh), after turns
that ended at max_tokens or at an end token inside the accepted drafts, and across
`kvstate.save` / `kvstate.load` in another process (a prompt cache made of saved states)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

import kvstate as ks
from kvstate.adapters import wrap
from kvstate.adapters.tiny_models import CONFIGS, tiny_model
from kvstate.speculative import (
    CostAwarePolicy,
    FixedCost,
    ModelDrafter,
    NGramDrafter,
    Sampler,
    generate,
)
from tests.helpers import ScriptedDrafter

ARCHITECTURES = list(CONFIGS)  # llama qwen3 gemma3_text qwen3_next mamba2 nemotron_h ...
FIRST = [[3, 17, 42, 99, 7, 250, 31, 8, 120], [100, 101, 102, 5]]
SECOND = [[64, 5, 77, 1, 200], [9, 9, 40]]
HOT = Sampler(temperature=1.0, top_k=20)
ROOT = Path(__file__).resolve().parent.parent


def rows_of(generation: Any, n: int) -> list[list[int]]:
    out: list[list[int]] = [[] for _ in range(n)]
    for tokens in generation:
        for t in tokens:
            out[t.row].append(t.token)
    return out


def drafter_of(mode: str, draft: Any) -> Any:
    return {"plain": None, "model": ModelDrafter(draft) if draft else None,
            "ngram": NGramDrafter()}[mode]  # fmt: skip


def untimed() -> CostAwarePolicy:
    """The default policy over scripted costs: its choices depend on the rows' history only.
    The default one times its rounds, and under sampling another choice of drafts gives other
    (equally distributed) tokens: on a loaded machine the two runs below then differ."""
    return CostAwarePolicy(cost=FixedCost(lambda w: 1 + 0.1 * w))


@pytest.fixture(scope="module", params=ARCHITECTURES)
def models(request: Any) -> tuple[Any, Any]:
    target = wrap(tiny_model(request.param))
    draft = wrap(tiny_model(request.param, scale=3.8, seed=1))
    return target, draft


@pytest.mark.parametrize("mode", ["plain", "model", "ngram"])
@pytest.mark.parametrize("sampler", [None, HOT], ids=["greedy", "sampled"])
def test_continuing_equals_one_generation_over_the_whole_conversation(
    models: tuple[Any, Any], mode: str, sampler: Any
) -> None:
    """Turn 1: two prompts of different lengths (so states of different lengths); turn 2:
    row 0 continues its state, row 1 its state too, and a third row starts fresh; the
    whole generation runs each conversation from scratch with the same seed."""
    target, draft = models
    first = generate(target, FIRST, drafter_of(mode, draft), max_tokens=6, sampler=sampler,
                     seed=3, keep_states=True, policy=untimed())  # fmt: skip
    out1 = rows_of(first, 2)
    assert all(len(r) == 6 for r in out1)
    states = first.states
    assert [ks.batch_size(s) for s in states] == [1, 1]
    history = [p + o for p, o in zip(FIRST, out1, strict=True)]
    prompts = [*SECOND, [7, 7, 8]]
    cont = generate(target, prompts, drafter_of(mode, draft), max_tokens=8, sampler=sampler,
                    seed=5, states=[*states, None], history=[*history, None],
                    policy=untimed())  # fmt: skip
    whole = generate(target, [history[0] + SECOND[0], history[1] + SECOND[1], [7, 7, 8]],
                     drafter_of(mode, draft), max_tokens=8, sampler=sampler, seed=5,
                     policy=untimed())  # fmt: skip
    assert rows_of(cont, 3) == rows_of(whole, 3)


@pytest.mark.parametrize("name", ["llama", "gemma3_text", "qwen3_next", "mamba2", "falcon_h1"])
def test_a_turn_ended_inside_its_accepted_drafts_leaves_exactly_its_tokens(name: str) -> None:
    """Turn 1 with a scripted drafter that is often right: rows end at max_tokens or at an
    end token while drafts past it were accepted (its room and eos cut the kept drafts).
    Each row's final state holds exactly prompt + emitted: continuing it greedily equals
    the whole conversation's greedy generation."""
    model = tiny_model(name)
    target = wrap(model)
    truth = rows_of(generate(target, FIRST, None, max_tokens=24), 2)
    stop = truth[0][2]  # inside the first round's drafts (tokens 1..4)
    for eos, p in [((), 0.8), ((stop,), 1.0), ((stop,), 0.6)]:
        first = generate(target, FIRST, ScriptedDrafter(truth, p, seed=1), k=4, max_tokens=11,
                         eos=eos, keep_states=True)  # fmt: skip
        out1 = rows_of(first, 2)
        for row, want in zip(out1, truth, strict=True):
            assert row == (want[: want.index(stop) + 1] if eos and stop in want[:11] else
                           want[:11])  # fmt: skip
        history = [a + b for a, b in zip(FIRST, out1, strict=True)]
        cont = rows_of(generate(target, SECOND, None, max_tokens=5, states=first.states), 2)
        whole = [h + s for h, s in zip(history, SECOND, strict=True)]
        assert cont == rows_of(generate(target, whole, None, max_tokens=5), 2), (eos, p)


def test_a_chat_turn_after_turn_keeps_one_state() -> None:
    """Three turns, each continuing the last one's state (with a draft model and prompt
    lookup alternating): the same tokens as the whole conversation generated at once."""
    target = wrap(tiny_model("qwen3_next"))
    draft = wrap(tiny_model("qwen3_next", scale=3.8, seed=1))
    turns = [[3, 17, 42, 99], [64, 5], [9, 9, 40, 41]]
    state, history = None, []
    for i, turn in enumerate(turns):
        drafter = ModelDrafter(draft) if i % 2 else NGramDrafter()
        g = generate(target, [turn], drafter, max_tokens=7, keep_states=True,
                     states=None if state is None else [state],
                     history=None if state is None else [history])  # fmt: skip
        out = rows_of(g, 1)[0]
        want = rows_of(generate(target, [history + turn], None, max_tokens=7), 1)[0]
        assert out == want, i
        state, history = g.states[0], history + turn + out


def test_states_of_a_generation_stopped_early_hold_what_it_emitted() -> None:
    """A `break` after two rounds: the states hold each row's prompt and its tokens so
    far (its last one included), with a drafter and without."""
    target = wrap(tiny_model("llama"))
    for drafter in (None, ModelDrafter(wrap(tiny_model("llama", scale=3.8, seed=1)))):
        g = generate(target, FIRST, drafter, max_tokens=20, keep_states=True)
        out: list[list[int]] = [[], []]
        for n, tokens in enumerate(g):
            for t in tokens:
                out[t.row].append(t.token)
            if n == 1:
                break
        states = g.states
        for row in range(2):
            cont = rows_of(generate(target, [SECOND[row]], None, max_tokens=4,
                                    states=[states[row]]), 1)  # fmt: skip
            whole = rows_of(generate(target, [FIRST[row] + out[row] + SECOND[row]], None,
                                     max_tokens=4), 1)  # fmt: skip
            assert cont == whole


def test_max_tokens_0_prefills_a_prompt_cache() -> None:
    """`max_tokens=0` yields nothing; its states hold the prompts: a prompt cache."""
    target = wrap(tiny_model("gemma3_text"))
    g = generate(target, FIRST, None, max_tokens=0, keep_states=True)
    assert list(g) == []
    cont = rows_of(generate(target, SECOND, None, max_tokens=6, states=g.states), 2)
    whole = [a + b for a, b in zip(FIRST, SECOND, strict=True)]
    assert cont == rows_of(generate(target, whole, None, max_tokens=6), 2)


def test_states_are_not_kept_unless_asked_and_not_before_a_round() -> None:
    target = wrap(tiny_model("llama"))
    g = generate(target, FIRST, None, max_tokens=2)
    list(g)
    with pytest.raises(ks.StateError, match="keep_states=True"):
        _ = g.states
    with pytest.raises(ks.StateError, match="iterate"):
        _ = generate(target, FIRST, None, max_tokens=2, keep_states=True).states


def test_the_state_passed_in_is_left_as_it_was() -> None:
    target = wrap(tiny_model("qwen3_next"))
    g = generate(target, [FIRST[0]], None, max_tokens=3, keep_states=True)
    list(g)
    state = g.states[0]
    before = [np.array(a) for a in ks.tree_flatten(state)[0]]
    list(generate(target, [SECOND[0]], NGramDrafter(), max_tokens=6, states=[state]))
    for a, b in zip(before, ks.tree_flatten(state)[0], strict=True):
        np.testing.assert_array_equal(a, np.array(b))


SAVE = """
import json, sys
import kvstate as ks
from kvstate.adapters import wrap
from kvstate.adapters.tiny_models import tiny_model
from kvstate.speculative import generate
target = wrap(tiny_model({name!r}))
g = generate(target, {first!r}, None, max_tokens=5, keep_states=True)
out = [[t.token for t in r] for r in g]
out = [[t for r in out for t in r][i::{rows}] for i in range({rows})]
for i, (state, p, o) in enumerate(zip(g.states, {first!r}, out)):
    ks.save(sys.argv[1] + f"/{{i}}.safetensors", state, {{"history": json.dumps(p + o)}})
"""

LOAD = """
import json, sys
import kvstate as ks
from kvstate.adapters import wrap
from kvstate.adapters.tiny_models import tiny_model
from kvstate.speculative import ModelDrafter, generate
target = wrap(tiny_model({name!r}))
loaded = [ks.load(sys.argv[1] + f"/{{i}}.safetensors", return_metadata=True)
          for i in range({rows})]
states = [s for s, _ in loaded]
history = [json.loads(m["history"]) for _, m in loaded]
drafter = ModelDrafter(wrap(tiny_model({name!r}, scale=3.8, seed=1)))
g = generate(target, {second!r}, drafter, max_tokens=6, states=states, history=history)
rows = [[] for _ in range({rows})]
for tokens in g:
    for t in tokens:
        rows[t.row].append(t.token)
print(json.dumps({{"history": history, "rows": rows}}))
"""


@pytest.mark.parametrize("name", ["llama", "nemotron_h"])
def test_a_prompt_cache_of_saved_states_continues_in_another_process(
    name: str, tmp_path: Path
) -> None:
    """Process 1 generates and saves each row's final state (its ids in the metadata);
    process 2 loads them and continues with a draft model: the tokens of the whole
    conversation generated here, in one go."""
    fill = {"name": name, "first": FIRST, "second": SECOND, "rows": 2}
    env = {"PYTHONPATH": str(ROOT)}
    for script in (SAVE, LOAD):
        done = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(script.format(**fill)), str(tmp_path)],
            capture_output=True, text=True, timeout=300, cwd=ROOT,
            env={**__import__("os").environ, **env},
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    target = wrap(tiny_model(name))
    first = rows_of(generate(target, FIRST, None, max_tokens=5), 2)
    assert got["history"] == [p + o for p, o in zip(FIRST, first, strict=True)]
    whole = [h + s for h, s in zip(got["history"], SECOND, strict=True)]
    assert got["rows"] == rows_of(generate(target, whole, None, max_tokens=6), 2)


def test_continuing_rows_of_one_batch_state_via_extract() -> None:
    """A batched state's rows continue one by one after `kvstate.extract`."""
    target = wrap(tiny_model("llama"))
    _, state = target(mx.array([[1, 2, 3], [4, 5, 6]]), target.init_state(2))
    rows = [ks.extract(state, i) for i in range(2)]
    cont = rows_of(generate(target, [[7], [8]], None, max_tokens=4, states=rows), 2)
    assert cont == rows_of(generate(target, [[1, 2, 3, 7], [4, 5, 6, 8]], None, max_tokens=4), 2)
