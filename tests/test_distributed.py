"""kvstate on models split with mx.distributed.

Two processes on this machine (`mlx.launch --backend ring -n 2`, loopback; with
KVSTATE_DIST_BACKEND=nccl, `--backend nccl`: one GPU each) run
tests/distributed_ranks.py once: a random-init llama and a qwen3_5-style hybrid sharded over
the two ranks, a qwen3_next-style model pipelined over them, each against the same model run
whole (mlx-lm's generate_step and caches: the oracle). The ranks report what they saw as
JSON (the serving engine's steps too); the tests below assert on it. The pure parts (placements, gather / scatter, files,
agreement in one process) are tested here directly.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

import kvstate as ks
from kvstate import distributed
from kvstate.adapters import wrap
from kvstate.adapters.tiny_models import tiny_model
from kvstate.distributed import Placement
from kvstate.speculative import NGramDrafter
from kvstate.testing import assert_states_allclose, assert_states_equal

WORKER = Path(__file__).with_name("distributed_ranks.py")
NAMES = ["llama", "qwen3_5", "qwen3_next"]
LAUNCH_TIMEOUT = 240
# The backend the two ranks talk over: ring (TCP on loopback, the default: any machine) or,
# on a machine with two GPUs, nccl (`mlx.launch` gives each rank its own GPU).
BACKEND = os.environ.get("KVSTATE_DIST_BACKEND", "ring")


# ---------------------------------------------------------------------------- two ranks


def _launcher() -> str | None:
    beside = Path(sys.executable).with_name("mlx.launch")
    return str(beside) if beside.exists() else shutil.which("mlx.launch")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Both ranks' reports (rank 0 first), from one launch of the worker."""
    launcher = _launcher()
    if launcher is None:
        pytest.skip("mlx.launch is not installed next to this python or on PATH")
    out = tmp_path_factory.mktemp("ranks")
    # A free port: test runs in parallel must not meet on the default one.
    port = ["--starting-port" if BACKEND == "ring" else "--nccl-port", str(_free_port())]
    command = [launcher, "--backend", BACKEND, "-n", "2", *port]
    command += ["--env", f"KVSTATE_DIST_BACKEND={BACKEND}", sys.executable, str(WORKER), str(out)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the two ranks did not finish in {LAUNCH_TIMEOUT} s: {e.stderr!r:.2000}")
    reports = [out / f"rank{r}.json" for r in range(2)]
    if not any(p.exists() for p in reports):
        started = "Traceback" in done.stderr or "Traceback" in done.stdout
        if not started:  # the launcher or the ring backend could not start the processes
            pytest.skip(
                f"mlx.launch --backend {BACKEND} -n 2 could not run here: {done.stderr:.500}"
            )
    assert all(p.exists() for p in reports), (
        f"a rank wrote no report (exit {done.returncode}):\n{done.stdout[-3000:]}\n"
        f"{done.stderr[-3000:]}"
    )
    found = [json.loads(p.read_text()) for p in reports]
    assert [f["rank"] for f in found] == [0, 1] and {f["size"] for f in found} == {2}
    return found


def _model(ranks: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    seen = [r["models"][name] for r in ranks]
    for rank, s in enumerate(seen):
        assert "crash" not in s, f"rank {rank} crashed on {name}:\n{s['crash']}"
    return seen


@pytest.mark.parametrize("name", NAMES)
def test_greedy_decoding_gives_the_single_process_tokens(ranks, name):
    """Greedy decoding through wrap on every rank equals mlx-lm's generate_step on the whole
    model, and teacher-forced logits agree (the tokens vary: the oracle is not degenerate)."""
    for s in _model(ranks, name):
        assert s["greedy"] == s["greedy_oracle"]
        assert len(set(s["greedy_oracle"])) > 4
        assert s["forced_logits_max_diff"] < 1e-3


@pytest.mark.parametrize("name", NAMES)
def test_the_state_says_which_part_of_the_model_it_holds(ranks, name):
    seen = _model(ranks, name)
    if name == "qwen3_next":  # mlx-lm gives rank 0 the last layers
        expected = [
            "pipeline rank 0 of 2, layers 2:4 of 4",
            "pipeline rank 1 of 2, layers 0:2 of 4",
        ]
    else:
        expected = ["tensor rank 0 of 2", "tensor rank 1 of 2"]
    assert [s["placement"] for s in seen] == expected


@pytest.mark.parametrize("name", NAMES)
def test_speculative_decoding_of_a_ragged_batch_matches_and_commits_alike(ranks, name):
    """Three prompts of different lengths, drafts right half the time: every row's tokens are
    the whole model's greedy ones, and both ranks went through identical rounds (same rows,
    same accepted drafts, same tokens)."""
    r0, r1 = _model(ranks, name)
    for s in (r0, r1):
        assert s["speculative_tokens"] == s["truth"]
    assert r0["speculative_rounds"] == r1["speculative_rounds"]
    for s in (r0, r1):  # verify_paths picks the whole model's path (the first, 3 accepted)
        assert s["paths"][0] == s["paths"][1] == [0, 3, s["truth"][0][1:5]]
    drafted = [t for r in r0["speculative_rounds"] for t in r if t[2]]
    plain = [t for r in r0["speculative_rounds"] for t in r if not t[2]]
    assert drafted and plain  # some drafts accepted, some rejected


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("run", ["plain", "speculative"])
def test_the_engine_serves_a_split_model_with_the_single_process_tokens(ranks, name, run):
    """kvstate.engine on the split model, every rank submitting the same four requests over
    the first steps (chunked prefills between rounds, a late repeat of a prompt; speculative:
    ragged drafts right half the time and a prefix cache): each request's tokens are the
    whole model's greedy ones (mlx-lm's generate_step), and both ranks went through
    identical steps (the same outputs in every step)."""
    r0, r1 = (s["engine"][run] for s in _model(ranks, name))
    for s in (r0, r1):
        assert s["tokens"] == s["oracle"]
        assert len(s["tokens"]) == 4 and all(len(set(t)) > 4 for t in s["oracle"][:1])
    assert r0["steps"] == r1["steps"]
    assert [r0[k] for k in ("rounds", "drafted", "accepted")] == [
        r1[k] for k in ("rounds", "drafted", "accepted")
    ]
    assert len(r0["steps"]) > 10  # requests joined and left between the rounds
    if run == "speculative":
        assert r0["cached"][3] > 0  # the repeat started from the prefix cache
        assert 0 < r0["accepted"] < r0["drafted"]  # some drafts accepted, some rejected


@pytest.mark.parametrize("name", NAMES)
def test_gathered_rank_states_equal_the_single_process_state(ranks, name):
    """After a ragged prefill, decode steps, a capturing verify and a ragged commit, the ranks'
    saved states gather into the whole model's state (allclose); scattering it back gives
    each rank's own state bit for bit; each rank loads its own file with group=."""
    for s in _model(ranks, name):
        assert s["gather"]["type"] == "", s["gather"]["message"]
        assert s["scatter"]["type"] == "", s["scatter"]["message"]
        assert s["load_own"]["type"] == "", s["load_own"]["message"]
        assert s["batch_rows"] == 3


@pytest.mark.parametrize("name", NAMES)
def test_another_ranks_state_is_refused(ranks, name):
    for rank, s in enumerate(_model(ranks, name)):
        other = s["load_other_rank"]
        assert other["type"] == "PlacementError"
        assert f"rank {1 - rank} of a world of 2" in other["message"]
        assert f"this is rank {rank} of a world of 2" in other["message"]
        four = s["load_world_4"]
        assert four["type"] == "PlacementError" and "world of 4" in four["message"]
        fed = s["feed_other_rank"]
        assert fed["type"] == "ConfigMismatchError" and f"rank {1 - rank} of 2" in fed["message"]
        merged = s["merge_ranks"]
        assert merged["type"] == "ConfigMismatchError" and "placement" in merged["message"]


def test_ranks_that_decide_differently_raise_instead_of_diverging(ranks):
    for rank, r in enumerate(ranks):
        d = r["divergence"]
        assert "crash" not in d, d.get("crash")
        assert d["agree_same"] == [4, 2, 7]
        for key in ("agree_different", "agree_lengths"):
            assert d[key]["type"] == "DivergenceError"
            assert f"this is rank {rank}" in d[key]["message"]
        assert "rank 0: [1, 2, 0]; rank 1: [1, 2, 1]" in d["agree_different"]["message"]
        assert "rank 0: [9]; rank 1: [9, 9]" in d["agree_lengths"]["message"]
        drafts = d["generate_different_drafts"]
        assert drafts["type"] == "DivergenceError" and "accepted counts" in drafts["message"]
        seeds = d["generate_different_seeds"]
        assert seeds["type"] == "DivergenceError" and "first tokens" in seeds["message"]
        for key in ("engine_different_drafts", "engine_different_seeds"):
            assert d[key]["type"] == "DivergenceError", d[key]
            assert "the engine step's decisions differ" in d[key]["message"]
            assert f"this is rank {rank}" in d[key]["message"]
        assert d["engine_same_seeds"]["type"] == "", d["engine_same_seeds"]["message"]
        both = d["both_splits"]
        assert (
            both["type"] == "NotSupportedError"
            and "both tensor-sharded and pipelined" in both["message"]
        )
        mixed = d["gather_mixed"]
        assert mixed["type"] == "PlacementError" and "different shardings" in mixed["message"]


# ---------------------------------------------------------------------------- one process


class _Group:
    """Stands in for an mx.distributed.Group where only rank() and size() are read."""

    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def _whole_state(name: str, overrides: dict[str, Any]) -> ks.ModelState:
    m = wrap(tiny_model(name, **overrides))
    prompts = [[3, 17, 42, 99, 7], [100, 101, 102, 0, 0]]
    _, state = m(prompts, m.init_state(2), lengths=[5, 3])
    _, state = m([[5], [6]], state)
    return state


def test_placements_read_back_and_bad_ones_are_refused():
    for p in (
        Placement("tensor", 1, 2),
        Placement("pipeline", 0, 4, (6, 8), 8),
        Placement("pipeline", 3, 4, (0, 2)),
    ):
        assert Placement.parse(str(p)) == p
    assert Placement.parse("") is None
    for bad in (
        "tensor rank 2 of 2",
        "pipeline rank 0 of 2",
        "tensor 0/2",
        "pipeline rank 0 of 2, layers 3:1 of 4",
    ):
        with pytest.raises(ks.PlacementError):
            Placement.parse(bad)
    with pytest.raises(ks.ShapeError, match="placement"):
        ks.check(ks.ModelState((), "pipeline rank 0 of 2, layers 0:2 of 4"))  # 0 layers, not 2


def test_conv_window_of_a_gated_delta_net_joins_per_q_k_v_segment():
    """Against a NumPy reference: rank r's conv channels are [q_r, k_r, v_r]; the whole
    layer's are [q_0, q_1, k_0, k_1, v_0, v_1]; the (B, H, Dv, Dk) state joins on heads."""
    kd, vd, heads = 3, 4, 2  # per rank: key_dim 3, value_dim 4 = 2 heads of Dv 2
    rng = np.random.default_rng(0)
    convs = [rng.standard_normal((1, 3, 2 * kd + vd)).astype(np.float32) for _ in range(2)]
    ssms = [rng.standard_normal((1, heads, 2, 5)).astype(np.float32) for _ in range(2)]
    ranks_states = [
        ks.ModelState(
            (ks.RecurrentState((mx.array(c), mx.array(s))),), str(Placement("tensor", r, 2))
        )
        for r, (c, s) in enumerate(zip(convs, ssms, strict=True))
    ]
    whole = distributed.gather(list(reversed(ranks_states)))  # any order
    q = [c[..., :kd] for c in convs]
    k = [c[..., kd : 2 * kd] for c in convs]
    v = [c[..., 2 * kd :] for c in convs]
    expected_conv = np.concatenate([*q, *k, *v], axis=-1)
    conv, ssm = whole.layers[0].arrays
    np.testing.assert_array_equal(np.array(conv), expected_conv)
    np.testing.assert_array_equal(np.array(ssm), np.concatenate(ssms, axis=1))
    assert whole.placement == ""
    back = distributed.scatter(whole, [Placement("tensor", r, 2) for r in range(2)])
    for got, want in zip(back, ranks_states, strict=True):
        assert_states_equal(got, want)


@pytest.mark.parametrize(
    ("name", "overrides"),
    [("llama", {}), ("qwen3_next", {"model_type": "qwen3_5", "num_experts": 0})],
)
def test_scatter_then_gather_gives_the_state_back(name, overrides):
    state = _whole_state(name, overrides)
    for size in (1, 2):
        tensor = [Placement("tensor", r, size) for r in range(size)]
        parts = distributed.scatter(state, tensor)
        assert [p.placement for p in parts] == [str(p) for p in tensor]
        assert_states_equal(distributed.gather(parts), state)
    pipeline = [Placement("pipeline", 0, 2, (1, 4), 4), Placement("pipeline", 1, 2, (0, 1), 4)]
    parts = distributed.scatter(state, pipeline)
    assert [len(p.layers) for p in parts] == [3, 1]
    assert_states_equal(distributed.gather(parts), state)


def test_gather_refuses_states_that_are_not_one_run():
    state = _whole_state("llama", {})
    two = distributed.scatter(state, [Placement("tensor", r, 2) for r in range(2)])
    with pytest.raises(ks.PlacementError, match="one state per rank"):
        distributed.gather([two[0], two[0]])
    with pytest.raises(ks.PlacementError, match="one state per rank"):
        distributed.gather([two[1]])
    pipe = distributed.scatter(
        state, [Placement("pipeline", 0, 2, (2, 4), 4), Placement("pipeline", 1, 2, (0, 2), 4)]
    )
    with pytest.raises(ks.PlacementError, match="different shardings"):
        distributed.gather([two[0], pipe[1]])
    with pytest.raises(ks.PlacementError, match="single-process"):
        distributed.gather([state])
    shorter = ks.row_select(two[1], [0])
    with pytest.raises(ks.PlacementError, match="batches"):
        distributed.gather([two[0], shorter])
    with pytest.raises(ks.ConfigMismatchError, match="placement"):
        ks.merge([two[0], two[1]])
    with pytest.raises(ks.PlacementError, match="gap or overlap"):
        distributed.scatter(
            state, [Placement("pipeline", 0, 2, (1, 4), 4), Placement("pipeline", 1, 2, (0, 2), 4)]
        )


def test_rank_files_record_their_placement_and_refuse_the_wrong_rank(tmp_path):
    state = _whole_state("llama", {})
    parts = distributed.scatter(state, [Placement("tensor", r, 2) for r in range(2)])
    for r, part in enumerate(parts):
        path = tmp_path / f"rank{r}.safetensors"
        ks.save(path, part)
        assert mx.load(str(path), return_metadata=True)[1]["kvstate.placement"] == part.placement
        assert_states_equal(ks.load(path, group=_Group(r, 2)), part)
        with pytest.raises(ks.PlacementError, match=f"this is rank {1 - r} of a world of 2"):
            ks.load(path, group=_Group(1 - r, 2))
        with pytest.raises(ks.PlacementError, match="world of 3"):
            ks.load(path, group=_Group(r, 3))
    whole = tmp_path / "whole.safetensors"
    ks.save(whole, state)
    assert "kvstate.placement" not in mx.load(str(whole), return_metadata=True)[1]
    with pytest.raises(ks.PlacementError, match="single-process state"):
        ks.load(whole, group=_Group(0, 2))
    assert_states_equal(ks.load(whole, group=_Group(0, 1)), state)


def test_a_whole_model_decides_without_collectives(monkeypatch):
    """One process: wrap records no placement, agree() is the identity, and neither the
    generator nor the engine calls it (the single-process path pays nothing for the
    distributed checks)."""
    from kvstate.engine import Engine, RequestParams, _engine
    from kvstate.speculative import _generate, _plain

    assert distributed.agree([3, 1], None) == [3, 1]
    m = wrap(tiny_model("llama"))
    assert m.placement is None and m.group is None
    assert m.init_state().placement == ""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("agree was called in a single process")

    monkeypatch.setattr(_generate, "agree", refuse)
    monkeypatch.setattr(_plain, "agree", refuse)
    monkeypatch.setattr(_engine, "agree", refuse)
    rounds = list(_generate.generate(m, [[1, 2, 3]], None, max_tokens=3))
    assert sum(len(r) for r in rounds) == 3
    rounds = list(_generate.generate(m, [[1, 2, 3]], NGramDrafter(), max_tokens=3))
    assert sum(len(r) for r in rounds) == 3
    engine = Engine(m, "ngram")
    request = engine.submit([1, 2, 3], RequestParams(max_tokens=3))
    while engine.has_work():
        engine.step()
    assert len(request.tokens) == 3


def test_state_files_from_before_placements_still_load(tmp_path):
    """A ModelState recorded without the placement static (older files) loads as a
    single-process state."""
    state = _whole_state("llama", {})
    path = tmp_path / "old.safetensors"
    ks.save(path, state)
    arrays, meta = mx.load(str(path), return_metadata=True)
    body = json.loads(meta["kvstate.body"])
    del body["tree"]["statics"]["placement"]
    meta["kvstate.body"] = json.dumps(body, sort_keys=True)
    meta["kvstate.sha256"] = hashlib.sha256(meta["kvstate.body"].encode()).hexdigest()
    mx.save_safetensors(str(path), arrays, meta)
    assert_states_allclose(ks.load(path), state, rtol=0, atol=0)
