"""The README's promises: its code example runs, and the demo's speculative decode is exact."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def readme_example() -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split("## A custom decode loop", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "the README lost its decode-loop example"
    return match.group(1)


def test_readme_decode_loop_example_runs():
    namespace: dict = {}
    exec(compile(readme_example(), "README.md", "exec"), namespace)
    ks = namespace["ks"]
    assert ks.batch_size(namespace["beams"]) == 4
    assert namespace["state"].layers[0].appended == 0  # every verify was committed


def test_demo_speculative_decode_equals_plain_greedy(capsys):
    demo = pytest.importorskip("examples.demo")
    demo.main()  # asserts row by row that speculation reproduced greedy decoding
    out = capsys.readouterr().out
    assert out.count("identical") == len(demo.PROMPTS)
