"""kvstate's speculative generator against mlx-lm's `speculative_generate_step` and plain
greedy decoding, on the same models and drafts; rows printed as measured.

The draft model is the target with its weights perturbed (random-init models have no
genuinely smaller model that predicts them), so acceptance is partial and a draft forward
costs what a target forward costs: what matters is kvstate / mlx-lm on identical work.
Every run's tokens are checked equal to plain greedy decoding (both generators).

Each model is wrapped once, outside the timed runs (a wrapped model is a view a user makes
once, as mlx-lm's model objects are made once); each run makes its own states, drafter and
caches. Contenders are timed interleaved (one run of each per repetition, rotating order)
and the kvstate / mlx-lm figure is the median of the per-repetition speed ratios, with its
inter-quartile range: the machine is shared and drifts. Seeds vary the prompt and the
draft's perturbation (so the acceptance pattern), sizes the model.

    .venv/bin/python benchmarks/speculative.py [--sizes tiny,small] [--seeds 0,1,2] [--reps 7]
    .venv/bin/python benchmarks/speculative.py --per-round   # host work per round, no timing
    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/speculative.py --sizes large   # on the H200
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from _fixtures import BIG_MODELS
from _harness import Contender, environment, interleave
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.generate import generate_step, speculative_generate_step

from kvstate.adapters import wrap
from kvstate.adapters.tiny_models import tiny_model
from kvstate.speculative import ModelDrafter, NGramDrafter, generate

SIZES: dict[str, dict[str, Any]] = {
    "tiny": {},  # hidden 64, 4 layers, vocab 256
    "small": {
        "vocab_size": 4096, "hidden_size": 256, "num_hidden_layers": 8,
        "intermediate_size": 768, "num_attention_heads": 8, "num_key_value_heads": 4,
        "head_dim": 32,
    },
    # ~1.1B, float32: for a GPU (with MLX_ENABLE_TF32=0 for exact greedy agreement)
    "large": BIG_MODELS["llama"],
}  # fmt: skip


def say(text: str) -> None:
    print(text, flush=True)


def perturbed(model: nn.Module, noise: float = 0.01, seed: int = 1) -> nn.Module:
    params = tree_flatten(model.parameters())
    keys = iter(mx.random.split(mx.random.key(seed), len(params)))
    model.update(
        tree_unflatten(
            [
                (
                    k,
                    v
                    + noise * mx.random.normal(v.shape, key=next(keys)).astype(v.dtype) * mx.abs(v),
                )
                for k, v in params
            ]
        )
    )
    mx.eval(model.parameters())
    return model


def contenders(
    model: nn.Module, draft: nn.Module, prompt: list[int], k: int, n: int
) -> tuple[list[Contender], dict[str, Callable[[], tuple[list[int], int]]]]:
    """The four generators of one (models, prompt, k), each returning (tokens, drafted)."""
    wrapped_model, wrapped_draft = wrap(model), wrap(draft)

    def plain() -> tuple[list[int], int]:
        return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n)], 0

    def mlx_lm() -> tuple[list[int], int]:
        steps = speculative_generate_step(
            mx.array(prompt), model, draft, num_draft_tokens=k, max_tokens=n
        )
        out = [(int(t), bool(d)) for t, _, d in steps]
        return [t for t, _ in out], sum(d for _, d in out)

    def ours(drafter: Any, adaptive: bool = False) -> tuple[list[int], int]:
        rounds = generate(wrapped_model, [prompt], drafter, k=k, max_tokens=n, adaptive=adaptive)
        out = [t for r in rounds for t in r]
        return [t.token for t in out], sum(t.from_draft for t in out)

    runs = {
        "plain": plain,
        "mlx-lm": mlx_lm,
        "kvstate": lambda: ours(ModelDrafter(wrapped_draft)),
        # The generator's default: k adapts to the acceptance (not the same drafts as mlx-lm's).
        "kvstate adaptive": lambda: ours(ModelDrafter(wrapped_draft), adaptive=True),
        "kvstate n-gram": lambda: ours(NGramDrafter()),
    }
    return [Contender(name, lambda _, f=f: f()) for name, f in runs.items()], runs


def per_round(runs: dict[str, Callable[[], tuple[list[int], int]]], label: str) -> None:
    """Host work per verify round of mlx-lm's and kvstate's draft-model generators (one run of
    each after a warm-up, prefill included): Python calls (cProfile), host reads of device
    values (tolist / item) and explicit evaluations (eval / async_eval)."""
    reads: list[str] = []
    patched = [(mx.array, m) for m in ("tolist", "item")] + [
        (mx, f) for f in ("eval", "async_eval")
    ]
    originals = [getattr(owner, name) for owner, name in patched]
    for (owner, name), real in zip(patched, originals, strict=True):
        setattr(owner, name, _counted(real, name, reads))
    try:
        for name in ("mlx-lm", "kvstate"):
            runs[name]()
            reads.clear()
            profile = cProfile.Profile()
            profile.enable()
            tokens, drafted = runs[name]()
            profile.disable()
            # One non-draft token per round; kvstate's first token comes from its prefill.
            rounds = len(tokens) - drafted - (name == "kvstate")
            calls = pstats.Stats(profile).total_calls
            kinds = {r: reads.count(r) for r in sorted(set(reads))}
            say(
                f"| {label} | {name} | {rounds} | {calls / rounds:.0f} | "
                f"{', '.join(f'{r} {n / rounds:.2f}' for r, n in kinds.items())} |"
            )
    finally:
        for (owner, name), real in zip(patched, originals, strict=True):
            setattr(owner, name, real)


def _counted(real: Callable[..., Any], name: str, log: list[str]) -> Callable[..., Any]:
    def counting(*args: Any) -> Any:
        log.append(name)
        return real(*args)

    return counting


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--sizes", default="tiny", help=f"comma-separated: {', '.join(SIZES)}")
    parser.add_argument("--seeds", default="0", help="comma-separated prompt / draft seeds")
    parser.add_argument("--ks", default="2,4", help="comma-separated draft lengths")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--large", action="store_true", help="same as --sizes large")
    parser.add_argument(
        "--per-round", action="store_true", help="host work per round instead of timing"
    )
    args = parser.parse_args()
    sizes = ["large"] if args.large else args.sizes.split(",")
    n = args.tokens
    say(f"# speculative decoding, {n} tokens, {mx.default_device()}\n")
    say(environment(False))
    if args.per_round:
        say(
            "\n| size | seed | k | generator | rounds | Python calls / round | host reads / round |"
        )
        say("|---|---|---|---|---|---|---|")
    else:
        say(
            "\n| size | seed | k | contender | tok/s (median) | / plain | kvstate / mlx-lm "
            "(paired median [IQR]) | drafts accepted |"
        )
        say("|---|---|---|---|---|---|---|---|")
    for size in sizes:
        # float32 everywhere: in bf16 a K-token forward rounds differently from K one-token
        # forwards, so even mlx-lm's own speculative output drifts from its greedy output
        # (seen on the H200), and the equality check below would fail for numerics alone.
        dtype = mx.float32
        scale = 1.0 if size == "large" else 4.0
        model = tiny_model("llama", scale=scale, dtype=dtype, **SIZES[size])
        vocab = int(model.args.vocab_size)
        for seed in (int(s) for s in args.seeds.split(",")):
            draft = perturbed(
                tiny_model("llama", scale=scale, dtype=dtype, **SIZES[size]), seed=seed + 1
            )
            rng = random.Random(seed)
            prompt = [3 + i for i in range(37)] if seed == 0 else rng.choices(range(vocab), k=37)
            for k in (int(x) for x in args.ks.split(",")):
                timed, runs = contenders(model, draft, prompt, k, n)
                if args.per_round:
                    per_round(runs, f"{size} | {seed} | {k}")
                    continue
                reference, _ = runs["plain"]()
                accepted = {}
                for name, run in runs.items():
                    tokens, accepted[name] = run()
                    assert tokens == reference, f"{name}'s output differs from greedy"
                samples = interleave(timed, args.reps, warmup=1)
                for name in runs:
                    median = samples.median(name)
                    speedup = samples.median("plain") / median
                    ratio = ""
                    if name.startswith("kvstate"):
                        # time(mlx-lm) / time(kvstate): > 1 means kvstate is faster
                        r, lo, hi = samples.paired_ratio("mlx-lm", name)
                        ratio = f"**{r:.2f}** [{lo:.2f}, {hi:.2f}]"
                    drafted = accepted[name] if name != "plain" else ""
                    say(
                        f"| {size} | {seed} | {k} | {name} | {n / median:.1f} | {speedup:.2f} "
                        f"| {ratio} | {drafted} |"
                    )


if __name__ == "__main__":
    main()
