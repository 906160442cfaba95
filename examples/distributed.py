"""kvstate on a model split over processes: tensor or pipeline parallel, launched by mlx.launch.

    mlx.launch --backend ring -n 2 python examples/distributed.py             # 2 processes here
    mlx.launch --backend ring -n 2 python examples/distributed.py --pipeline  # layers, not heads
    mlx.launch --hosts mac1,mac2 python examples/distributed.py               # 2 Macs over TCP
    mlx.launch --backend ring --hostfile hosts.json -- python examples/distributed.py --dir /shared
    mlx.launch --backend nccl -n 2 python examples/distributed.py             # 2 GPUs, one each
    python examples/distributed.py                                            # 1 process

Every rank runs this same program on the same random-init model (same seed, same weights):
a llama-style model sharded by heads (`model.shard(group)`), or with --pipeline a
qwen3_next-style hybrid split by layers (`model.model.pipeline(group)`). `wrap` reads the
split off the model, so each rank's state holds its own heads or layers and says which. The
speculative generator then runs on every rank and checks, each round, that every rank accepted
the same drafts. Each rank saves its own state; rank 0 loads every rank's file, gathers them
into the whole model's state and checks it against the model run whole in one process
(across hosts `--dir` must be a directory they share). README's "Several hosts" has the
hostfiles for ring, nccl and jaccl.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

import kvstate as ks
from kvstate import distributed
from kvstate.adapters import wrap
from kvstate.adapters.tiny_models import tiny_model
from kvstate.speculative import ModelDrafter, generate

PROMPT = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]


def assert_close(a: object, b: object) -> None:
    """Two states alike: the same structure and statics, every array within 1e-4 (what
    `kvstate.testing.assert_states_allclose` checks, without the test extra)."""
    (left, left_def), (right, right_def) = ks.tree_flatten(a), ks.tree_flatten(b)
    assert left_def == right_def, "the states differ in structure or statics"
    for x, y in zip(left, right, strict=True):
        assert mx.allclose(x, y, atol=1e-4).item(), "the states' arrays differ"


def build(pipeline: bool, group: mx.distributed.Group | None) -> nn.Module:
    model = tiny_model("qwen3_next") if pipeline else tiny_model("llama")
    if group is not None and group.size() > 1:
        model.model.pipeline(group) if pipeline else model.shard(group)
    return model


def draft_model(pipeline: bool) -> nn.Module:
    """A whole (unsplit) copy on every rank, its weights perturbed: it stands in for a small
    distilled draft model, replicated while the target is split."""
    model = build(pipeline, None)
    mx.random.seed(1)
    noisy = [
        (k, v + 0.05 * mx.random.normal(v.shape) * v.std())
        for k, v in tree_flatten(model.parameters())
    ]
    model.update(tree_unflatten(noisy))
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pipeline", action="store_true", help="split layers, not heads")
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--dir", default=None, help="a directory every rank can write to")
    args = parser.parse_args()

    group = mx.distributed.init()
    rank, size = group.rank(), group.size()
    m = wrap(build(args.pipeline, group))
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"{size} process(es); rank 0 holds {m.placement or 'the whole model'}")

    # Speculative decoding: a replicated draft model proposes, the split target verifies.
    drafter = ModelDrafter(wrap(draft_model(args.pipeline)))
    tokens, drafted = [], 0
    for round_tokens in generate(m, [PROMPT], drafter, k=4, max_tokens=args.tokens):
        tokens += [t.token for t in round_tokens]
        drafted += sum(t.from_draft for t in round_tokens)
    say(f"generated {tokens} ({drafted} of {len(tokens)} tokens from accepted drafts)")

    # Each rank saves its own state; the file records the rank, world size and split.
    _, state = m([PROMPT + tokens], m.init_state())
    directory = args.dir or tempfile.gettempdir()
    path = os.path.join(directory, f"kvstate-example.rank{rank}.safetensors")
    ks.save(path, state)
    distributed.agree([1], group, what="files written")  # a barrier: every file is there
    ks.load(path, group=group)  # this rank's own file: accepted (another rank's is refused)

    if rank == 0 and size > 1:
        files = [
            os.path.join(directory, f"kvstate-example.rank{r}.safetensors") for r in range(size)
        ]
        whole_state = distributed.gather([ks.load(f) for f in files])
        whole = wrap(build(args.pipeline, None))
        _, expected = whole([PROMPT + tokens], whole.init_state())
        assert_close(whole_state, expected)
        print(f"gathered the {size} rank states into the whole model's state:\n{whole_state}")
    distributed.agree([1], group, what="done")


if __name__ == "__main__":
    main()
