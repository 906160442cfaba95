"""The examples run in the Quick start environment (`pip install -e ".[cpu]"`: no hypothesis,
no pytest): each as a subprocess with hypothesis made unimportable."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
WITHOUT_TEST_EXTRA = (
    "import runpy, sys; sys.modules['hypothesis'] = None; sys.modules['pytest'] = None; "
    "sys.argv = [sys.argv[1]]; runpy.run_path(sys.argv[0], run_name='__main__')"
)


@pytest.mark.parametrize("example", ["custom_kind.py", "distributed.py"])
def test_an_example_runs_without_the_test_extra(example: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_TEST_EXTRA, str(ROOT / "examples" / example)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
