"""Draft-length policies: how many tokens to draft next round (0 = plain decoding).

The engine only asks; a policy learns from each round's verdict.
"""

from __future__ import annotations

from typing import Protocol

from specdec.verify import Verdict


class Policy(Protocol):
    def next_k(self, max_k: int) -> int:
        """Draft length for the next round, at most ``max_k``."""
        ...

    def observe(self, verdict: Verdict) -> None:
        """Learn from the round just verified."""
        ...


class FixedDraftLength:
    """Always draft the configured number of tokens."""

    def next_k(self, max_k: int) -> int:
        return max_k

    def observe(self, verdict: Verdict) -> None:
        pass
