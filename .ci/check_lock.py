"""CI: the lock is one that PyPI alone can serve, and the environment holds exactly its versions.

- No pin carries a local version label (``torch==2.13.0+cpu``): PyPI never serves one, so a lock with one resolves
  only where that wheel lies on disk. The CPU build comes from PyTorch's own index instead (README.md), and a plain
  pin matches it: under PEP 440, ``==2.13.0`` ignores a candidate's local label.
- Every installed package is in constraints.txt at its version there (pip and the project itself aside), compared by
  pip's own rule (``2.13.0+cpu`` satisfies ``==2.13.0``). A dependency that drifted, or one the lock lacks, fails.
"""

from __future__ import annotations

import re
import sys
from importlib.metadata import distributions
from pathlib import Path

from packaging.specifiers import SpecifierSet

UNLOCKED = {"pip", "exactspec"}  # the installer, and the project installed from this checkout


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def locked(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            pins[canonical(name)] = version
    return pins


def local_pins(pins: dict[str, str], path: str) -> list[str]:
    """A problem for each pin with a local version label, which no index but a wheel folder on disk can serve."""
    return [f"{name}=={version} in {path} has a local version label ('+{version.split('+', 1)[1]}'), which PyPI "
            f"never serves: pin {name}=={version.split('+', 1)[0]} (it matches the local build where one is found)"
            for name, version in sorted(pins.items()) if "+" in version]


def matches(installed: str, pin: str) -> bool:
    """Whether an installed version is the locked one, by the rule pip resolves ``==pin`` with."""
    return SpecifierSet(f"=={pin}").contains(installed, prereleases=True)


def off_the_lock(pins: dict[str, str], installed: dict[str, str], path: str) -> list[str]:
    """A problem for each installed package the lock lacks or pins at another version."""
    return [f"{name} {version} is installed but not in {path}" if name not in pins else
            f"{name} {version} is installed; {path} locks {pins[name]}"
            for name, version in sorted(installed.items())
            if name not in UNLOCKED and not (name in pins and matches(version, pins[name]))]


def main(path: str) -> int:
    pins = locked(Path(path))
    installed = {canonical(d.metadata["Name"]): d.version for d in distributions()}
    problems = local_pins(pins, path) + off_the_lock(pins, installed, path)
    for problem in problems:
        print(f"check_lock: {problem}", file=sys.stderr)
    print(f"check_lock: {len(installed)} packages installed, {len(problems)} problems with {path}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "constraints.txt"))
