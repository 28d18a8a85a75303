"""CI: the README's install resolves from PyPI alone, with every extra, at the lock's versions.

This workplace's machines carry wheels on disk (a wheel folder and local indexes named in pip's configuration), and
a lock that resolves only there fails a user's first command. So pip resolves the install here as on a machine with
nothing but PyPI: every pip configuration file skipped (``PIP_CONFIG_FILE`` set to the null device, pip's documented
switch) and every ``PIP_*`` variable dropped, in a dry run (``--dry-run --ignore-installed --report``) that installs
nothing. Then each package it would install must be the locked version, served from an index (no ``file:`` URL but
the checkout itself), and what the lock lacks must be what PyPI's torch pulls and the CPU build does not: its CUDA
libraries.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from check_lock import UNLOCKED, canonical, local_pins, locked, matches

ROOT = Path(__file__).resolve().parents[1]
EXTRAS = "test,audit,bench,ray,qwen-coder-1-5b,qwen-coder-0-5b"  # the lock covers every extra


def pypi_only_environment() -> dict[str, str]:
    """The environment less pip's configuration: no config file read, no PIP_* variable."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("PIP_")}
    return env | {"PIP_CONFIG_FILE": os.devnull}


def dry_run_report(constraints: Path) -> dict:
    """pip's report of what ``pip install -c constraints -e .[every extra]`` would install from PyPI alone."""
    with tempfile.TemporaryDirectory() as folder:
        report = Path(folder) / "report.json"
        command = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-cache-dir",
                   "--quiet", "--disable-pip-version-check", "--report", str(report), "-c", str(constraints),
                   "-e", f".[{EXTRAS}]"]
        if subprocess.run(command, cwd=ROOT, env=pypi_only_environment()).returncode:
            raise SystemExit(f"resolve_lock: pip could not resolve {constraints.name} from PyPI alone (above)")
        return json.loads(report.read_text())


def requirement_names(entry: dict) -> set[str]:
    """The names an installed package's metadata requires (markers aside: the resolver already applied them)."""
    lines = entry["metadata"].get("requires_dist", [])
    return {canonical(re.match(r"[A-Za-z0-9._-]+", line).group(0)) for line in lines}


def pulled_by(root: str, entries: dict[str, dict], among: set[str]) -> set[str]:
    """The packages in ``among`` that ``root`` requires, directly or through others in ``among``."""
    found, frontier = set(), [root]
    while frontier:
        for name in requirement_names(entries[frontier.pop()]) & among - found:
            found.add(name)
            frontier.append(name)
    return found


def problems(report: dict, pins: dict[str, str]) -> tuple[list[str], set[str]]:
    """What is wrong with the resolution, and the unlocked packages PyPI's torch pulls (its CUDA build's)."""
    entries = {canonical(entry["metadata"]["name"]): entry for entry in report["install"]}
    unlocked = set(entries) - set(pins) - UNLOCKED
    cuda = pulled_by("torch", entries, unlocked) if "torch" in entries else set()
    found = [f"{name} {entry['metadata']['version']} would be installed; the lock pins {pins[name]}"
             for name, entry in sorted(entries.items()) if name in pins and not matches(entry["metadata"]["version"],
                                                                                          pins[name])]
    found += [f"{name} would be installed but the lock lacks it" for name in sorted(unlocked - cuda)]
    found += [f"{name} would come from {entry['download_info']['url']}, not an index"
              for name, entry in sorted(entries.items())
              if name != "exactspec" and entry["download_info"]["url"].startswith("file:")]
    return found, cuda


def main(path: str) -> int:
    pins = locked(ROOT / path)
    found = local_pins(pins, path)
    cuda: set[str] = set()
    if not found:
        found, cuda = problems(dry_run_report(ROOT / path), pins)
    for problem in found:
        print(f"resolve_lock: {problem}", file=sys.stderr)
    print(f"resolve_lock: {path} with every extra resolved from PyPI alone, {len(found)} problems; PyPI's torch "
          f"(the CUDA build) adds {len(cuda)} packages the CPU build does not: {', '.join(sorted(cuda))}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "constraints.txt"))
