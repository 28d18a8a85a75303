"""Seeded draws split between two spawned processes (the suite's two cores): half the seeds in each, the same seeds a
single process would draw."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable


def in_two_processes(worker: Callable, arguments: tuple, seeds: int) -> list:
    """``worker(*arguments, seeds_range)`` for seeds 0 to ``seeds`` - 1, the first half in one spawned process and the
    second in another: their two results, in seed order. A worker loads what it needs itself, on one thread."""
    halves = (range(0, seeds // 2), range(seeds // 2, seeds))
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        return pool.starmap(worker, [(*arguments, half) for half in halves])
