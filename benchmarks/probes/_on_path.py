"""Puts benchmarks/ on the import path, so a probe can reuse a benchmark's fixtures
(`from verify import ...`) when run as `python benchmarks/probes/<probe>.py`."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
