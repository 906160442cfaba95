"""The drafting policy replayed on SmolLM2's greedy output (issue 24), on a simulated clock
whose costs are given: where does `CostAwarePolicy` lose against the best fixed k, and what
would another rule do? SmolLM2-135M decodes each of policy.py's three prompts (code, prose,
chat) greedily once (on this machine: a minute on 2 CPU cores, the 40 held-out prompts ten;
kept in ~/.cache/kvstate/policy_replay.json); then the n-gram drafter
(`NGramDrafter`, prompt lookup) is replayed along that output: its drafts at every position
are what it proposes there, and a verify keeps the ones equal to the output (greedy: exact
for any policy), so the policy meets the drafter's real acceptance, labels and bursts.

The clock: a pipelined plain step (built before the last one's tokens are read) costs 1, a
plain step that waited for a proposal `1 + drain`, a verify of w drafts `verify + slope *
w`. Profiles: `h100` from the H100 on 2026-12-07 (one SmolLM2 row: plain steps built ahead
6.5 ms, after a proposal 9.9 ms, verifies of 1-8 drafts 11-13 ms: benchmarks/results/
h100-2026-12-07/policy-rounds-shadows-before-gate.txt); `flat`, the verify costs fitted to
the H100's fixed-k columns of benchmarks/policy.py earlier that day; `cpu`, the 2-core
CPU's shape (benchmarks/probes/policy_loop_simulation.py). Printed per profile and prompt:
tokens per unit of time over plain decoding for fixed k = 1..8 and the policy (driven as
`generate` drives it: plain steps built ahead where `plain_ahead` says so, the drafter peeked
past the read), and the policy over the best of them (k = 0, plain decoding, included).

`--held-out N`: the first N prompts of each kind of benchmarks/policy_prompts.json (never
used to tune the policy) instead, `--tokens` each; printed per profile and kind: the median
and least of the policy over the best fixed k.

`--before FILE`: also the rule in FILE (a copy of kvstate/speculative/_policy.py, e.g.
`git show REV:kvstate/speculative/_policy.py > /tmp/before.py`), side by side.

    .venv/bin/python benchmarks/probes/policy_replay.py [--profiles h100,flat,cpu] [--before FILE]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _on_path  # noqa: F401  (benchmarks/ on the path, for policy and _fixtures)
from policy import chat_prompt, loaded_smollm2, smollm_prompts

from kvstate.adapters import wrap
from kvstate.speculative import CostAwarePolicy, NGramDrafter, generate

# (verify of w drafts: intercept, slope; drain), in pipelined plain steps
PROFILES = {"h100": (1.8, 0.0, 0.5), "flat": (1.16, 0.0, 0.3), "cpu": (1.33, 0.2, 0.38)}
K = 8


class Replay:
    """The n-gram drafter along a fixed token stream: `history` is the stream's first `at`
    tokens, the last token is `stream[at]`."""

    def __init__(self, prompt: list[int], output: list[int]) -> None:
        self.stream = prompt + output
        self.at = len(prompt) - 1
        self.drafter = NGramDrafter()
        self.drafter.start([self.stream[: self.at]])

    def propose(self, k: int) -> tuple[list[int], Any, int]:
        """The drafts after the last token, their label, and how many a verify keeps."""
        drafts, label = self.drafter._lookup(0, self.stream[self.at], k)
        truth = self.stream[self.at + 1 :]
        kept = 0
        while kept < min(len(drafts), len(truth)) and drafts[kept] == truth[kept]:
            kept += 1
        return drafts, label, kept

    def emitted(self, n: int) -> list[int]:
        return self.stream[self.at + 1 : self.at + 1 + n]

    def advance(self, n: int) -> None:
        self.drafter._extend(0, self.stream[self.at : self.at + n])
        self.at += n


def fixed(prompt: list[int], output: list[int], n: int, k: int, cost: Callable[[int], float],
          drain: float) -> float:  # fmt: skip
    """Fixed k: every round asks for k drafts and verifies what came (a plain step that
    waited for the proposal where none did)."""
    replay, clock, emitted = Replay(prompt, output), 0.0, 0
    while emitted < n:
        budget = n - emitted - 1
        drafts, _, kept = replay.propose(min(k, budget)) if budget > 0 else ([], None, 0)
        clock += cost(len(drafts)) if drafts else 1 + drain
        step = min(n - emitted, min(kept, len(drafts)) + 1)
        replay.advance(step)
        emitted += step
    return n / clock


def with_policy(prompt: list[int], output: list[int], n: int, make: Any,
                cost: Callable[[int], float], drain: float) -> float:  # fmt: skip
    """The policy driven as `generate` drives it (a cheap drafter, plain steps built ahead
    where `plain_ahead` says so, `emitted` and `observe` in the generator's order)."""
    replay, now, emitted = Replay(prompt, output), [0.0], 0
    policy = make(clock=lambda: now[0])
    policy.begin(1)
    ahead = False
    while emitted < n:
        room = [n - emitted]
        asked = 0 if ahead or n - emitted < 2 else policy.depth(K, room, cheap=True)
        width = kept = 0
        if asked:
            drafts, label, kept = replay.propose(min(asked, n - emitted - 1))
            stated = {"drafts": [drafts]} if hasattr(policy, "emitted") else {}
            width = policy.cut([len(drafts)], room, [label], **stated)[0]
        elif not ahead:
            policy.plain(1)
        now[0] += cost(width) if width else 1.0 if ahead else 1.0 + drain
        step = min(n - emitted, min(kept, width) + 1)
        tokens = [replay.emitted(step)]
        told = getattr(policy, "emitted", lambda _: None)
        ahead = False
        if width:
            told(tokens)
            policy.observe([min(kept, width)])
        else:
            policy.observe([0])
            if n - emitted - step > 2:
                ahead = policy.plain_ahead(K, [n - emitted - step - 1])
            told(tokens)
        replay.advance(step)
        emitted += step
        if ahead and hasattr(policy, "peek"):  # the generator peeks past the read
            drafts, label, _ = replay.propose(K)
            policy.peek([len(drafts)], [label], [drafts])
    return n / now[0]


def greedy_outputs(target: Any, prompts: dict[str, list[int]], n: int) -> dict[str, list[int]]:
    """Each prompt's greedy output of `n` tokens, kept under the user's cache directory
    (keyed by the prompt's tokens and n: minutes on 2 CPU cores)."""
    path = Path.home() / ".cache" / "kvstate" / "policy_replay.json"
    cache = json.loads(path.read_text()) if path.exists() else {}
    out = {}
    for name, prompt in prompts.items():
        key = f"{n}:{','.join(map(str, prompt))}"
        if key not in cache:
            cache[key] = [
                t.token for r in generate(target, [prompt], None, max_tokens=n) for t in r
            ]
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(cache))
        out[name] = cache[key]
    return out


def rule_from(path: str) -> Any:
    """`CostAwarePolicy` as defined in the file at `path` (relative imports as kvstate's)."""
    spec = importlib.util.spec_from_file_location("kvstate.speculative._policy_before", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.CostAwarePolicy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--profiles", default="h100,flat,cpu")
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--before", default=None, help="an earlier _policy.py to compare")
    parser.add_argument("--held-out", type=int, default=0, help="prompts of each kind")
    args = parser.parse_args()
    model, tokenizer = loaded_smollm2()
    target = wrap(model)
    if args.held_out:
        held = json.loads((Path(__file__).parents[1] / "policy_prompts.json").read_text())
        prompts = {
            f"{kind} {i}": chat_prompt(tokenizer, text)
            if kind == "chat"
            else tokenizer.encode(text)
            for kind in ("code", "prose", "chat", "data")
            for i, text in enumerate(held[kind][: args.held_out])
        }
    else:
        prompts = {label.split()[0]: p for label, p in smollm_prompts(tokenizer).items()}
    n = args.tokens
    outputs = greedy_outputs(target, prompts, n + K)
    rules = {"policy": CostAwarePolicy}
    if args.before:
        rules = {"before": rule_from(args.before), **rules}
    if args.held_out:
        print("| profile | kind | " + " | ".join(f"{r} / best (median, least)" for r in rules)
              + " |\n|---|---|" + "---|" * len(rules))  # fmt: skip
    else:
        ks = " | ".join(f"k={k}" for k in range(1, K + 1))
        names = " | ".join(f"{r} / plain | {r} / best" for r in rules)
        print(f"| profile | prompt | {ks} | {names} |\n|---|---" + "|---" * (K + 2 * len(rules))
              + "|")  # fmt: skip
    for profile in args.profiles.split(","):
        a, b, drain = PROFILES[profile]

        def cost(w: int, a: float = a, b: float = b) -> float:
            return a + b * w

        by_kind: dict[str, dict[str, list[float]]] = {}
        for name, prompt in prompts.items():
            out = outputs[name]
            runs = [fixed(prompt, out, n, k, cost, drain) for k in range(1, K + 1)]
            best = max([1.0, *runs])
            cells = []
            for rule, make in rules.items():
                got = with_policy(prompt, out, n, make, cost, drain)
                cells.append(f"{got:.2f} | **{got / best:.2f}**")
                by_kind.setdefault(name.split()[0], {}).setdefault(rule, []).append(got / best)
            if not args.held_out:
                print(f"| {profile} | {name} | " + " | ".join(f"{x:.2f}" for x in runs) + " | "
                      + " | ".join(cells) + " |", flush=True)  # fmt: skip
        if args.held_out:
            for kind, ratios in by_kind.items():
                cells = [f"{statistics.median(v):.2f}, {min(v):.2f}" for v in ratios.values()]
                print(f"| {profile} | {kind} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
