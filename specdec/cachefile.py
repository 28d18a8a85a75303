"""Measurements kept in the specdec cache (``--dtype auto``'s precisions, ``--backend auto``'s runtimes): one JSON
file of entries keyed by what the measurement depends on, written whole and atomically."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path


def read_entries(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # no cache yet, or a damaged one: measure again


def write_entry(path: Path, key: str, value: dict) -> None:
    entries = read_entries(path)
    entries[key] = value
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(".tmp")
        temporary.write_text(json.dumps(entries, indent=1, sort_keys=True))
        temporary.replace(path)
    except OSError:
        pass  # a read-only cache costs a measurement next time, nothing else


def machine_name() -> str:
    """The CPU's model name and count: what a measurement on this machine holds for."""
    return f"{platform.machine()} {_cpu_name()} {os.cpu_count()} cpus"


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown cpu"
