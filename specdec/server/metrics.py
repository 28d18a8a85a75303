"""The server's counters and gauges, rendered in the Prometheus text format (``GET /metrics``).

The words are those of the rest of specdec: a *draft* is one request's scored draft in one step; *draft tokens*
are its tokens; *accepted* those that survived verification. Acceptance per draft position i is
accepted_at_position{i} / draft_tokens_at_position{i}; the mean accepted length is generated tokens per request
per target pass.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from specdec.step import DraftTotals, PositionCounts, Round

PREFIX = "specdec"


@dataclass
class Metrics(DraftTotals):
    prompt_tokens: int = 0
    generation_tokens: int = 0
    request_rounds: int = 0  # one per request per target pass
    positions: PositionCounts = field(default_factory=PositionCounts)  # draft and accepted tokens per position
    steps: int = 0
    prefill_seconds: float = 0.0  # in passes that prefill admitted prompts
    step_seconds: float = 0.0  # in steps: drafting, the target pass, verification
    speculative_steps: int = 0
    batch_size: int = 0  # requests in the last step
    speculating: bool = False  # whether the last step scored any draft token
    drafter_errors: int = 0
    finished: dict[str, int] = field(default_factory=dict)  # finish reason -> requests
    rejected: dict[int, int] = field(default_factory=dict)  # HTTP status -> requests refused
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def observe_round(self, round_: Round) -> None:
        """One request's share of a step."""
        with self._lock:
            self.request_rounds += 1
            self.generation_tokens += len(round_.tokens)
            self.positions.observe(round_)

    @property
    def drafts(self) -> int:
        """Drafts scored: one per request per speculative step."""
        return self.positions.drafting_rounds


    def observe_step(self, batch_size: int, speculating: bool, seconds: float) -> None:
        with self._lock:
            self.steps += 1
            self.step_seconds += seconds
            self.speculative_steps += speculating
            self.batch_size = batch_size
            self.speculating = speculating

    def observe_prefill(self, prompt_tokens: int, seconds: float) -> None:
        with self._lock:
            self.prompt_tokens += prompt_tokens
            self.prefill_seconds += seconds

    def observe_rejection(self, status: int) -> None:
        with self._lock:
            self.rejected[status] = self.rejected.get(status, 0) + 1

    def observe_finish(self, reason: str) -> None:
        with self._lock:
            self.finished[reason] = self.finished.get(reason, 0) + 1

    def render(self, running: int, waiting: int) -> str:
        """The text of ``GET /metrics``; ``running`` and ``waiting`` are the scheduler's requests now."""
        with self._lock:  # the scheduler's thread counts while a request's thread renders
            return self._render(running, waiting)

    def _render(self, running: int, waiting: int) -> str:
        lines: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
            lines.append(f"# HELP {PREFIX}_{name} {help_}")
            lines.append(f"# TYPE {PREFIX}_{name} {kind}")
            lines.extend(f"{PREFIX}_{name}{labels} {_number(value)}" for labels, value in samples)

        finished = sorted(self.finished.items())
        metric("requests_total", "counter", "Requests finished, by finish reason.",
               [(f'{{finish_reason="{reason}"}}', n) for reason, n in finished] or [("", 0)])
        metric("requests_rejected_total", "counter", "Requests refused, by HTTP status.",
               [(f'{{status="{status}"}}', n) for status, n in sorted(self.rejected.items())] or [("", 0)])
        metric("prompt_tokens_total", "counter", "Prompt tokens prefilled.", [("", self.prompt_tokens)])
        metric("generation_tokens_total", "counter", "Tokens generated.", [("", self.generation_tokens)])
        metric("drafts_total", "counter", "Drafts scored (one per request per speculative step).",
               [("", self.drafts)])
        metric("draft_tokens_total", "counter", "Draft tokens scored.", [("", self.draft_tokens)])
        metric("accepted_tokens_total", "counter", "Draft tokens accepted.", [("", self.accepted_tokens)])
        at = self.positions
        metric("draft_tokens_at_position_total", "counter", "Draft tokens scored at each draft position.",
               [(f'{{position="{i + 1}"}}', n) for i, n in enumerate(at.drafted)])
        metric("accepted_tokens_at_position_total", "counter", "Draft tokens accepted at each draft position.",
               [(f'{{position="{i + 1}"}}', n) for i, n in enumerate(at.accepted)])
        metric("acceptance_rate_at_position", "gauge", "Accepted / scored draft tokens at each draft position.",
               [(f'{{position="{i + 1}"}}', rate) for i, rate in enumerate(at.rates())])
        metric("acceptance_rate", "gauge", "Accepted / scored draft tokens.",
               [("", self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0)])
        metric("mean_accepted_length", "gauge", "Tokens generated per request per target pass.",
               [("", self.generation_tokens / self.request_rounds if self.request_rounds else 0.0)])
        metric("request_rounds_total", "counter", "Request rounds: one per request per target pass.",
               [("", self.request_rounds)])
        metric("prefill_seconds_total", "counter", "Seconds in passes that prefill prompts.",
               [("", self.prefill_seconds)])
        metric("step_seconds_total", "counter", "Seconds in steps (drafting, the target pass, verifying).",
               [("", self.step_seconds)])
        metric("steps_total", "counter", "Target passes of the batch.", [("", self.steps)])
        metric("speculative_steps_total", "counter", "Target passes that scored draft tokens.",
               [("", self.speculative_steps)])
        metric("batch_size", "gauge", "Requests in the last target pass.", [("", self.batch_size)])
        metric("speculation_enabled", "gauge", "1 when the last target pass scored draft tokens, else 0.",
               [("", int(self.speculating))])
        metric("running_requests", "gauge", "Requests in the batch.", [("", running)])
        metric("waiting_requests", "gauge", "Requests queued for a slot.", [("", waiting)])
        metric("drafter_errors_total", "counter", "Drafter failures (the request then decodes plainly).",
               [("", self.drafter_errors)])
        return "\n".join(lines) + "\n"


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"
