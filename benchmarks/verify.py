"""Verify forwards, speculative rounds and end-to-end speculative decoding through `wrap`,
against raw mlx-lm caches, on llama-, qwen3_next- and nemotron_h-style models.

Random-init bf16 models of a real model's shape (hidden 2048, 16 layers, vocab 32000; see
MODELS), a 1k-token context. Every row is printed (and flushed) as soon as it is measured,
so a run cut at its time limit keeps what it measured. Sections (`--only` picks some):

  forward   K-token forwards (K = 1, 2, 5, 9, 17): raw mlx-lm, wrap, wrap with capture=True
  round     a verify (K = 4, capture) + reading its logits + commit_prefix(3), with the state
            before the verify dropped or still held by the caller (the README loop holds it);
            on llama also raw mlx-lm's verify-and-trim round
  decode    tokens/s of plain greedy decoding through wrap vs raw (generate_step's pipelined loop)
  spec      end-to-end speculative decoding with an oracle drafter (acceptance 0.5 / 0.8 / 1.0,
            K = 2 / 4 / 8) vs plain greedy decoding, tokens/s ratio
  anatomy   where a round's time goes (verify 5, keep 4): building the forward's graph on the
            host, commit_prefix, and waiting for the device, kvstate vs raw mlx-lm; and the
            same for a pipelined decode step

    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/verify.py            # on the H200
    .venv/bin/python benchmarks/verify.py --small --only forward      # a smoke run on a CPU

Timing: medians of repetitions, each ending in an eval of everything it produced; inputs that
a forward consumes (a state passed without being held) are fresh copies made untimed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from _fixtures import BIG_MODELS
from _harness import Contender, interleave
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

import kvstate as ks
from kvstate.adapters import to_mlx_lm, wrap
from kvstate.adapters.tiny_models import tiny_model

BIG = BIG_MODELS  # (the probes import it from here)
SMALL: dict[str, dict[str, Any]] = {"llama": {}, "qwen3_next": {}, "nemotron_h": {}}


def say(text: str) -> None:
    print(text, flush=True)


def build(name: str, small: bool) -> nn.Module:
    config = SMALL[name] if small else BIG[name]
    return tiny_model(name, scale=1.0, dtype=mx.float32 if small else mx.bfloat16, **config)


def median_ms(
    fn: Callable[[Any], Any], reps: int, setup: Callable[[], Any] = lambda: None
) -> float:
    """Median milliseconds of `fn(setup())` over `reps`, after two warm-ups: its output
    evaluated and the device synchronized inside the clock, `setup` outside it."""

    def run(arg: Any) -> Any:
        out = ks.eval(fn(arg))
        mx.synchronize()
        return out

    samples = interleave([Contender("fn", run, setup)], reps, warmup=2, keep_gc=True)
    return samples.median("fn") * 1e3


def copied(state: Any) -> Any:
    """A copy of `state` in buffers of its own (so a forward may update them in place)."""
    return ks.eval(ks.tree_map(lambda a: mx.array(a) + 0 if a.size else a, state))


def random_ids(model: nn.Module, shape: tuple[int, ...], seed: int) -> mx.array:
    return mx.array(np.random.default_rng(seed).integers(0, model.args.vocab_size, shape))


def prefilled(m: Any, context: int, seed: int = 0) -> Any:
    return ks.eval(m(random_ids(m.model, (1, context), seed), m.init_state())[1])


# ---------------------------------------------------------------------------------------


def forward_section(name: str, model: nn.Module, context: int, reps: int) -> None:
    m = wrap(model)
    base = prefilled(m, context)
    one = {}
    say(f"\n## forward: {name}, context {context} (ms, median of {reps})\n")
    say("| K | raw mlx-lm | wrap | wrap, capture | capture / no capture | capture / 1-token raw |")
    say("|---|---|---|---|---|---|")
    for k in (1, 2, 5, 9, 17):
        tokens = random_ids(model, (1, k), k)
        raw = median_ms(
            lambda c, t=tokens: model(t, cache=c), reps, lambda: to_mlx_lm(copied(base))
        )
        plain = median_ms(lambda box, t=tokens: m(t, box.pop())[:2], reps, lambda: [copied(base)])
        capt = median_ms(
            lambda box, t=tokens: m(t, box.pop(), capture=True), reps, lambda: [copied(base)]
        )
        one.setdefault("raw", raw)
        say(
            f"| {k} | {raw:.2f} | {plain:.2f} | {capt:.2f} | {capt / plain:.2f} "
            f"| {capt / one['raw']:.2f} |"
        )


def round_section(name: str, model: nn.Module, context: int, rounds: int) -> None:
    """Rounds of: verify 5 tokens (the last one + 4 drafts), read the logits, keep 4."""
    m = wrap(model)
    draft = mx.array([[1, 2, 3, 4, 5]])
    say(
        f"\n## round: {name}, context {context}, verify 5 / keep 4 (ms per round, median of {rounds})\n"
    )
    say("| contender | ms (median) | first rounds, ms |")
    say("|---|---|---|")

    def loop(capture: bool, hold: bool) -> float:
        state = copied(prefilled(m, context))
        times = []
        for _ in range(rounds + 2):
            start = time.perf_counter()
            if hold:
                out = m(draft, state, capture=capture)
            else:
                box = [state]
                del state
                out = m(draft, box.pop(), capture=capture)
            out[0].argmax(-1).tolist()  # the caller reads the logits (a sync)
            checkpoints = out[2] if capture else None
            state = ks.eval(ks.commit_prefix(out[1], 4, checkpoints))
            del out
            mx.synchronize()
            times.append(time.perf_counter() - start)
        first = " ".join(f"{t * 1e3:.0f}" for t in times[:8])
        return f"{statistics.median(times[2:]) * 1e3:.2f} | {first} |"

    for repeat in range(2):  # twice: is a slow contender slow, or only the first one run?
        for capture in (False, True) if name == "llama" else (True,):  # recurrent: capture
            for hold in (False, True):
                say(f"| {repeat}: wrap, capture={capture}, pre-verify state "
                    f"{'held' if hold else 'dropped'} | {loop(capture, hold)}")  # fmt: skip
    if name == "llama":
        caches = to_mlx_lm(copied(prefilled(m, context)))
        times = []
        for _ in range(rounds + 2):
            start = time.perf_counter()
            logits = model(draft, cache=caches)
            logits.argmax(-1).tolist()
            trim_prompt_cache(caches, 1)
            mx.eval([c.keys for c in caches])
            mx.synchronize()
            times.append(time.perf_counter() - start)
        say(f"| raw mlx-lm verify + trim | {statistics.median(times[2:]) * 1e3:.2f} | |")


class RawDecoder:
    """Plain greedy decoding on raw mlx-lm caches, pipelined like generate_step."""

    def __init__(self, model: nn.Module, prompt: mx.array) -> None:
        self.model, self.caches = model, make_prompt_cache(model)
        self.y = model(prompt, cache=self.caches)[:, -1].argmax(-1)
        mx.eval(self.y)

    def step(self, y: mx.array) -> mx.array:
        return self.model(y[:, None], cache=self.caches)[:, -1].argmax(-1)


class WrapDecoder:
    """The same loop through `wrap`: `logits, state = m(y, state)`."""

    def __init__(self, m: Any, prompt: mx.array) -> None:
        self.m = m
        logits, self.state = m(prompt, m.init_state())
        self.y = logits[:, -1].argmax(-1)
        mx.eval(self.y)

    def step(self, y: mx.array) -> mx.array:
        logits, self.state = self.m(y[:, None], self.state)
        return logits[:, -1].argmax(-1)


class ChainDecoder:
    """The same loop as one `m.chain` per block: each step's pick (the argmax) is evaluated
    asynchronously while the host builds the next step, and the previous token is read back
    as a streaming decoder would; the state is read back from the caches once per block."""

    def __init__(self, m: Any, prompt: mx.array) -> None:
        self.m = m
        logits, self.state = m(prompt, m.init_state())
        self.y = logits[:, -1].argmax(-1)
        mx.eval(self.y)

    def block(self, n: int) -> None:
        previous = [self.y]

        def pick(last: mx.array) -> mx.array:
            y = last.argmax(-1)
            mx.async_eval(y)
            previous[0].item()
            previous[0] = y
            return y

        # The state is handed over (no other reference while the chain runs), so MLX writes
        # the steps into its buffers in place, as a rebinding decode loop lets it.
        _, _, self.state = self.m.chain(self.y[:, None], self._take(), n, pick)
        self.y = previous[0]

    def _take(self) -> Any:
        state, self.state = self.state, None
        return state


def decode_block(decoder: Any, n: int) -> float:
    """Seconds for `n` more tokens of `decoder`'s greedy decode (pipelined: step t+1 is built
    while the device runs step t; each token read back as a decoder would)."""
    if hasattr(decoder, "block"):
        start = time.perf_counter()
        decoder.block(n)
        mx.eval(decoder.y)
        return time.perf_counter() - start
    y = decoder.y
    start = time.perf_counter()
    for _ in range(n):
        nxt = decoder.step(y)
        mx.async_eval(nxt)
        y.item()
        y = nxt
    mx.eval(y)
    decoder.y = y
    return time.perf_counter() - start


class GeneratorDecoder:
    """Tokens pulled from a streaming generator (kvstate's `generate` without a drafter, or
    mlx-lm's `generate_step`), which pipelines its own steps."""

    def __init__(self, tokens: Any) -> None:
        self.tokens = tokens
        self.y = None  # each token is read as it is pulled: nothing is left to wait for

    def block(self, n: int) -> None:
        for _ in range(n):
            next(self.tokens)


def decode_section(name: str, model: nn.Module, context: int, n: int) -> None:
    """Each contender decodes in blocks of 16 tokens (continuing its own sequence) that
    alternate with its baseline's, so that the host's drift between calls (+-40% on the
    H200) hits both alike: the figure is the median of the adjacent blocks' speed ratios.
    Baselines: raw mlx-lm's pipelined loop, and for kvstate's generator (no drafter) mlx-lm's
    own `generate_step` (both compute each token's log-probabilities)."""
    from kvstate.speculative import generate

    prompt = random_ids(model, (1, context), 1)
    m = wrap(model)
    raw = RawDecoder(model, prompt)
    endless = 10**9
    kvstate_stream = (t for r in generate(m, prompt.tolist(), max_tokens=endless) for t in r)
    mlx_stream = generate_step(prompt[0], model, max_tokens=endless)
    pairs = {
        "wrap / raw": (raw, WrapDecoder(m, prompt)),
        "wrap, m.chain per block / raw": (raw, ChainDecoder(m, prompt)),
        "kvstate generate, no drafter / mlx-lm generate_step": (
            GeneratorDecoder(mlx_stream),
            GeneratorDecoder(kvstate_stream),
        ),
    }
    block, ratios = 16, {label: [] for label in pairs}  # type: ignore[var-annotated]
    for pair in pairs.values():
        for decoder in pair:
            decode_block(decoder, 4)  # warm-up
    for i in range(max(2, n // block)):
        # Rotating order; each contender's block is paired with its baseline's next to it.
        for label in list(pairs)[i % 3 :] + list(pairs)[: i % 3]:
            base, other = pairs[label]
            order = (base, other) if i % 2 == 0 else (other, base)
            times = {id(d): decode_block(d, block) for d in order}
            ratios[label].append(times[id(base)] / times[id(other)])
    say(f"\n## decode: {name}, context {context}, {len(ratios['wrap / raw'])} alternating "
        f"blocks of {block} tokens (tokens/s ratios)\n")  # fmt: skip
    for label, found in ratios.items():
        q1, median, q3 = statistics.quantiles(found, n=4)
        say(f"{label}: median {median:.3f} [IQR {q1:.3f}, {q3:.3f}]")


def spec_run(
    m: Any, prompt: mx.array, p: float, k: int, n: int, seed: int
) -> tuple[float, float, list[Any]]:
    """One speculative decode of ~n tokens (after two untimed warm-up rounds): tokens/s,
    tokens per round, and each round's (build, launch, wait, commit) seconds."""
    rng = np.random.default_rng(seed)
    logits, state = m(prompt, m.init_state())
    y = int(logits[0, -1].argmax().item())
    produced = rounds = 0
    phases: list[tuple[float, float, float, float]] = []
    start = time.perf_counter()
    while produced < n + 2 * k:
        if rounds == 2:  # two warm-up rounds (kernels for this K) are not timed
            start, produced, phases = time.perf_counter(), 0, []
        draft = rng.integers(0, m.vocab_size, k).tolist()
        t0 = time.perf_counter()
        # Ids from the host are checked there (no guard kernels, unlike an mx.array's).
        logits, verified, checkpoints = m([[y, *draft]], state, capture=True)
        accepted = 0
        while accepted < k and rng.random() < p:
            accepted += 1
        t1 = time.perf_counter()
        mx.async_eval(logits)
        t2 = time.perf_counter()
        y = int(logits[0, accepted].argmax().item())  # a decoder reads its logits
        t3 = time.perf_counter()
        state = ks.commit_prefix(verified, accepted + 1, checkpoints)
        phases.append((t1 - t0, t2 - t1, t3 - t2, time.perf_counter() - t3))
        produced += accepted + 1
        rounds += 1
    mx.eval(ks.tree_flatten(state)[0])
    return produced / (time.perf_counter() - start), produced / (rounds - 2), phases


def spec_section(
    name: str,
    model: nn.Module,
    context: int,
    n: int,
    ps: Sequence[float] = (0.5, 0.8, 1.0),
    ks_: Sequence[int] = (2, 4, 8),
    seed: int = 0,
) -> None:
    """Speculative decoding at a controlled acceptance rate: each round verifies the last
    token and K drafts with capture, accepts each draft with probability p until the first
    rejection (the law of an oracle drafter that is right with probability p; drafting costs
    nothing here), keeps the verify's own tokens and commits. A random-init bf16 model's
    greedy tokens change with the forward's shape, so an oracle of precomputed tokens would
    be rejected by rounding, not by design: the acceptance is drawn, the work is real.
    Each row alternates 3 plain greedy runs (raw mlx-lm, pipelined) with 3 speculative ones
    and gives the median of the 3 adjacent ratios: the host's speed drifts between runs.
    Each speculative run draws its own acceptances (seed + run): with one seed for all three
    the row measured one draw of ~60 rounds, which at p=0.8, K=4 gave 2.97 tokens a round
    where the law gives 3.36. The realized tokens per round are printed beside the law's."""
    m = wrap(model)
    prompt = random_ids(model, (1, context), 2)
    say(f"\n## spec: {name}, context {context}, {n} tokens a run\n")
    say(
        "| acceptance p | K | tokens/s | / plain greedy (3 runs) | tokens per round (3 runs; "
        "the law's mean) | ms per round: build verify / launch it (async_eval) / wait for its "
        "logits / commit |"
    )
    say("|---|---|---|---|---|---|")
    for p in ps:
        for k in ks_:
            ratios, rates, phases, per_round = [], [], [], []
            for run in range(3):
                plain = n / decode_block(RawDecoder(model, prompt), n)
                rate, tokens_per_round, run_phases = spec_run(m, prompt, p, k, n, seed + run)
                ratios.append(rate / plain)
                rates.append(rate)
                per_round.append(tokens_per_round)
                phases += run_phases
            law = sum(p**i for i in range(k + 1))  # 1 + E[accepted drafts]
            split = " / ".join(
                f"{statistics.median(x) * 1e3:.2f}" for x in zip(*phases, strict=True)
            )
            say(f"| {p} | {k} | {statistics.median(rates):.1f} | {statistics.median(ratios):.2f} "
                f"({', '.join(f'{r:.2f}' for r in ratios)}) | "
                f"{', '.join(f'{t:.2f}' for t in per_round)}; {law:.2f} | {split} |")  # fmt: skip


def anatomy_section(name: str, model: nn.Module, context: int, rounds: int) -> None:
    """Host time per phase, medians over `rounds` (raw and kvstate interleaved)."""
    m = wrap(model)
    draft = mx.array([[1, 2, 3, 4, 5]])
    phases: dict[str, list[float]] = {}

    def note(key: str, start: float) -> float:
        now = time.perf_counter()
        phases.setdefault(key, []).append(now - start)
        return now

    state = copied(prefilled(m, context))
    caches = to_mlx_lm(copied(prefilled(m, context)))
    for _ in range(rounds + 2):
        t = time.perf_counter()
        logits, verified, checkpoints = m(draft, state, capture=True)
        del state
        t = note("kvstate: build verify graph", t)
        logits[0, 3].argmax().item()
        t = note("kvstate: wait for the device", t)
        state = ks.commit_prefix(verified, 4, checkpoints)
        del verified, checkpoints
        note("kvstate: commit_prefix", t)
        t = time.perf_counter()
        raw = model(draft, cache=caches)
        t = note("raw: build verify graph", t)
        raw[0, 3].argmax().item()
        t = note("raw: wait for the device", t)
        trim_prompt_cache(caches, 1)
        note("raw: trim", t)
    y = mx.array([[1]])
    for _ in range(rounds + 2):
        t = time.perf_counter()
        logits, state = m(y, state)
        t = note("decode kvstate: build step graph", t)
        mx.async_eval(logits)
        note("decode kvstate: async_eval", t)
        t = time.perf_counter()
        raw = model(y, cache=caches)
        t = note("decode raw: build step graph", t)
        mx.async_eval(raw)
        note("decode raw: async_eval", t)
    mx.eval(logits, raw)
    say(f"\n## anatomy: {name}, context {context} (ms, median of {rounds})\n")
    say("| phase | ms |")
    say("|---|---|")
    for key, times in phases.items():
        say(f"| {key} | {statistics.median(times[2:]) * 1e3:.3f} |")


SECTIONS = {"forward", "round", "decode", "spec", "anatomy"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="tiny models (a CPU smoke run)")
    parser.add_argument("--only", nargs="*", default=sorted(SECTIONS), choices=sorted(SECTIONS))
    parser.add_argument("--models", nargs="*", default=list(BIG), choices=list(BIG))
    parser.add_argument("--context", type=int, default=None)
    parser.add_argument("--ps", nargs="*", type=float, default=[0.5, 0.8, 1.0], help="spec rows")
    parser.add_argument("--ks", nargs="*", type=int, default=[2, 4, 8], help="spec rows")
    parser.add_argument("--tokens", type=int, default=None, help="spec: tokens a run")
    args = parser.parse_args()
    context = args.context or (64 if args.small else 1024)
    reps = 3 if args.small else 10
    say(f"# verify benchmark: {mx.default_device()}, mlx {mx.__version__}, "
        f"context {context}, {'small' if args.small else 'full-size'} models")  # fmt: skip
    for name in args.models:
        model = build(name, args.small)
        if "forward" in args.only:
            forward_section(name, model, context, reps)
        if "round" in args.only:
            round_section(name, model, context, 5 if args.small else 20)
        if "decode" in args.only:
            decode_section(name, model, context, 16 if args.small else 400)
        if "anatomy" in args.only:
            anatomy_section(name, model, context, 10 if args.small else 40)
        if "spec" in args.only:
            tokens = args.tokens or (16 if args.small else 200)
            spec_section(name, model, context, tokens, args.ps, args.ks)
        del model
        sys.stdout.flush()


if __name__ == "__main__":
    main()
