"""CI: the environment holds exactly the locked versions: every installed package is in constraints.txt at its
version there (pip and the project itself aside). A dependency that drifted, or one the lock lacks, fails here."""

from __future__ import annotations

import re
import sys
from importlib.metadata import distributions
from pathlib import Path

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


def main(path: str) -> int:
    pins = locked(Path(path))
    installed = {canonical(d.metadata["Name"]): d.version for d in distributions()}
    problems = [f"{name} {version} is installed but not in {path}" if name not in pins else
                f"{name} {version} is installed; {path} locks {pins[name]}"
                for name, version in sorted(installed.items())
                if name not in UNLOCKED and pins.get(name) != version]
    for problem in problems:
        print(f"check_lock: {problem}", file=sys.stderr)
    print(f"check_lock: {len(installed)} packages installed, {len(problems)} off the lock")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "constraints.txt"))
