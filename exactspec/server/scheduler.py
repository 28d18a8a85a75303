"""Continuous batching with speculation: every running request advances in one target pass per step.

The step loop, over the requests running now:

1. admit waiting requests into free slots and prefill their prompts (one pass for all of them);
2. draft for each request (its own drafter: prompt lookup and retrieval keep per-request state); requests that
   draft with the server's one draft model draft in lockstep, one pass over all their rows per draft position;
3. the planner chooses how many of each request's draft tokens to score: all (``always``), none (``never``), or
   what maximises the step's expected tokens per second at this batch size (``auto``);
4. one target pass scores every request's pending token and its draft tokens;
5. verify each request's draft against its own distributions and random generator, cut its cache back to the
   accepted prefix, and hand its new tokens to whoever waits for them;
6. retire finished and cancelled requests, freeing their slots.

Requests join and leave between steps. Exactness does not depend on the batch: each request's tokens are
verified against the target's distributions at its own positions, with its own generator.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Protocol

import torch

from exactspec.backends.base import Pool, Row, Slot, TreePool, declares, forward_apart, require
from exactspec.backends.lockstep import LockstepPool
from exactspec.costs import Acceptance
from exactspec.errors import UsageError
from exactspec.policy import fitted_depth, make_policy, tree_widths
from exactspec.proposers.base import EMPTY_DRAFT, Draft, FeatureProposer, PlansRounds, Proposer, SharesPlan
from exactspec.proposers.none import NoProposer
from exactspec.rounds import Sequence, StopCondition, path_rows, row_parents
from exactspec.sampling import LogitsAdjustment, SamplingParams
from exactspec.server.metrics import Metrics
from exactspec.server.prefixes import PrefixCache
from exactspec.server.speculation import SpeculationPlanner
from exactspec.step import make_generator

if TYPE_CHECKING:
    from exactspec.grammars import Grammar

log = logging.getLogger("exactspec.server")
PREFILL_TOKENS_PER_PASS = 4096  # prompts prefilled together, up to this many tokens in one pass


class QueueFull(RuntimeError):
    """The waiting queue is at its bound."""


class ShuttingDown(RuntimeError):
    """The scheduler takes no new requests."""


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: int | None = None
    stop_at_eos: bool = True
    adjustment: LogitsAdjustment | None = None  # logit_bias and penalties on the target's logits
    logprobs: int | None = None  # None: none; k: each token's log-probability and the k most likely
    speculation: str | None = None  # "auto", "always" or "never" (one the planner offers); None: the server's
    max_draft_tokens: int | None = None  # the most draft tokens per round, up to the server's; None: the server's
    stop: Callable[[], StopCondition] | None = None  # makes the request's stop condition (its stop strings)
    grammar: Callable[[], Grammar] | None = None  # makes the request's matcher (its structured output)


@dataclass(frozen=True)
class Tokens:
    """New tokens of one request from one step, and how each came ("accepted", "recovered", "bonus" or "plain")."""

    token_ids: list[int]
    kinds: list[str]
    draft_tokens: int  # draft tokens scored for this request in the step
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None  # per token: its own, the top ones
    source: str = ""  # the source of a combined drafter (hybrid) that drafted them; "" otherwise (Round.source)


@dataclass(frozen=True)
class Finished:
    """The request's last event. reason: "stop" (EOS or its stop condition), "length" (max_tokens), "abort"
    (shutdown), "cancelled" (its client left) or "error"."""

    reason: str
    message: str = ""
    status: int = 500  # for reason "error": 400 when the request's own input caused it


class NotOffered(ValueError):
    """A request asks for what this server does not offer; ``param`` names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class Handle:
    """A submitted request: its events (Tokens..., then one Finished) arrive in ``events``."""

    _ids = itertools.count()

    def __init__(self, request: GenerationRequest, mode: str) -> None:
        self.request = request
        self.mode = mode  # its speculation: the one it asked for, else the server's
        self.id = next(self._ids)
        self.events: queue.Queue[Tokens | Finished] = queue.Queue()
        self.cancelled = threading.Event()
        self.cached_tokens = 0  # prompt tokens the prefix cache restored for it, set at its prefill
        self._listener: Callable[[Tokens | Finished], None] | None = None
        self._lock = threading.Lock()

    def put(self, event: Tokens | Finished) -> None:
        """Hand an event to whoever waits: the queue, or the listener once one is set."""
        with self._lock:
            if self._listener is None:
                self.events.put(event)
            else:
                self._listener(event)

    def listen(self, listener: Callable[[Tokens | Finished], None]) -> None:
        """Hand every event, those queued so far first, to ``listener`` (called on the scheduler's thread; an
        asyncio server passes one that schedules onto its loop)."""
        with self._lock:
            while not self.events.empty():
                listener(self.events.get_nowait())
            self._listener = listener

    def cancel(self) -> None:
        """Stop generating for this request and free its slot (at the next step)."""
        self.cancelled.set()

    def collect(self, timeout: float = 60.0) -> tuple[list[int], Finished, int]:
        """Wait for the request to finish (each event within ``timeout`` seconds): its tokens, its last event, and
        the draft tokens scored for it. For callers on a thread of their own; the HTTP server listens instead."""
        tokens, drafted = [], 0
        while not isinstance(event := self.events.get(timeout=timeout), Finished):
            tokens += event.token_ids
            drafted += event.draft_tokens
        return tokens, event, drafted


class AnswerMemory(Protocol):
    """What a server learns from its finished requests (the shared suffix index of the retrieval drafter)."""

    def learn(self, context: list[int], prompt_length: int) -> None:
        """Take in a finished request: its prompt and answer (``context``), the prompt its first tokens."""
        ...

    def close(self) -> None:
        """The server is stopping: keep what was learned, where asked to."""
        ...


class _Running:
    """A request in the batch: its slot, its sequence (context, drafter, generator, what ends it: the round's,
    ``exactspec.rounds``), its measured acceptance and this step's draft."""

    def __init__(self, handle: Handle, slot: Slot, proposer: Proposer, device: torch.device,
                 eos_ids: frozenset[int], max_length: int) -> None:
        request = handle.request
        self.mode = handle.mode  # "auto", "always" or "never"
        self.handle = handle
        self.slot = slot
        self.speculates = True  # off for good once its drafter raised
        self.sequence = Sequence(
            request.prompt_ids, request.max_tokens, max_length, request.sampling,
            make_generator(request.seed, device), proposer, eos_ids, stop_at_eos=request.stop_at_eos,
            adjustment=request.adjustment, grammar=request.grammar() if request.grammar is not None else None,
            stop=request.stop() if request.stop is not None else None, logprobs=request.logprobs)
        self.acceptance = Acceptance()
        self.draft = EMPTY_DRAFT
        self.finished: Finished | None = None  # its last event, once it has one: it leaves at the step's end


class Scheduler:
    """Runs the step loop on its own thread; ``submit`` hands it requests from any thread.

    What its users (the HTTP server, the benchmarks) read of it is declared above the loop: what it serves
    (``drafter``, ``speculation``, ``speculation_modes``, ``max_draft_tokens``, ``max_length``, ``vocab_size``,
    ``eos_token_ids``), its state (``accepting``, ``running``, ``waiting``, ``stalled``) and its counters
    (``metrics``, written out at ``/metrics``); never its pool or planner."""

    def __init__(self, pool: Pool, new_proposer: Callable[[], Proposer], planner: SpeculationPlanner,
                 eos_token_ids: frozenset[int] | set[int], max_draft_tokens: int = 4, max_waiting: int = 256,
                 metrics: Metrics | None = None, drafter: str = "", memory: AnswerMemory | None = None,
                 prefixes: PrefixCache | None = None, tree: tuple[int, ...] | str | None = None,
                 draft_pool: LockstepPool | None = None) -> None:
        """``tree``: draft token trees, the candidates at each depth or "auto" (as ``--tree``), on a pool that
        declares :class:`TreePool`. ``draft_pool``: the pool over a draft model's weights in which the requests'
        drafters draft (a slot each), where they share one: their drafting runs in its lockstep."""
        if tree is not None:
            require(pool, TreePool, "--tree in the server", "it serves trees one request at a time")
        self.pool = pool
        self.tree = tree
        self.tree_policy = make_policy(max_draft_tokens, tree) if tree == "auto" else None
        self._round_seconds = (0.0, 0.0)  # the last step's drafting and pass: what the tree policy learns from
        self.prefixes = prefixes  # finished requests' prompts' keys and values, restored for prompts they open
        self.memory = memory  # learns every finished answer (the shared suffix index), kept at shutdown
        self.new_proposer = new_proposer
        self.draft_pool = draft_pool
        self.drafter = drafter  # the drafter's name, as served
        self.planner = planner
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_draft_tokens = max_draft_tokens
        self.max_waiting = max_waiting
        self.metrics = metrics or Metrics()
        self._waiting: deque[Handle] = deque()
        self._running: list[_Running] = []
        self._lock = threading.Condition()
        self._accepting = True
        self._stopped = False
        self._thread: threading.Thread | None = None
        self.last_progress = time.monotonic()  # when the loop last finished a step, or found nothing to do

    @property
    def max_length(self) -> int:
        """The most tokens a request may hold, prompt and output together."""
        return self.pool.max_length

    @property
    def vocab_size(self) -> int:
        """The width of the target's logits: a prompt's token ids, and what a grammar masks, are under it."""
        return self.pool.vocab_size

    @property
    def speculation(self) -> str:
        """The server's speculation mode ("auto", "always" or "never"): a request that names none runs it."""
        return self.planner.mode

    @property
    def speculation_modes(self) -> tuple[str, ...]:
        """The speculation modes a request may ask for here."""
        return self.planner.modes

    # --- the public side, called from any thread -----------------------------------------------------------------

    def submit(self, request: GenerationRequest) -> Handle:
        if not request.prompt_ids:
            raise ValueError("the prompt has no tokens")
        self.check_speculation(request.speculation, request.max_draft_tokens)
        if len(request.prompt_ids) + request.max_tokens > self.max_length:
            raise ValueError(f"prompt ({len(request.prompt_ids)}) + max_tokens ({request.max_tokens}) exceeds the "
                             f"context of {self.max_length} tokens")
        handle = Handle(request, request.speculation or self.planner.mode)
        with self._lock:
            if not self._accepting:
                raise ShuttingDown("the server is shutting down")
            if len(self._waiting) >= self.max_waiting:
                self._drop_cancelled()
            if len(self._waiting) >= self.max_waiting:
                raise QueueFull(f"the server is at capacity: {self.max_waiting} requests are already waiting; "
                                "retry later")
            self._waiting.append(handle)
            self._lock.notify()
        return handle

    def check_speculation(self, mode: str | None, max_draft_tokens: int | None) -> None:
        """Refuse (ValueError, naming what is offered) a request's speculation mode or draft length that this
        server does not offer: ``never`` always; ``always`` where it drafts; ``auto`` where it measured its pass
        costs (it runs ``--speculation auto``); up to its own most draft tokens per round."""
        if mode is not None and mode not in self.planner.modes:
            raise NotOffered("speculation", f"speculation {mode!r} is not offered by this server (it runs "
                             f"--speculation {self.planner.mode}): ask for {' or '.join(self.planner.modes)}")
        if max_draft_tokens is not None and max_draft_tokens > self.max_draft_tokens:
            raise NotOffered("num_draft_tokens", f"num_draft_tokens is {max_draft_tokens}; this server drafts at most "
                             f"{self.max_draft_tokens} per round")

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="exactspec-scheduler", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float) -> None:
        """Take no new requests; let those in flight finish for up to ``timeout`` seconds, then end the rest with
        finish reason "abort"; stop the loop."""
        with self._lock:
            self._accepting = False
            self._lock.notify()
        deadline = time.monotonic() + timeout
        while self.busy and time.monotonic() < deadline:
            time.sleep(0.02)
        with self._lock:
            self._stopped = True
            self._lock.notify()
        if self._thread is not None:
            self._thread.join()
        for handle in self._waiting:
            handle.put(Finished("abort", "the server shut down"))
        self._waiting.clear()
        for running in self._running:
            self._retire(running, Finished("abort"))
        self._running.clear()
        if self.memory is not None:
            self.memory.close()
        if self.draft_pool is not None:
            self.draft_pool.stop()

    @property
    def busy(self) -> bool:
        return bool(self._waiting or self._running)

    @property
    def running(self) -> int:
        """Requests in the batch."""
        return len(self._running)

    @property
    def waiting(self) -> int:
        """Requests queued for a slot."""
        return len(self._waiting)

    @property
    def accepting(self) -> bool:
        return self._accepting

    def stalled(self, after: float) -> str | None:
        """Why the loop is not serving, or None: its thread has died, or work has waited ``after`` seconds
        without a step finishing."""
        if self._thread is not None and not self._thread.is_alive() and not self._stopped:
            return "the scheduler's thread has died"
        if self.busy and time.monotonic() - self.last_progress > after:
            return f"no step has finished for {time.monotonic() - self.last_progress:.0f} s while requests wait"
        return None

    # --- the loop --------------------------------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._stopped and not self._waiting and not self._running:
                    self.last_progress = time.monotonic()
                    self._lock.wait()
                if self._stopped:
                    return
            try:
                self._admit()
                if self._running:
                    self.step()
            except Exception as error:  # a bug outside any one request's share: end the batch, keep serving
                log.exception("step failed")
                for running in self._running:
                    self._retire(running, Finished("error", f"internal error: {error}"))
                self._running.clear()
            self.last_progress = time.monotonic()

    def _admit(self) -> None:
        """Move waiting requests into free slots and prefill their prompts together."""
        admitted: list[_Running] = []
        with self._lock:
            while self._waiting and len(self._running) + len(admitted) < self.pool.max_slots:
                handle = self._waiting.popleft()
                if handle.cancelled.is_set():
                    self._end_waiting(handle)
                    continue
                running = self._start(handle)
                if running is not None:
                    admitted.append(running)
        self._running += admitted  # before the prefill: should it fail, the loop's handler ends them too
        batch: list[_Running] = []
        for running in admitted:
            tokens = sum(len(r.sequence.context) for r in batch) + len(running.sequence.context)
            if batch and tokens > PREFILL_TOKENS_PER_PASS:
                self._prefill(batch)
                batch = []
            batch.append(running)
        if batch:
            self._prefill(batch)
        self._retire_ended(admitted)  # a prefill that failed for it alone, or a client that left meanwhile

    def _start(self, handle: Handle) -> _Running | None:
        """The request in a slot of its own; None (the request ended with its error) if it cannot start."""
        slot = None
        try:
            slot = self.pool.open()
            return _Running(handle, slot, self._proposer(handle), self.pool.device, self.eos_token_ids,
                            self.max_length)
        except Exception as error:
            if slot is not None:
                self.pool.close(slot)
            self._end(handle, self._failure(handle, error))
            return None

    @staticmethod
    def _failure(handle: Handle, error: Exception) -> Finished:
        """A request's own error as its last event: 400 if its input caused it (a check refused it), else 500."""
        client_fault = isinstance(error, (ValueError, UsageError))
        if not client_fault:
            log.error("request %d failed", handle.id, exc_info=error)
        return Finished("error", str(error) if client_fault else f"internal error: {error}",
                        400 if client_fault else 500)

    def _end(self, handle: Handle, event: Finished) -> None:
        handle.put(event)
        self.metrics.observe_finish(event.reason, handle.mode)

    def _proposer(self, handle: Handle) -> Proposer:
        """The request's own drafter; one that cannot be made leaves the request to plain decoding."""
        try:
            return self.new_proposer()
        except Exception as error:
            log.warning("request %d: no drafter (%r); decoding it plainly", handle.id, error)
            self.metrics.observe_drafter_error()
            return NoProposer()

    def _drop_cancelled(self) -> None:
        """Forget waiting requests whose clients have gone (under the lock)."""
        for handle in [h for h in self._waiting if h.cancelled.is_set()]:
            self._waiting.remove(handle)
            self._end_waiting(handle)

    def _end_waiting(self, handle: Handle) -> None:
        self._end(handle, Finished("cancelled"))

    def _prefill(self, batch: list[_Running]) -> None:
        """Cache every context token but the last, which the first step scores: those a kept prompt opens with
        restored from the prefix cache, the rest in one pass."""
        started = time.perf_counter()
        if self.prefixes is not None:
            for r in batch:
                r.handle.cached_tokens = self.prefixes.restore(r.slot, r.sequence.context)
        owners = [r for r in batch if len(r.sequence.context) - 1 > r.slot.length]
        if owners:
            self._forward([Row(r.slot, r.sequence.context[r.slot.length:-1], 0, r.slot.length) for r in owners], owners)
        self.metrics.observe_prefill(sum(len(r.sequence.context) for r in batch), time.perf_counter() - started,
                                     sum(r.handle.cached_tokens for r in batch))

    def _forward(self, rows: list[Row], owners: list[_Running]) -> list[torch.Tensor | None]:
        """One pass over every row (row i is owners[i]'s); should it fail, each row again alone, so that a row
        that fails finishes its own request only (its logits None), and the others go on."""
        results = forward_apart(self.pool, rows, lambda error: log.warning(
            "a pass over %d requests failed (%r); running each alone", len(rows), error))
        logits: list[torch.Tensor | None] = []
        for result, owner in zip(results, owners):
            if isinstance(result, Exception):
                owner.finished = self._failure(owner.handle, result)
                result = None
            logits.append(result)
        return logits

    def step(self) -> None:
        step_started = time.perf_counter()
        running = self._running
        # 1. draft, for requests that still speculate
        self._draft(running)
        # 2. the planner chooses how many of each draft's tokens to score
        prior = self.planner.prior()
        rates = [r.acceptance.rate(prior) for r in running]
        lengths = self.planner.draft_lengths([r.draft.proposed for r in running], rates, [r.mode for r in running])
        drafts = [_scored(r.draft, n) for r, n in zip(running, lengths)]
        # 3. one target pass over every request's pending token and draft tokens
        rows = [_row(r.slot, r.sequence.context[-1], d) for r, d in zip(running, drafts)]
        started = time.perf_counter()
        logits = self._forward(rows, running)  # per request [k+1, vocab]; None for one whose pass failed
        passed = time.perf_counter()
        positions = sum(len(row.token_ids) for row in rows)
        self.planner.observe_pass(positions, passed - started)
        for planner in _round_planners(running):  # a drafter that plans its own rounds learns what the pass cost
            planner.observe_pass(positions, passed - started)
        self._round_seconds = (started - step_started, passed - started)  # drafting, the pass: the tree policy's
        # 4. verify, roll back, emit
        for r, draft, row_logits in zip(running, drafts, logits):
            if row_logits is None:
                continue
            try:
                self._advance(r, draft, row_logits)
            except Exception as error:
                r.finished = self._failure(r.handle, error)
        self.metrics.observe_step(len(running), any(lengths), time.perf_counter() - step_started)
        # 5. retire
        self._retire_ended(running)

    def _draft(self, running: list[_Running]) -> None:
        drafted, started = 0, time.perf_counter()
        for r, outcome in zip(running, self._drafts(running)):  # a grammar's forced tokens are drafted in any mode
            r.draft = EMPTY_DRAFT
            if isinstance(outcome, Exception):
                log.warning("request %d: drafter %s raised %r; decoding it plainly from here",
                            r.handle.id, r.sequence.proposer.name, outcome)
                self.metrics.observe_drafter_error()
                r.speculates = False
                continue
            r.draft = outcome
            drafted += len(r.draft)
        self.planner.observe_drafting(drafted, time.perf_counter() - started)

    def _drafts(self, running: list[_Running]) -> list[Draft | Exception]:
        """Each request's draft, or the error its drafter raised. Where two or more requests may draft with the
        shared draft model, they draft in lockstep (``draft_pool.run``: one pass over all their rows at each draft
        position); the rest, and every request where there is no such model, one after another on this thread."""
        together = [r for r in running if r.speculates and r.mode != "never"] if self.draft_pool is not None else []
        if len(together) < 2:  # a request alone has nobody to share a pass with: it drafts on this thread
            together = []
        drafts = self.draft_pool.run([partial(self._drafted, r) for r in together]) if together else []
        by_request = dict(zip(map(id, together), drafts))
        return [by_request[id(r)] if id(r) in by_request else _attempt(partial(self._drafted, r)) for r in running]

    def _drafted(self, r: _Running) -> Draft:
        """The request's draft: as deep as it and the server allow (the tree policy's depth, under ``--tree
        auto``), its tree's shape where the server drafts trees, the target's features where its drafter reads
        them."""
        sequence = r.sequence
        most = r.handle.request.max_draft_tokens or self.max_draft_tokens
        if self.tree_policy is not None:
            most = self.tree_policy.next_k(most)
        k = fitted_depth(self.tree, min(most, sequence.room), sequence.room, self.tree_policy) \
            if r.mode != "never" and r.speculates else 0
        sequence.catch_up(k)
        features = self.pool.features(r.slot) if k and declares(sequence.proposer, FeatureProposer) else None
        return sequence.draft(k, tree_widths(self.tree, k, self.tree_policy), features)

    def _advance(self, r: _Running, draft: Draft, logits: torch.Tensor) -> None:
        """The request's round on its rows of the pass: verify, cut its slot to the accepted tokens, emit."""
        sequence = r.sequence
        logits = sequence.adjusted(draft, logits)
        verdict = sequence.verify(draft, logits)
        cached = len(sequence.context) - 1  # the context, less its last token, was cached before the pass
        if draft.parents is None:
            r.slot.length = cached + 1 + verdict.accepted
        else:  # the tree's accepted branch moved into place
            self.pool.keep_path(r.slot, cached, path_rows(verdict))
        if self.tree_policy is not None:
            self.tree_policy.observe(verdict, *self._round_seconds)
        self._learn_acceptance(r, draft, verdict)
        round_ = sequence.emit(draft, verdict, logits, len(draft))
        self.metrics.observe_round(round_, r.mode)
        r.handle.put(Tokens(round_.tokens, round_.kinds, round_.draft_tokens, round_.logprobs, round_.source))
        if sequence.finished is not None:
            r.finished = Finished(sequence.finished)

    def _learn_acceptance(self, r: _Running, scored: Draft, verdict) -> None:
        """Count accepted draft tokens over those reached. A draft offered but not scored teaches too: its first
        token would have been accepted with the probability that the target's own token equals it (exactly so
        for a point-mass draft), so a request that decodes plainly keeps measuring what speculation would gain."""
        proposed, accepted, reached = verdict.proposed  # a grammar's forced tokens are not the drafter's
        if not proposed:
            if not r.draft.proposed:
                return
            accepted, reached = int(verdict.token == r.draft.tokens[scored.forced]), 1
        r.acceptance.observe(accepted, reached)
        self.planner.observe_verdict(accepted, reached)

    def _retire_ended(self, candidates: list[_Running]) -> None:
        """Retire, out of ``candidates``, the requests that have finished or whose client has cancelled."""
        for r in [r for r in candidates if r.finished or r.handle.cancelled.is_set()]:
            self._retire(r, r.finished or Finished("cancelled"))
            self._running.remove(r)

    def _retire(self, r: _Running, event: Finished) -> None:
        """Keep a finished request's prompt in the prefix cache, free its slot, hand over its last event, and let
        the memory learn its answer."""
        finished = event.reason in ("stop", "length")
        if r.slot.index >= 0:
            if finished and self.prefixes is not None:
                self._keep_prompt(r)
            self.pool.close(r.slot)
        try:
            r.sequence.proposer.clear_cache()  # a draft model's slot goes back to its pool
        except Exception as error:
            log.warning("request %d: its drafter did not let go (%r)", r.handle.id, error)
        self._end(r.handle, event)
        if r.sequence.grammar is not None:
            self.metrics.observe_constrained(r.sequence.grammar.forced_tokens)
        if self.memory is not None and finished:
            try:
                self.memory.learn(r.sequence.context, len(r.handle.request.prompt_ids))
            except Exception as error:  # learning is a help to later drafts, never a fault of this request
                log.warning("request %d: its answer was not learned (%r)", r.handle.id, error)

    def _keep_prompt(self, r: _Running) -> None:
        try:
            self.prefixes.keep(r.slot, r.handle.request.prompt_ids)
        except Exception as error:  # a help to later prompts, never a fault of this request
            log.warning("request %d: its prompt was not kept (%r)", r.handle.id, error)


def _attempt(task: Callable[[], Draft]) -> Draft | Exception:
    """The task's result, or the exception it raised."""
    try:
        return task()
    except Exception as error:
        return error


def _round_planners(running: list[_Running]) -> list[Proposer]:
    """The requests' drafters that plan their own rounds (``PlansRounds``: the hybrid), one per cost model where
    several share one (``SharesPlan``), so that a shared plan counts each pass once."""
    planners: dict[int, Proposer] = {}
    for r in running:
        proposer = r.sequence.proposer
        if declares(proposer, PlansRounds):
            planners.setdefault(id(proposer.plan) if declares(proposer, SharesPlan) else id(proposer), proposer)
    return list(planners.values())


def _scored(draft: Draft, n: int) -> Draft:
    """What of a draft the pass scores, where the planner chose n of its drafter's tokens: a chain's forced tokens
    and its first n; a tree whole, or nothing."""
    if draft.parents is not None:
        return draft if n else EMPTY_DRAFT
    return draft.first(draft.forced + n)


def _row(slot: Slot, pending: int, draft: Draft) -> Row:
    """A request's share of the pass: its pending token and its draft (a tree with its parents)."""
    if draft.parents is None:
        return Row(slot, [pending] + draft.tokens, len(draft) + 1)
    return Row(slot, [pending] + draft.tokens, len(draft) + 1, parents=row_parents(draft))
