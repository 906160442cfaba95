"""One rank of tests/test_distributed.py, started by `mlx.launch --backend ring -n 2` (or
`--backend nccl`, one GPU each: the backend named by KVSTATE_DIST_BACKEND).

Every rank runs the same checks on tiny random-init models split over the group (llama and a
qwen3_5-style hybrid tensor-sharded, a qwen3_next-style model pipelined) against the same
model run whole in this process (mlx-lm's own generate_step and caches: the oracle): `wrap`,
the generator and the serving engine (`kvstate.engine`), and writes what it saw to OUT/rank<r>.json; the parent test compares the ranks and asserts.
A check that raises is recorded, not fatal, so the other checks still report.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any

import mlx.core as mx

# Run as a script by mlx.launch: this directory is first on sys.path.
from engine_helpers import Oracle, OracleDrafter  # type: ignore[import-not-found]
from helpers import ScriptedDrafter  # type: ignore[import-not-found]
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

import kvstate as ks
from kvstate import distributed
from kvstate.adapters import wrap
from kvstate.adapters.tiny_models import tiny_model
from kvstate.engine import Engine, RequestParams
from kvstate.speculative import Proposal, Sampler, generate, verify_paths
from kvstate.testing import assert_states_allclose, assert_states_equal

NEW = 16
PROMPT = [3, 17, 42, 99, 7, 250, 31, 8]
PROMPTS = [[3, 17, 42, 99, 7, 250, 31, 8, 120], [100, 101, 102], [7, 7, 40, 41, 42]]

MODELS: dict[str, tuple[str, dict[str, Any], str]] = {
    "llama": ("llama", {}, "shard"),
    "qwen3_5": ("qwen3_next", {"model_type": "qwen3_5", "num_experts": 0}, "shard"),
    "qwen3_next": ("qwen3_next", {}, "pipeline"),
}


RANK_STATES: dict[str, list[ks.ModelState]] = {}


def build(name: str, group: Any = None) -> Any:
    arch, overrides, how = MODELS[name]
    model = tiny_model(arch, **overrides)
    if group is not None:
        model.shard(group) if how == "shard" else model.model.pipeline(group)
    return model


def greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n)]


def barrier(group: Any) -> None:
    distributed.agree([1], group, what="barrier")


def rounds(target: Any, prompts: list[list[int]], drafter: Any) -> list[list[list[int]]]:
    """Every round's tokens as [row, token, from_draft]."""
    return [
        [[t.row, t.token, int(t.from_draft)] for t in r]
        for r in generate(target, prompts, drafter, k=4, max_tokens=NEW)
    ]


def by_row(seen: list[list[list[int]]], rows: int) -> list[list[int]]:
    out: list[list[int]] = [[] for _ in range(rows)]
    for r in seen:
        for row, token, _ in r:
            out[row].append(token)
    return out


class FullDrafter(OracleDrafter):
    """OracleDrafter drafting the whole depth in every row: ranks whose drafts differ still
    run verify forwards of one shape (the model's own collectives would hang on two)."""

    def propose(self, last: list[int], k: int, sampler: Sampler) -> Proposal:
        drafts = super().propose(last, k, sampler).tokens
        return Proposal(drafts, [k] * len(last), None)


def serve(m: Any, drafter: Any, params: list[RequestParams], **options: Any) -> dict[str, Any]:
    """PROMPTS (and PROMPTS[0] again, late: a prefix-cache hit) through an engine on `m`,
    arriving over the first steps, prefilled in chunks of 4 between the running rows'
    rounds: every step's outputs as [request id, tokens, finish] and each request's tokens."""
    engine = Engine(m, drafter, prefill_chunk=4, **options)
    arrivals = {0: [0, 1], 2: [2], 5: [0]}  # step -> prompts submitted before it
    requests, steps = [], []
    while len(steps) < 200 and (engine.has_work() or len(steps) <= max(arrivals)):
        for i in arrivals.get(len(steps), []):
            requests.append(engine.submit(PROMPTS[i], params[len(requests) % len(params)]))
        steps.append([[o.request.id, list(o.tokens), o.finish_reason] for o in engine.step()])
    return {
        "steps": steps,
        "tokens": [r.tokens for r in requests],
        "prompts": [list(r.prompt) for r in requests],
        "cached": [r.cached_tokens for r in requests],
        **{k: engine.stats()[k] for k in ("rounds", "drafted", "accepted")},
    }


def check_engine(whole: Any, m: Any, w: Any, found: dict[str, Any]) -> None:
    """The serving engine on the split model, plain and speculative (drafts right half the
    time, ragged counts): each request's tokens against the whole model's generate_step."""
    oracle = Oracle(whole, w, NEW)
    lengths = [RequestParams(max_tokens=NEW), RequestParams(max_tokens=NEW - 5)]
    runs = {
        "plain": serve(m, None, lengths),
        "speculative": serve(m, OracleDrafter(oracle, 0.5, seed=1), lengths, k=4,
                             prefix_cache_bytes=2**24),
    }  # fmt: skip
    for run in runs.values():
        run["oracle"] = [
            oracle(tuple(p))[: lengths[i % 2].max_tokens] for i, p in enumerate(run["prompts"])
        ]
    found["engine"] = runs


def verify_round(m: Any) -> ks.ModelState:
    """A ragged prompt batch, two decode steps, a capturing verify and a ragged commit."""
    width = max(len(p) for p in PROMPTS)
    padded = [p + [0] * (width - len(p)) for p in PROMPTS]
    _, state = m(padded, m.init_state(len(PROMPTS)), lengths=[len(p) for p in PROMPTS])
    for t in ([[5], [6], [7]], [[8], [9], [10]]):
        _, state = m(t, state)
    _, verified, checkpoints = m([[1, 2, 3, 4]] * 3, state, capture=True)
    return ks.commit_prefix(verified, [1, 3, 2], checkpoints)


def raises(fn: Any) -> dict[str, str]:
    try:
        fn()
    except Exception as e:  # recorded for the parent, which asserts on type and message
        return {"type": type(e).__name__, "message": str(e)}
    return {"type": "", "message": "no error"}


def check_model(name: str, group: Any, out: str, found: dict[str, Any]) -> None:
    rank = group.rank()
    whole, split = build(name), build(name, group)
    m, w = wrap(split), wrap(whole)
    found["placement"] = str(m.placement)

    truth = [greedy(whole, p, NEW + 8) for p in PROMPTS]
    found["oracle"] = truth[0][:NEW]
    # Greedy through wrap, and teacher-forced logits against the whole model's own caches.
    state = m.init_state()
    logits, state = m([PROMPT], state)
    tokens = []
    for _ in range(NEW):
        tokens.append(int(mx.argmax(logits[0, -1])))
        logits, state = m([[tokens[-1]]], state)
    found["greedy"] = tokens
    found["greedy_oracle"] = greedy(whole, PROMPT, NEW)
    forced = PROMPT + found["greedy_oracle"]
    caches, got = make_prompt_cache(whole), m.init_state()
    worst = 0.0
    for at, size in ((0, 8), (8, 1), (9, 4), (13, 3)):
        ref = whole(mx.array([forced[at : at + size]]), cache=caches)
        lg, got = m([forced[at : at + size]], got)
        worst = max(worst, float(mx.abs(lg - ref).max()))
    found["forced_logits_max_diff"] = worst

    # Speculative decoding, a ragged batch: the rounds (rows, counts, tokens) of this rank.
    seen = rounds(m, PROMPTS, ScriptedDrafter(truth, 0.5, seed=1))
    found["speculative_rounds"] = seen
    found["speculative_tokens"] = by_row(seen, len(PROMPTS))
    found["truth"] = [t[:NEW] for t in truth]
    # Tree verification as a batch of paths: the same verdict as the whole model's.
    paths = [truth[0][1:4], [truth[0][1], 5, 6], [9, 9]]
    verdicts = []
    for model in (m, w):
        _, start = model([PROMPTS[0]], model.init_state())
        v = verify_paths(model, start, truth[0][0], paths)
        verdicts.append([v.path, v.accepted, v.tokens])
    found["paths"] = verdicts
    check_engine(whole, m, w, found)

    # States: every rank saves its own; any rank gathers them all into the whole model's.
    mine = verify_round(m)
    path = os.path.join(out, f"{name}.rank{rank}.safetensors")
    ks.save(path, mine)
    barrier(group)
    files = [os.path.join(out, f"{name}.rank{r}.safetensors") for r in range(group.size())]
    loaded = [ks.load(f) for f in files]
    gathered = distributed.gather(loaded)
    reference = verify_round(w)
    found["gather"] = raises(lambda: assert_states_allclose(gathered, reference, atol=1e-4))
    placements = [distributed.placement_of(s) for s in loaded]
    back = distributed.scatter(gathered, placements)
    found["scatter"] = raises(lambda: assert_states_equal(back[rank], mine))
    found["load_own"] = raises(lambda: ks.load(files[rank], group=group))
    found["batch_rows"] = ks.batch_size(mine)

    # Bad input: the other rank's file, a world size of 4, another rank's state in this model,
    # states of two ranks batched together.
    other = files[1 - rank]
    found["load_other_rank"] = raises(lambda: ks.load(other, group=group))
    four = os.path.join(out, f"{name}.four.rank{rank}.safetensors")
    placed = distributed.Placement("tensor", rank, 4)
    ks.save(four, ks.ModelState(mine.layers, str(placed)))
    found["load_world_4"] = raises(lambda: ks.load(four, group=group))
    theirs = loaded[1 - rank]
    found["feed_other_rank"] = raises(lambda: m([[1], [2], [3]], theirs))
    found["merge_ranks"] = raises(lambda: ks.merge([loaded[0], loaded[1]]))
    RANK_STATES[name] = loaded
    barrier(group)


def check_divergence(group: Any, found: dict[str, Any]) -> None:
    rank = group.rank()
    found["agree_same"] = distributed.agree([4, 2, 7], group)
    found["agree_different"] = raises(lambda: distributed.agree([1, 2, rank], group))
    found["agree_lengths"] = raises(lambda: distributed.agree([9] * (rank + 1), group))
    whole, m = build("llama"), wrap(build("llama", group))
    truth = [greedy(whole, p, NEW + 8) for p in PROMPTS]
    # Drafters seeded differently per rank: the ranks accept different counts.
    found["generate_different_drafts"] = raises(
        lambda: rounds(m, PROMPTS, ScriptedDrafter(truth, 0.5, seed=10 + rank))
    )
    # Different sampling seeds per rank: different sampled tokens.
    hot = Sampler(temperature=1.0)
    found["generate_different_seeds"] = raises(
        lambda: list(generate(m, PROMPTS, None, max_tokens=4, sampler=hot, seed=rank))
    )
    # The engine: drafts seeded differently per rank (greedy: the same tokens in the end, but
    # not in the same rounds), and sampled requests seeded by rank.
    oracle = Oracle(whole, wrap(whole), NEW)
    greedy_params = [RequestParams(max_tokens=NEW)]
    found["engine_different_drafts"] = raises(
        lambda: serve(m, FullDrafter(oracle, 0.5, seed=10 + rank), greedy_params)
    )
    sampled = [RequestParams(max_tokens=4, temperature=1.0, seed=rank)]
    found["engine_different_seeds"] = raises(lambda: serve(m, None, sampled))
    found["engine_same_seeds"] = raises(
        lambda: serve(m, None, [RequestParams(max_tokens=4, temperature=1.0, seed=5)])
    )
    # A model both sharded and (here, by hand) marked as pipelined: wrap refuses it.
    both = build("llama", group)
    both.model.pipeline_size = 2
    found["both_splits"] = raises(lambda: wrap(both))
    # Rank 0 of a tensor-sharded model and rank 1 of a pipelined one are not one model.
    if {"llama", "qwen3_next"} <= set(RANK_STATES):
        mixed = [RANK_STATES["llama"][0], RANK_STATES["qwen3_next"][1]]
        found["gather_mixed"] = raises(lambda: distributed.gather(mixed))


def main() -> None:
    out = sys.argv[1]
    group = mx.distributed.init(strict=True, backend=os.environ.get("KVSTATE_DIST_BACKEND", "any"))
    found: dict[str, Any] = {"rank": group.rank(), "size": group.size(), "models": {}}
    names = sys.argv[2:] or list(MODELS)
    for name in names:
        found["models"][name] = {}
        started = time.perf_counter()
        try:
            check_model(name, group, out, found["models"][name])
        except Exception:
            found["models"][name]["crash"] = traceback.format_exc()
        found["models"][name]["seconds"] = time.perf_counter() - started
    found["divergence"] = {}
    started = time.perf_counter()
    try:
        check_divergence(group, found["divergence"])
    except Exception:
        found["divergence"]["crash"] = traceback.format_exc()
    found["divergence"]["seconds"] = time.perf_counter() - started
    with open(os.path.join(out, f"rank{group.rank()}.json"), "w") as f:
        json.dump(found, f)


if __name__ == "__main__":
    main()
