"""What the checks of a drafter's proposal cost a speculative round, in one process: the same
generations with kvstate's drafters as they are (their proposals are `Drafted`: no device id
guard, no distribution marks, and the generator's own `last` / `kept` not re-checked) and with
every proposal handed over as a user's plain `Proposal` (checked in full, as issue 20's
checks layer did for every drafter), alternating A B B A ... so that a busy machine slows
both alike. A whole-process comparison against an earlier commit
(`speculative_round.py --against`) cannot see tens of microseconds in a round of several
milliseconds on a shared CPU; this can.

Per round of `generate` (a whole generation timed, divided by its rounds), the configurations
of speculative_round.py: a tiny llama target (2 layers, vocabulary 256), a tiny llama draft
(`ModelDrafter`, greedy and sampled) and prompt lookup (`NGramDrafter`); 4 rows, k = 4, 48
tokens a row; CPU time by default.

    .venv/bin/python benchmarks/probes/round_checks.py [--pairs 12] [--clock wall]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
from typing import Any

import _on_path  # noqa: F401  (benchmarks/ on the path)
from _harness import Contender, interleave

from kvstate.adapters import wrap
from kvstate.adapters.tiny_models import tiny_model
from kvstate.speculative import ModelDrafter, NGramDrafter, Proposal, Sampler, generate


class AsUsers:
    """A drafter whose proposals and inputs go through the checks a user's drafter gets: each
    proposal re-made as a plain `Proposal`, `last` and `kept` as plain lists."""

    def __init__(self, drafter: Any) -> None:
        self.inner = drafter
        self.uses_hidden = getattr(drafter, "uses_hidden", False)
        self.prefills = getattr(drafter, "prefills", False)

    def start(self, prompts: Any, **kw: Any) -> None:
        self.inner.start(prompts, **kw)

    def propose(self, last: list[int], k: int, sampler: Sampler) -> Proposal:
        made = self.inner.propose(list(last), k, sampler)
        return Proposal(made.tokens, list(made.counts), made.probs)

    def accept(self, fed: Any, kept: list[int], **kw: Any) -> None:
        self.inner.accept(fed, list(kept), **kw)

    def keep_rows(self, rows: list[int]) -> None:
        self.inner.keep_rows(rows)


# The clock: the process's CPU time (every MLX thread, interleave's `cpu_times`): what a round
# costs in work, much less moved than wall time by other processes on a shared CPU (--clock wall)
CPU = True


def rounds_of(target: Any, make: Any, sampler: Sampler, seed: int) -> int:
    """The rounds of one generation (timed by the caller: per round, its time / this)."""
    prompts = [[3, 17, 42, 99, 7, 5, 3, 17, 42], [100, 101, 102, 5, 6, 7, 8, 9, 10]] * 2
    rounds = 0
    for _ in generate(target, prompts, make(), k=4, max_tokens=48, sampler=sampler, seed=seed):
        rounds += 1
    return rounds


def timed_rounds(label: str, target: Any, make: Any, sampler: Sampler) -> Contender:
    """One path as a contender: a generation a repetition (seed 0 for the warm-up, i for
    pair i), its time per round."""
    seeds = itertools.chain([0], itertools.count())
    return Contender(
        label,
        lambda seed: rounds_of(target, make, sampler, seed),
        lambda: next(seeds),
        units=lambda rounds: rounds,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=12, help="A/B pairs per configuration")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    args = parser.parse_args()
    global CPU
    CPU = args.clock == "cpu"
    print(f"clock: {args.clock}\n")
    target = wrap(tiny_model("llama", num_hidden_layers=2, seed=3))
    draft = wrap(tiny_model("llama", num_hidden_layers=2, seed=3, scale=3.9))
    configs: dict[str, tuple[Any, Sampler]] = {
        "ModelDrafter, greedy": (lambda: ModelDrafter(draft), Sampler()),
        "ModelDrafter, sampled": (lambda: ModelDrafter(draft), Sampler(temperature=1.0)),
        "NGramDrafter, greedy": (lambda: NGramDrafter(), Sampler()),
    }
    print("| configuration | checked in full us/round | made (skipped) us/round | saved us/round "
          "[IQR of pairs] | made / full |")  # fmt: skip
    print("|---|---|---|---|---|")
    for name, (make, sampler) in configs.items():

        def full(make: Any = make) -> Any:
            return AsUsers(make())

        # A warm-up of both paths, then A/B pairs: made first in pair 0, full first in pair 1...
        pairs = [
            timed_rounds("full", target, full, sampler),
            timed_rounds("made", target, make, sampler),
        ]
        times = interleave(pairs, args.pairs, warmup=1, keep_gc=True).of(CPU)
        made_times, full_times = times["made"], times["full"]
        saved = sorted(f - m for f, m in zip(full_times, made_times, strict=True))
        q = statistics.quantiles(saved, n=4)
        f, m = statistics.median(full_times), statistics.median(made_times)
        print(f"| {name} | {f * 1e6:.0f} | {m * 1e6:.0f} | {statistics.median(saved) * 1e6:.0f} "
              f"[{q[0] * 1e6:.0f}, {q[2] * 1e6:.0f}] | {m / f:.3f} |")  # fmt: skip
    print("\n| the proposal check alone, evaluated | us |\n|---|---|")
    checks_alone()


def checks_alone(reps: int = 2000) -> None:
    """The check of one proposal (4 rows, 4 drafts, vocabulary 256) and the evaluation of
    what it adds to the round (the fed ids and the marks), user-made against kvstate-made."""
    import mlx.core as mx

    from kvstate.speculative._checks import checked_proposal
    from kvstate.speculative._drafter import Drafted

    tokens = mx.array([[1, 2, 3, 4]] * 4, mx.int32)
    mx.eval(tokens)
    proposals = {
        "a user's Proposal (device guard)": Proposal(tokens, [4] * 4, None),
        "a kvstate drafter's (Drafted)": Drafted(tokens, [4] * 4, None, 256),
    }

    def once(proposal: Any) -> None:
        drafts = checked_proposal(proposal, 4, 4, 4, 256)
        mx.eval([a for a in (drafts.fed, drafts.marks) if a is not None])

    contenders = [
        Contender(label, once, lambda p=p: p, inner=reps) for label, p in proposals.items()
    ]
    samples = interleave(contenders, 1, warmup=1, keep_gc=True)
    for label in proposals:
        print(f"| {label} | {samples.median(label, CPU) * 1e6:.1f} |")


if __name__ == "__main__":
    main()
