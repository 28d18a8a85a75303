"""The code as the project holds it: ruff's rules (pyproject.toml [tool.ruff]) find nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent


def test_ruff_finds_nothing():
    run = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "specdec", "tests", "setup.py"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120, check=False)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-1000:]
