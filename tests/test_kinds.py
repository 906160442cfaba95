"""The kind contract: every registered kind provides what the contract asks, every list of
kinds is derived from registration, and a new kind needs nothing but its own module."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import find

import kvstate as ks
from kvstate import kinds
from kvstate.adapters.caches.registry import CONVERTERS, to_cache
from kvstate.testing import STRATEGIES

ROOT = Path(__file__).resolve().parent.parent
LIBRARY_KINDS = [k for k in kinds.kinds() if k.__module__.startswith("kvstate.")]


def test_the_library_registers_its_kinds():
    names = {k.__name__ for k in LIBRARY_KINDS}
    assert names == {
        "DenseKV", "RotatingKV", "ChunkedKV", "QuantizedKV", "RecurrentState",
        "ListState", "ModelState", "TurboQuantKV", "PooledKV", "BufferedWindowKV", "StaticPrefixKV",
        "QuantizedRotatingKV",
    }  # fmt: skip
    assert {k.__name__ for k in kinds.layer_kinds()} >= names - {"ListState", "ModelState"}


@pytest.mark.parametrize("kind", LIBRARY_KINDS, ids=lambda k: k.__name__)
def test_every_kind_implements_the_required_functions(kind):
    missing = [fn.__name__ for fn in kinds.REQUIRED if not kinds.implements(kind, fn)]
    assert not missing, f"{kind.__name__} does not register {missing}"
    # Not `kind()`: a window of max_size 0 is no state (its constructor says so).
    example = kind() if issubclass(kind, kinds.Composite) else find(STRATEGIES[kind](), bool)
    assert isinstance(ks.capabilities(example), kinds.Capabilities)


@pytest.mark.parametrize("kind", kinds.layer_kinds(), ids=lambda k: k.__name__)
def test_every_layer_kind_has_a_strategy_and_an_adapter(kind):
    if not kind.__module__.startswith("kvstate."):
        pytest.skip("a kind defined outside the library")
    import kvstate.adapters.vlm  # noqa: F401  (mlx-vlm's converters, TurboQuantKV's among them)

    assert kind in STRATEGIES
    assert kinds.implements(kind, to_cache), f"no to_mlx_lm for {kind.__name__}"
    assert any(_converts_to(f, kind) for f in CONVERTERS.values()), f"no from_mlx_lm for {kind}"


def _converts_to(convert, kind) -> bool:
    return convert.__annotations__.get("return") in (kind.__name__, kind)


def test_adapters_import_only_public_kvstate_modules():
    private = re.compile(r"^\s*(from|import)\s+kvstate\.(_\w+)", re.M)
    for path in (ROOT / "adapters").rglob("*.py"):
        assert not private.findall(path.read_text()), f"{path.name} imports a private module"


def test_composites_expose_their_parts_under_one_name():
    dense = ks.DenseKV()
    for composite in (ks.ListState((dense, dense)), ks.ModelState((dense,))):
        assert composite.parts == (getattr(composite, type(composite)._parts_field))
        assert kinds.with_parts(composite, ()).parts == ()


def test_a_kind_name_cannot_be_registered_twice():
    with pytest.raises(TypeError, match="already registered"):

        @kinds.state_class()
        class DenseKV(kinds.State):
            pass


def test_a_state_class_must_subclass_state():
    with pytest.raises(TypeError, match="must subclass"):

        @kinds.state_class()
        class Loose:
            pass


def test_a_new_kind_in_one_file_works_with_every_transform_and_save_load():
    """examples/custom_kind.py declares a kind and registers its functions and strategy; the
    transforms, check, save/load, composites and strategies then work on it; with its cache
    class registered with kvstate.adapters.caches, so do wrap, a draft model's rollback by one
    commit and token-tree verification, against plain greedy decoding. (A separate process:
    the registry of this one stays the library's.)"""
    run = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "custom_kind.py")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().endswith("ok")
    assert "TokenHistory" in run.stdout
    assert "wrapped HistoryModel: plain, draft-model and tree generation agree" in run.stdout


def test_a_generic_function_finds_implementations_registered_after_it_was_called():
    """kvstate._dispatch.generic caches resolved implementations: a later registration (a
    kind registered late, a subclass) must still win, and keywords pass through."""
    from kvstate._dispatch import generic

    @generic
    def describe(x: object, suffix: str = "") -> str:
        return "default" + suffix

    class Base:
        pass

    class Derived(Base):
        pass

    assert describe(Derived()) == "default"

    @describe.register(Base)
    def _(x: Base, suffix: str = "") -> str:
        return "base" + suffix

    assert describe(Derived(), suffix="!") == "base!"
    describe.register(Derived, lambda x, suffix="": "derived" + suffix)
    assert describe(Derived()) == "derived"
    assert describe(Base()) == "base"


def test_the_speculative_package_uses_only_public_kvstate_names():
    """kvstate/speculative/ is built on the public API: names `kvstate`, `kvstate.kinds` and
    `kvstate.distributed` export, and its own modules (every import, wherever it sits)."""
    import ast

    from kvstate import distributed

    exported = {
        "kvstate": {*ks.__all__, "kinds", "distributed"},
        "kvstate.kinds": set(kinds.__all__),
        "kvstate.distributed": set(distributed.__all__),
    }
    found = []
    for path in sorted((ROOT / "kvstate" / "speculative").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found += [
                    f"{path.name}: import {a.name}"
                    for a in node.names
                    if a.name.startswith("kvstate") and a.name not in exported
                ]
            elif isinstance(node, ast.ImportFrom) and node.level != 1:  # 1: its own modules
                if node.level == 0 and not (node.module or "").startswith("kvstate"):
                    continue  # mlx, attrs, the standard library
                # From kvstate/speculative/, level 2 is kvstate itself.
                module = node.module if node.level == 0 else f"kvstate.{node.module or ''}"
                module = module.rstrip(".")
                names = {a.name for a in node.names}
                if node.level > 2 or module not in exported or names - exported[module]:
                    found.append(f"{path.name}: from {module} import {sorted(names)}")
    assert not found, "private kvstate names imported:\n" + "\n".join(found)


def test_a_new_kind_works_in_tree_verification_and_a_draft_rollback_by_registering():
    """tests/kind_by_registration.py declares a kind (a token log) and registers its
    transforms, `keep_path` / `gather_path` and `Capabilities.joinable_forwards`: tree
    verification keeps a path of it (gathered into place), and ModelDrafter rolls a draft
    state of it back by one commit, without re-running the draft model. (Its own process: the
    registry of this one stays the library's.)"""
    run = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "kind_by_registration.py")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().endswith("TokenLog ok")


def test_joinable_forwards_is_a_kinds_capability_and_composes_over_parts():
    """DenseKV declares it; a composite has it only when every part does (and a composite of
    no parts, like `all([])`); the other capabilities compose as before."""
    dense, window, recurrent = ks.DenseKV(), ks.RotatingKV(max_size=4), ks.RecurrentState()
    assert ks.capabilities(dense).joinable_forwards
    assert not ks.capabilities(window).joinable_forwards
    assert not ks.capabilities(recurrent).joinable_forwards
    assert ks.capabilities(ks.ModelState((dense, ks.ListState((dense, dense))))).joinable_forwards
    mixed = ks.ModelState((dense, ks.ListState((dense, recurrent))))
    assert not ks.capabilities(mixed).joinable_forwards
    assert ks.capabilities(mixed) == ks.capabilities(dense) & ks.capabilities(recurrent)
    assert ks.capabilities(ks.ModelState((dense,))) == ks.capabilities(dense)
    assert ks.capabilities(ks.ModelState(())).joinable_forwards
