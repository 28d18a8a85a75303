"""The code as the project holds it (pyproject.toml): ruff's rules find nothing, and import-linter's contracts hold:
each layer imports only the layers below it, no modules import each other in a circle, no runtime's wing imports
another, and the wings stand on what backends/ shares."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).parent.parent


def test_ruff_finds_nothing():
    run = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "exactspec", "tests", "setup.py"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120, check=False)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-1000:]


def test_the_layers_hold_and_no_imports_circle():
    lint_imports = Path(sys.executable).parent / "lint-imports"
    run = subprocess.run([str(lint_imports), "--no-cache"], capture_output=True, text=True, cwd=ROOT, timeout=300,
                         check=False)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-1000:]
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    assert contracts and f"Contracts: {len(contracts)} kept, 0 broken." in run.stdout  # none skipped
    kept = " ".join(run.stdout.split())  # import-linter wraps long names
    assert all(f"{contract['name']} KEPT" in kept for contract in contracts), run.stdout


def test_every_module_compiles_on_this_python():
    """Every source file parses on the Python the suite runs on (the oldest the project supports in CI): a module no
    test imports, such as a benchmark script, is caught here too."""
    root = Path(__file__).resolve().parent.parent
    for path in sorted((root / "exactspec").rglob("*.py")):
        compile(path.read_text(encoding="utf-8"), str(path), "exec")  # a SyntaxError names the file and line
