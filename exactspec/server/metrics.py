"""The server's counters and gauges, for ``GET /metrics`` (prometheus_client writes them out).

The words are those of the rest of exactspec: a *draft* is one request's scored draft in one step; *draft tokens*
are its tokens; *accepted* those that survived verification. Acceptance per draft position i is
accepted_at_position{i} / draft_tokens_at_position{i}; the mean accepted length is generated tokens per request
per target pass. A combined drafter's (the hybrid's) draft and accepted tokens are counted by source as well: the
share of the accepted tokens each source drafted.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from exactspec.step import DraftTotals, PositionCounts, Round

PREFIX = "exactspec"


@dataclass
class Metrics(DraftTotals):
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # of those, restored from the prefix cache
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
    constrained_requests: int = 0  # finished under a grammar (structured output)
    forced_tokens: int = 0  # draft tokens their grammars forced (no drafter call)
    finished: dict[str, int] = field(default_factory=dict)  # finish reason -> requests
    finished_by_mode: dict[str, int] = field(default_factory=dict)  # speculation mode -> requests finished
    tokens_by_mode: dict[str, int] = field(default_factory=dict)  # speculation mode -> tokens generated
    # a combined drafter's (hybrid's) source -> draft tokens it drafted that were scored, and those accepted
    draft_tokens_by_source: dict[str, int] = field(default_factory=dict)
    accepted_tokens_by_source: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def observe_round(self, round_: Round, mode: str) -> None:
        """One request's share of a step; ``mode``: the request's speculation."""
        with self._lock:
            self.request_rounds += 1
            self.generation_tokens += len(round_.tokens)
            _add(self.tokens_by_mode, mode, len(round_.tokens))
            self.positions.observe(round_)
            if round_.source:
                _add(self.draft_tokens_by_source, round_.source, round_.draft_tokens)
                _add(self.accepted_tokens_by_source, round_.source, round_.accepted)

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

    def observe_prefill(self, prompt_tokens: int, seconds: float, cached_tokens: int = 0) -> None:
        """Prompts admitted: their tokens, the seconds their prefill took, and how many of their tokens the prefix
        cache restored instead."""
        with self._lock:
            self.prompt_tokens += prompt_tokens
            self.prefill_seconds += seconds
            self.cached_prompt_tokens += cached_tokens

    def observe_finish(self, reason: str, mode: str) -> None:
        with self._lock:
            _add(self.finished, reason, 1)
            _add(self.finished_by_mode, mode, 1)

    def observe_constrained(self, forced_tokens: int) -> None:
        """A request under a grammar has finished; its grammar forced this many draft tokens."""
        with self._lock:
            self.constrained_requests += 1
            self.forced_tokens += forced_tokens

    def observe_drafter_error(self) -> None:
        with self._lock:
            self.drafter_errors += 1

    def families(self, running: int, waiting: int) -> list[Metric]:
        """The metrics as Prometheus metric families; ``running`` and ``waiting`` are the scheduler's requests now.
        A counter is named without the ``_total`` that its exposed samples end in."""
        with self._lock:  # the scheduler's thread counts while a request's thread scrapes
            return self._families(running, waiting)

    def _families(self, running: int, waiting: int) -> list[Metric]:
        at = self.positions
        counter, gauge = CounterMetricFamily, GaugeMetricFamily
        return [
            _family(counter, "requests", "Requests finished, by finish reason.",
                    ("finish_reason", sorted(self.finished.items())) if self.finished else 0),
            _family(counter, "requests_by_speculation", "Requests finished, by the speculation they asked for "
                    "(auto, always or never; the server's mode when they named none).",
                    ("speculation", sorted(self.finished_by_mode.items())) if self.finished_by_mode else 0),
            _family(counter, "generation_tokens_by_speculation", "Tokens generated, by their request's speculation.",
                    ("speculation", sorted(self.tokens_by_mode.items())) if self.tokens_by_mode else 0),
            _family(counter, "prompt_tokens", "Prompt tokens admitted.", self.prompt_tokens),
            _family(counter, "cached_prompt_tokens", "Prompt tokens restored from the prefix cache, not prefilled.",
                    self.cached_prompt_tokens),
            _family(counter, "generation_tokens", "Tokens generated.", self.generation_tokens),
            _family(counter, "drafts", "Drafts scored (one per request per speculative step).", self.drafts),
            _family(counter, "draft_tokens", "Draft tokens scored.", self.draft_tokens),
            _family(counter, "accepted_tokens", "Draft tokens accepted.", self.accepted_tokens),
            _family(counter, "draft_tokens_by_source", "Draft tokens scored, by the source that drafted them (a "
                    "combined drafter's: the hybrid's copies and draft model).",
                    _by_source(self.draft_tokens_by_source)),
            _family(counter, "accepted_tokens_by_source", "Draft tokens accepted, by the source that drafted them.",
                    _by_source(self.accepted_tokens_by_source)),
            _family(counter, "draft_tokens_at_position", "Draft tokens scored at each draft position.",
                    _by_position(at.drafted)),
            _family(counter, "accepted_tokens_at_position", "Draft tokens accepted at each draft position.",
                    _by_position(at.accepted)),
            _family(gauge, "acceptance_rate_at_position", "Accepted / scored draft tokens at each draft position.",
                    _by_position(at.rates())),
            _family(gauge, "acceptance_rate", "Accepted / scored draft tokens.",
                    self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0),
            _family(gauge, "mean_accepted_length", "Tokens generated per request per target pass.",
                    self.generation_tokens / self.request_rounds if self.request_rounds else 0.0),
            _family(counter, "request_rounds", "Request rounds: one per request per target pass.",
                    self.request_rounds),
            _family(counter, "prefill_seconds", "Seconds in passes that prefill prompts.", self.prefill_seconds),
            _family(counter, "step_seconds", "Seconds in steps (drafting, the target pass, verifying).",
                    self.step_seconds),
            _family(counter, "steps", "Target passes of the batch.", self.steps),
            _family(counter, "speculative_steps", "Target passes that scored draft tokens.", self.speculative_steps),
            _family(gauge, "batch_size", "Requests in the last target pass.", self.batch_size),
            _family(gauge, "speculation_enabled", "1 when the last target pass scored draft tokens, else 0.",
                    int(self.speculating)),
            _family(gauge, "running_requests", "Requests in the batch.", running),
            _family(gauge, "waiting_requests", "Requests queued for a slot.", waiting),
            _family(counter, "drafter_errors", "Drafter failures (the request then decodes plainly).",
                    self.drafter_errors),
            _family(counter, "constrained_requests", "Requests finished under a grammar (structured output).",
                    self.constrained_requests),
            _family(counter, "forced_tokens", "Draft tokens a request's grammar forced, with no drafter call.",
                    self.forced_tokens),
        ]


class Refusals:
    """Requests the HTTP server refused, by status: counted where it answers them (its routes and its framing),
    apart from the scheduler's counters, which count what it ran."""

    def __init__(self) -> None:
        self.by_status: dict[int, int] = {}
        self._lock = threading.Lock()

    def observe(self, status: int) -> None:
        with self._lock:
            self.by_status[status] = self.by_status.get(status, 0) + 1

    def family(self) -> Metric:
        with self._lock:
            counts = sorted(self.by_status.items())
        return _family(CounterMetricFamily, "requests_rejected", "Requests refused, by HTTP status.",
                       ("status", counts) if counts else 0)


class MetricsCollector(Collector):
    """A server's metrics for its CollectorRegistry: the scheduler's counters, the server's refusals, and the
    scheduler's running and waiting requests at the scrape (``requests_now``)."""

    def __init__(self, metrics: Metrics, refusals: Refusals, requests_now: Callable[[], tuple[int, int]]) -> None:
        self.metrics = metrics
        self.refusals = refusals
        self.requests_now = requests_now

    def collect(self) -> list[Metric]:
        return [*self.metrics.families(*self.requests_now()), self.refusals.family()]


def _family(kind: type[CounterMetricFamily | GaugeMetricFamily], name: str, help_: str,
            samples: float | tuple[str, list[tuple[object, float]]]) -> Metric:
    """One metric family: ``samples`` is its one value, or a label's name and (label value, value) pairs."""
    if not isinstance(samples, tuple):
        return kind(f"{PREFIX}_{name}", help_, value=samples)
    label, values = samples
    family = kind(f"{PREFIX}_{name}", help_, labels=[label])
    for label_value, value in values:
        family.add_metric([str(label_value)], value)
    return family


def _by_source(values: dict[str, int]) -> float | tuple[str, list[tuple[object, float]]]:
    """Samples by a combined drafter's source, or 0 (unlabelled) while no source has drafted."""
    return ("source", sorted(values.items())) if values else 0


def _add(counts: dict[str, int], key: str, n: int) -> None:
    """Count n more under ``key``."""
    counts[key] = counts.get(key, 0) + n


def _by_position(values: list[float]) -> tuple[str, list[tuple[object, float]]]:
    """Samples by draft position, 1 first."""
    return "position", [(i + 1, value) for i, value in enumerate(values)]
