"""What of the machine this process may use: the threads it can run at once (``--threads`` held to them), and the
memory it may hold (a size beyond it refused in one line).

The CPUs its affinity mask allows (``taskset``, a container's cpuset), capped by its cgroup's CPU quota (a container
given 1.5 CPUs runs 2 threads at a time at most). A thread team larger than that waits on its own members: the
fused runtime's team meets at a barrier several times a layer, so each member it cannot run at once stalls every
other; and a count that reaches C unchecked (``--threads 100000``) asked the OpenMP runtime for that many threads.
The memory is the machine's, capped by its cgroup's limit.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from exactspec.errors import UsageError
from exactspec.logs import notice

CGROUP = Path("/sys/fs/cgroup")


def usable_cores() -> int:
    """The CPUs this process may run on at once: its affinity mask's, at most its cgroup's quota (rounded up)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    quota = cgroup_quota()
    return max(1, min(cores, math.ceil(quota)) if quota is not None else cores)


def cgroup_quota(root: Path = CGROUP) -> float | None:
    """The CPUs' worth of time the cgroup allows a period (cgroup v2's ``cpu.max``, v1's ``cpu.cfs_quota_us`` over
    ``cpu.cfs_period_us``), or None where there is no limit or none can be read."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return None if quota <= 0 or period <= 0 else quota / period
    except (OSError, ValueError):
        return None


def thread_count(requested: int | None) -> int:
    """The threads to run with: ``requested`` (``--threads``; below 1 refused in one line, above the usable cores
    capped to them with one line), or where none is asked, the usable cores."""
    usable = usable_cores()
    if requested is None:
        return usable
    if requested < 1:
        raise UsageError(f"threads must be >= 1, got {requested}")
    if requested > usable:
        notice(f"--threads {requested}: this process may run {usable} at once; using {usable}")
        return usable
    return requested


def set_torch_threads(requested: int | None) -> int | None:
    """Hold PyTorch's threads (the fused runtime's team is PyTorch's OpenMP threads) to :func:`thread_count`;
    returns the count where one was asked, else None (the runtimes' defaults, which follow PyTorch's)."""
    import torch

    threads = thread_count(requested)
    if requested is not None or torch.get_num_threads() > threads:
        torch.set_num_threads(threads)
    return threads if requested is not None else None


def usable_memory(root: Path = CGROUP) -> int:
    """The bytes of memory this process may hold: the machine's, at most its cgroup's limit."""
    machine = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = cgroup_memory_limit(root)
    return machine if limit is None else min(machine, limit)


def cgroup_memory_limit(root: Path = CGROUP) -> int | None:
    """The cgroup's memory limit in bytes (cgroup v2's ``memory.max``, v1's ``memory.limit_in_bytes``), or None where
    there is none or none can be read."""
    for path in (root / "memory.max", root / "memory" / "memory.limit_in_bytes"):
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        return int(text) if text.isdigit() else None  # v2 writes "max" for no limit
    return None


def beyond_memory(what: str, wanted: int, remedy: str) -> UsageError:
    """One line for a size set at start that this machine cannot hold: ``what`` needs ``wanted`` bytes, and
    ``remedy``, the flags to lower (a traceback, or a server that starts and claims it, before)."""
    return UsageError(f"{what} needs {wanted / 2**30:,.1f} GiB, which this machine cannot reserve: {remedy}")
