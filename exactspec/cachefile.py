"""The exactspec cache's place, and the measurements kept in it (``--dtype auto``'s precisions, ``--backend auto``'s
runtimes): one JSON file of entries per kind, each keyed by what the measurement depends on, written whole and
atomically."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path


def file_identity(path: Path) -> str:
    """What a measurement of a file depends on of it: its place, size and time of change (a folder: its place)."""
    stat = path.stat() if path.is_file() else None
    return f"{path.resolve()} {stat.st_size} {int(stat.st_mtime)}" if stat else str(path.resolve())


def cache_root() -> Path:
    """Where exactspec keeps what it measured and converted: ``EXACTSPEC_CACHE``, else ``~/.cache/exactspec``."""
    return Path(os.environ.get("EXACTSPEC_CACHE") or Path.home() / ".cache" / "exactspec")


class MeasurementCache:
    """One file of measurements under the exactspec cache. A key names the format's version, what was measured, and
    what the measurement holds for: this machine, the threads and PyTorch's version."""

    def __init__(self, filename: str, version: int) -> None:
        self.filename, self.version = filename, version

    def path(self) -> Path:
        return cache_root() / self.filename

    def key(self, subject: str, threads: int | None = None) -> str:
        import torch

        threads = threads or torch.get_num_threads()
        return f"v{self.version} | {subject} | {machine_name()} | {threads} threads | torch {torch.__version__}"

    def entries(self) -> dict:
        try:
            return json.loads(self.path().read_text())
        except (OSError, ValueError):
            return {}  # no cache yet, or a damaged one: measure again

    def get(self, key: str) -> dict | None:
        return self.entries().get(key)

    def put(self, key: str, value: dict) -> None:
        entries = self.entries()
        entries[key] = value
        path = self.path()
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
