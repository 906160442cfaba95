"""Shared benchmark machinery: interleaved timing, paired ratios, memory probes, markdown.

Why interleaved and paired: the machines are shared and noisy, so absolute times drift
over a run. Each repetition times every contender once, back to back, in a rotating order,
and a figure is the median over repetitions of the per-repetition ratio (a / b). Drift
that hits both halves of a pair cancels; the inter-quartile range of the paired ratios
is shown so a reader can see how noisy a figure was.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

# --------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------


@dataclass
class Contender:
    """One side of a comparison.

    `setup()` runs untimed before every repetition and returns the argument of `run`
    (fresh inputs for APIs that mutate them, a barrier of the ranks). `run(arg)` is the
    timed part; it must end with an eval of everything it produced, so lazy work is not
    left out of the clock, and return what it produced, so that freeing it happens after
    the clock stops.

    A block of `inner` calls gives one sample, its time per call; with `each_call`, every
    call of the block is timed alone and gives a sample (for percentiles of short calls).
    `units(result)`, if given, is what the block's time is divided by instead of `inner`:
    a count known only from the run's result (a generation's rounds or tokens).
    """

    name: str
    run: Callable[[Any], Any]
    setup: Callable[[], Any] = lambda: None
    inner: int = 1  # calls per timed block, for sub-millisecond operations (time is per call)
    each_call: bool = False
    units: Callable[[Any], float] | None = None


@dataclass
class Samples:
    """Each contender's samples: wall-clock seconds (`times`) and, read around the same
    blocks, this process's CPU seconds (`cpu_times`: every thread's, much less moved than the
    wall clock by other processes on a shared CPU)."""

    times: dict[str, list[float]] = field(default_factory=dict)
    cpu_times: dict[str, list[float]] = field(default_factory=dict)

    def of(self, cpu: bool) -> dict[str, list[float]]:
        return self.cpu_times if cpu else self.times

    def median(self, name: str, cpu: bool = False) -> float:
        return statistics.median(self.of(cpu)[name])

    def paired_ratio(self, a: str, b: str, cpu: bool = False) -> tuple[float, float, float]:
        """(median, 25th, 75th percentile) of the per-repetition ratio time(a) / time(b)."""
        times = self.of(cpu)
        ratios = sorted(x / y for x, y in zip(times[a], times[b], strict=True))
        return statistics.median(ratios), _quantile(ratios, 0.25), _quantile(ratios, 0.75)


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    if len(sorted_values) == 1:
        return sorted_values[0]
    pos = q * (len(sorted_values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def interleave(
    contenders: Sequence[Contender],
    reps: int,
    warmup: int = 2,
    keep_gc: bool = False,
    check: Callable[[str, Any], None] | None = None,
) -> Samples:
    """Time every contender once per repetition, rotating the order each repetition.

    The garbage collector is off inside timed blocks (a collection would land on one
    contender only) unless `keep_gc`: then each contender pays for the collections its own
    allocations trigger, as in real use (for long blocks of many calls). `check(name,
    result)`, if given, sees each block's last result (warm-ups too) after its clock stops:
    an output checked where it is timed, or a count kept.
    """
    samples = Samples({c.name: [] for c in contenders}, {c.name: [] for c in contenders})
    n = len(contenders)
    was_enabled = gc.isenabled()
    if keep_gc:
        gc.enable()
    else:
        gc.disable()
    try:
        for rep in range(warmup + reps):
            order = [contenders[(rep + i) % n] for i in range(n)]
            for c in order:
                arg = c.setup()
                sync()
                for _ in range(c.inner if c.each_call else 1):
                    c0, t0 = time.process_time(), time.perf_counter()
                    for _ in range(1 if c.each_call else c.inner):
                        result = c.run(arg)
                    t1, c1 = time.perf_counter(), time.process_time()
                    if check is not None:
                        check(c.name, result)
                    per = 1 if c.each_call else c.inner
                    if c.units is not None:
                        per = c.units(result)
                    del result  # freeing buffers is not part of the operation
                    if rep >= warmup:
                        samples.times[c.name].append((t1 - t0) / per)
                        samples.cpu_times[c.name].append((c1 - c0) / per)
                del arg
            gc.collect()
    finally:
        (gc.enable if was_enabled else gc.disable)()
    return samples


def sync() -> None:
    """Wait for the default stream (a no-op cost on CPU; matters on a GPU)."""
    mx.synchronize()


# --------------------------------------------------------------------------------------
# Memory
# --------------------------------------------------------------------------------------


def active_delta(fn: Callable[[], Any]) -> tuple[int, int, Any]:
    """Run `fn` (which must eval what it returns) and report
    (active-memory delta while its result is alive, peak above the starting active, result)."""
    gc.collect()
    sync()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    out = fn()
    sync()
    return mx.get_active_memory() - before, mx.get_peak_memory() - before, out


# --------------------------------------------------------------------------------------
# Reporting
# --------------------------------------------------------------------------------------


def fmt_time(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.2f} us"
    if seconds < 1:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"


def fmt_bytes(n: float) -> str:
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def fmt_ratio(stats: tuple[float, float, float]) -> str:
    med, lo, hi = stats
    return f"**{med:.3f}** [{lo:.3f}, {hi:.3f}]"


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def verdict(ok: bool) -> str:
    return "met" if ok else "**missed**"


def device_name() -> str:
    dev = mx.default_device()
    try:
        info = mx.device_info()
        name = info.get("device_name", "")
    except Exception:  # older MLX: no device_info
        name = ""
    return f"{dev} {name}".strip()


def environment(quick: bool) -> str:
    """The machine, command and versions, as a markdown list."""
    import mlx_lm

    cores = os.cpu_count()
    command = " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv])
    return "\n".join(
        [
            f"- machine: {platform.node()} ({platform.machine()}, {cores} cores, "
            f"{platform.system()} {platform.release()})",
            f"- MLX device: {device_name()}",
            f"- mlx {getattr(mx, '__version__', '?')}, mlx-lm {getattr(mlx_lm, '__version__', '?')}, "
            f"Python {platform.python_version()}",
            f"- command: `{command}`" + (" (quick mode: fewer repetitions)" if quick else ""),
            f"- date: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}",
        ]
    )


def parse_quick(description: str) -> bool:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (smoke run)")
    return bool(parser.parse_args().quick)


def main_for(title: str, run: Callable[[bool], str], description: str) -> None:
    """The `python benchmarks/<name>.py [--quick]` entry point of one benchmark."""
    quick = parse_quick(description)
    print(f"# {title}\n\n{environment(quick)}\n")
    print(run(quick))
