"""Tree verification two ways, and linear verification of one path: time and bytes per round.

- tree: `verify_tree`, one forward of 1 + N tokens over ONE copy of the prefix (N = tree nodes);
- paths: `verify_paths`, the state tiled to P rows, one forward of P x (1 + depth) tokens;
- linear: one capturing forward of 1 + depth tokens and `commit_prefix` (one candidate only).

Every contender verifies the same candidates (the tree is their trie) from the same prefilled
state, and each round ends with its committed state evaluated. The first candidate is the
target's own greedy continuation, so every round accepts a full path and commits it.
Rows are printed as measured; "x tree" is the paired median of time(contender) / time(tree)
(inter-quartile range in brackets). Bytes: the peak of MLX's active memory above what was
allocated before the round (the prefix state itself excluded).

    .venv/bin/python benchmarks/tree_verify.py [--reps 15] [--context 512] [--hidden 256]
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from _harness import (
    Contender,
    active_delta,
    environment,
    fmt_bytes,
    fmt_ratio,
    fmt_time,
    interleave,
)

import kvstate as ks
from kvstate.adapters import wrap
from kvstate.adapters.tiny_models import VOCAB, tiny_model
from kvstate.speculative import tree_of_paths, verify_paths, verify_tree


def say(text: str) -> None:
    print(text, flush=True)


def shapes(truth: list[int]) -> dict[str, list[list[int]]]:
    """Candidate sets, each led by the true continuation (wrong tokens: truth + 1, + 2, ...)."""

    def alt(d: int, i: int) -> int:
        return (truth[d] + i) % VOCAB

    def branching(width: int, depth: int) -> list[list[int]]:
        picks = itertools.product(range(width), repeat=depth)
        return [[alt(d + 1, i) for d, i in enumerate(p)] for p in picks]

    disjoint = [[alt(d + 1, i) for d in range(4)] for i in range(4)]
    return {
        "chain of 4": [truth[1:5]],
        "2x3 (8 paths, depth 3)": branching(2, 3),
        "3x2 (9 paths, depth 2)": branching(3, 2),
        "4 paths of depth 4, disjoint": disjoint,
        "4 paths of depth 4, 1 shared root": [[truth[1], *p[1:]] for p in disjoint],
    }


def linear(m: Any, state: Any, last: int, path: list[int]) -> Any:
    """A linear verify of one candidate: capture, greedy acceptance, commit_prefix."""
    logits, verified, checkpoints = m(mx.array([[last, *path]]), state, capture=True)
    best = logits[0].argmax(-1).tolist()
    count = 0
    while count < len(path) and best[count] == path[count]:
        count += 1
    return ks.commit_prefix(verified, count + 1, checkpoints)


def evaluated(run: Callable[[], Any]) -> Callable[[Any], Any]:
    def go(_: Any) -> Any:
        out = run()
        ks.eval(out if isinstance(out, ks.ModelState) else out.state)
        return out

    return go


def bench(name: str, reps: int, context: int, hidden: int) -> None:
    overrides: dict[str, Any] = {"hidden_size": hidden, "intermediate_size": 2 * hidden}
    model = tiny_model(name, **overrides)
    m = wrap(model)
    prompt = [(7 * i + 3) % VOCAB for i in range(context)]
    logits, state = m(mx.array([prompt]), m.init_state())
    ks.eval(state)
    # The target's own greedy continuation: truth[0] is the next input (`last`).
    truth = [int(logits[0, -1].argmax())]
    current = state
    for _ in range(5):
        logits, current = m(mx.array([truth[-1:]]), current)
        truth.append(int(logits[0, -1].argmax()))
    del current
    say(f"\n### {name} (hidden {hidden}, context {context}, state {fmt_bytes(ks.nbytes(state))})")
    say("\n| tree | nodes | paths | contender | time | x tree | peak bytes | accepted |")
    say("|---|---|---|---|---|---|---|---|")
    first = truth[0]
    for label, paths in shapes(truth).items():
        tokens, parents = tree_of_paths(paths)
        runs = {
            "tree": lambda t=tokens, p=parents: verify_tree(m, state, first, t, p),
            "paths": lambda ps=paths: verify_paths(m, state, first, ps),
            "linear (1st path only)": lambda ps=paths: linear(m, state, first, ps[0]),
        }
        accepted = {
            "tree": verify_tree(m, state, first, tokens, parents).accepted,
            "paths": verify_paths(m, state, first, paths).accepted,
        }
        contenders = [Contender(n, evaluated(r)) for n, r in runs.items()]
        samples = interleave(contenders, reps)
        for n, r in runs.items():
            _, peak, _ = active_delta(lambda r=r: evaluated(r)(None))
            ratio = "1" if n == "tree" else fmt_ratio(samples.paired_ratio(n, "tree"))
            say(
                f"| {label} | {len(tokens)} | {len(paths)} | {n} | {fmt_time(samples.median(n))} "
                f"| {ratio} | {fmt_bytes(peak)} | {accepted.get(n, '')} |"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--models", default="llama,qwen3_next")
    args = parser.parse_args()
    say(f"# tree verification vs a batch of paths vs linear\n\n{environment(False)}")
    for name in args.models.split(","):
        bench(name, args.reps, args.context, args.hidden)


if __name__ == "__main__":
    main()
