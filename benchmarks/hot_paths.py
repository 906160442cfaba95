"""Per-call cost of the hot paths in this checkout against an earlier commit, side by side.

What it times (per call, each ending in an eval of what it produced):
- decode: one 1-token wrapped forward of a 16-layer null model (it only writes each layer's
  cache), the state rebound: the wrapped model's bookkeeping alone;
- verify: a 5-token capturing forward of a tiny qwen3_next;
- round: a capturing verify of 5 tokens then commit_prefix(3): the state handed back in is a
  transform's output, so a checking wrapper checks it each round;
- commit / ragged commit / tile / row_select / filter / merge / extend / extract on a
  16-layer, 4-row DenseKV ModelState of 300 tokens.

The earlier commit's files are copied into a temporary folder; worker processes of the two
versions alternate (old, new, new, old, ...), each timing every operation once, so drift on a
shared machine hits both. Figures are medians over workers of new / old per-call time.

    .venv/bin/python benchmarks/hot_paths.py --against d37287d [--workers 8]
    python3 benchmarks/hot_paths.py --against-tree DIR     # DIR: the earlier version's files
                                                           # (a machine without git: the H200)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _time(fn: Callable[[], Any], inner: int, reps: int = 7) -> float:
    """Median seconds per call over `reps` blocks of `inner` calls."""
    import kvstate

    kvstate.eval(fn())  # warm up
    blocks = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(inner):
            out = fn()
            kvstate.eval(out)
        blocks.append((time.perf_counter() - start) / inner)
    return statistics.median(blocks)


class NullModel:
    """Writes each token's K/V (ones) into every layer's cache and returns fixed logits: a
    wrapped forward of it costs the wrapper's bookkeeping alone, without the math."""

    def __init__(self, layers: int) -> None:
        import mlx.core as mx

        self.layers = [None] * layers
        self.kv = mx.ones((1, 2, 1, 64), mx.float16)
        self.logits = mx.zeros((1, 1, 256), mx.float16)

    def __call__(self, tokens: Any, cache: list[Any]) -> Any:
        import mlx.core as mx

        # As many positions as tokens: a prompt of 4 that wrote 1 would leave states whose
        # `appended` (4) is past their length (1), which their constructors refuse.
        width = tokens.shape[1]
        kv = self.kv if width == 1 else mx.ones((1, 2, width, 64), mx.float16)
        for c in cache:
            c.update_and_fetch(kv, kv)
        return self.logits

    def named_modules(self) -> list[tuple[str, Any]]:
        return []  # wrap reads a split model's placement off its modules: none here


def worker() -> dict[str, float]:
    import mlx.core as mx

    import kvstate as ks

    try:
        from kvstate.adapters import wrap
        from kvstate.adapters.tiny_models import tiny_model
    except ImportError:  # kvstate 0.1 installed its adapters as a top-level package
        from adapters import wrap  # type: ignore[no-redef]
        from adapters.tiny_models import tiny_model  # type: ignore[no-redef]

    out: dict[str, float] = {}
    null = wrap(NullModel(16))
    box = {"state": null(mx.array([[1, 2, 3, 4]]), null.init_state())[1]}

    def decode() -> Any:
        logits, box["state"] = null(mx.array([[5]]), box["state"])
        return (logits, box["state"])

    out["decode step, null model (16 layers)"] = _time(decode, 200)

    hybrid = wrap(tiny_model("qwen3_next"))
    hstate = hybrid(mx.array([[1, 2, 3, 4]]), hybrid.init_state())[1]
    draft = mx.array([[5, 6, 7, 8, 9]])
    out["capturing verify, 5 tokens"] = _time(lambda: hybrid(draft, hstate, capture=True)[:2], 10)
    hbox = {"state": hstate}

    def round_() -> Any:
        logits, verified, ckpt = hybrid(draft, hbox["state"], capture=True)
        hbox["state"] = ks.commit_prefix(verified, 3, ckpt)
        return (logits, hbox["state"])

    out["verify + commit round"] = _time(round_, 10)

    k = mx.random.normal((4, 2, 320, 64)).astype(mx.float16)
    layer = ks.DenseKV(k, k, mx.array([0, 3, 1, 2], mx.int32), length=300, appended=4)
    model_state = ks.eval(ks.ModelState((layer,) * 16))
    ops: dict[str, Callable[[], Any]] = {
        "commit_prefix uniform": lambda: ks.commit_prefix(model_state, 2),
        "commit_prefix ragged": lambda: ks.commit_prefix(model_state, [4, 1, 0, 2]),
        "tile 2": lambda: ks.tile(model_state, 2),
        "row_select": lambda: ks.row_select(model_state, [2, 0]),
        "filter": lambda: ks.filter(model_state, [1, 3]),
        "merge 2": lambda: ks.merge([model_state, model_state]),
        "extend": lambda: ks.extend(model_state, model_state),
        "extract": lambda: ks.extract(model_state, 1),
    }
    for name, fn in ops.items():
        out[f"{name} (16 layers x 4 rows)"] = _time(fn, 20)
    return out


def _export(rev: str) -> Path:
    """The files of commit `rev` in a new temporary folder: a plain copy (`git archive`), not
    a git worktree, so that no `git worktree prune / remove` elsewhere can take it away
    during the run."""
    path = Path(tempfile.mkdtemp(prefix="hot-paths-")) / "old"
    path.mkdir()
    archive = subprocess.run(["git", "archive", rev], cwd=ROOT, check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(path)], input=archive.stdout, check=True)
    return path


def use_adapters_of(source: str) -> None:
    """Import `kvstate.adapters` from `source`'s adapters/ folder. An editable install maps
    that name to this checkout's folder whichever kvstate is first on the path, so without
    this the earlier commit's worker would time this checkout's adapters."""
    import importlib.util

    folder = Path(source) / "adapters"
    if not (folder / "__init__.py").exists():
        return
    import kvstate  # the parent package, from `source`

    spec = importlib.util.spec_from_file_location(
        "kvstate.adapters", folder / "__init__.py", submodule_search_locations=[str(folder)]
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["kvstate.adapters"] = module  # its submodules are then found in `folder`
    kvstate.adapters = module  # type: ignore[attr-defined]
    spec.loader.exec_module(module)


def _run_worker(source: Path) -> dict[str, float]:
    # `source` first; what was on the path stays (MLX's own folder on the H200: /tmp/site).
    path = os.pathsep.join(p for p in (str(source), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    code = (
        "import sys, json; sys.path.insert(0, sys.argv[1]); import hot_paths; "
        "hot_paths.use_adapters_of(sys.argv[2]); print(json.dumps(hot_paths.worker()))"
    )
    run = subprocess.run(
        [sys.executable, "-c", code, str(ROOT / "benchmarks"), str(source)],
        env=env,
        cwd=source,
        capture_output=True,
        text=True,
        check=True,
    )
    result: dict[str, float] = json.loads(run.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", default="d37287d", help="the earlier commit")
    parser.add_argument(
        "--against-tree", type=Path, help="a folder holding the earlier version's files instead"
    )
    parser.add_argument("--workers", type=int, default=8, help="worker processes per version")
    args = parser.parse_args()
    old_tree = args.against_tree or _export(args.against)
    against = str(args.against_tree) if args.against_tree else args.against
    try:
        runs: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
        for i in range(args.workers):
            order = ("old", "new") if i % 2 == 0 else ("new", "old")
            for side in order:
                runs[side].append(_run_worker(old_tree if side == "old" else ROOT))
            print(f"worker pair {i + 1}/{args.workers} done", file=sys.stderr)
    finally:
        if not args.against_tree:
            shutil.rmtree(old_tree.parent, ignore_errors=True)
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                              capture_output=True).stdout.strip()  # fmt: skip
    except OSError:  # no git on this machine
        head = ""
    print(f"## hot paths: this checkout ({head or 'no git'}) vs {against}\n")
    print(f"{args.workers} worker pairs, alternating; medians over workers.\n")
    print("| operation | old us/call | new us/call | new / old [IQR of pairs] |")
    print("|---|---|---|---|")
    for name in runs["new"][0]:
        olds = [r[name] for r in runs["old"]]
        news = [r[name] for r in runs["new"]]
        ratios = sorted(n / o for n, o in zip(news, olds, strict=True))
        q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
        print(
            f"| {name} | {statistics.median(olds) * 1e6:.0f} | {statistics.median(news) * 1e6:.0f}"
            f" | {statistics.median(ratios):.3f} [{q[0]:.2f}, {q[2]:.2f}] |"
        )


if __name__ == "__main__":
    main()
