"""Sequences that extend one pool side by side, each from code of its own, their passes gathered into one: what lets a
server's requests draft with one draft model in batched passes.

A server's requests each draft with a sequence in a slot of one pool over the draft model's weights
(``PooledSequence``). Drafting k tokens is k passes, each waiting on the token before, deep inside each drafter's
own code; run request after request, B requests cost B x k passes of one row, each reading every weight.
:meth:`LockstepPool.run` runs each request's drafting as a *turn* on a worker thread of its own: a turn runs until
it asks the pool for a pass or finishes, then the next turn runs; once every turn has, the rows asked for run in
one pass (on the thread that called ``run``), each turn gets its own rows' logits, and the turns still drafting run
on, in the same order. So B requests drafting k tokens cost k passes of B rows.

Only one turn runs at any time, always in the order the tasks were given, and the threads hand over by semaphores
(no spinning: the cores are the passes'). Drafters that share state (the hybrid's cost model) therefore share it as
code on one thread does, and choose the same on every run. A row's logits are those of a pass over it alone where
the pool's rows are pass-invariant (the fused runtime's); elsewhere a draft may differ at a near-tie, never a greedy
token or one of the invariant sampler's (the target decides those).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import TypeVar

import torch

from exactspec.backends.base import Pool, Row, Slot, forward_apart

T = TypeVar("T")


class LockstepPool(Pool):
    """A pool whose passes, asked from the turns of :meth:`run`, run together: one pass over every waiting turn's
    rows. Asked from anywhere else (one request drafting alone, the library), a pass runs at once, as the pool
    beneath runs it."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.device = pool.device
        self.vocab_size = pool.vocab_size
        self.max_slots = pool.max_slots
        self.max_length = pool.max_length
        self._workers: list[_Worker] = []
        self._local = threading.local()  # .turn: the turn a worker thread runs, while it runs one

    @property
    def slots(self) -> list[Slot]:
        return self.pool.slots

    def open(self) -> Slot:
        return self.pool.open()

    def close(self, slot: Slot) -> None:
        self.pool.close(slot)

    def forward(self, rows: list[Row]) -> list[torch.Tensor]:  # per row [num_logits, vocab]
        """The rows' pass: within a turn, together with the other turns' (the turn waits for it); else at once."""
        turn: _Turn | None = getattr(self._local, "turn", None)
        if turn is None:
            return self.pool.forward(rows)
        return turn.ask(rows)

    def run(self, tasks: list[Callable[[], T]]) -> list[T | Exception]:
        """Each task's result, or the exception it raised: the tasks run in turns on worker threads, their passes over
        the pool gathered. A turn that raises leaves the others to go on; a pass that fails for its rows together
        runs each turn's rows again alone (``forward_apart``), so that only a turn whose own rows fail gets the
        error, raised where it asked for them."""
        turns = [_Turn(task) for task in tasks]
        while len(self._workers) < len(turns):
            self._workers.append(_Worker())
        for worker, turn in zip(self._workers, turns):
            worker.jobs.put(lambda turn=turn: self._play(turn))
        waiting = turns
        try:
            while waiting:
                for turn in waiting:
                    turn.resume()
                waiting = [turn for turn in waiting if not turn.finished]
                if waiting:
                    self._pass(waiting)
        finally:
            _abandon(waiting)  # only where this thread itself failed: every turn still waiting ends
        for turn in turns:
            if not isinstance(turn.outcome, Exception) and isinstance(turn.outcome, BaseException):
                raise turn.outcome  # SystemExit and the like: not one task's fault
        return [turn.outcome for turn in turns]

    def stop(self) -> None:
        """Let the worker threads end (a later :meth:`run` starts new ones)."""
        for worker in self._workers:
            worker.jobs.put(None)
        self._workers = []

    def _play(self, turn: _Turn) -> None:
        self._local.turn = turn
        try:
            turn.play()
        finally:
            self._local.turn = None

    def _pass(self, turns: list[_Turn]) -> None:
        """One pass over the rows every turn in ``turns`` asked for; each turn's answer: its logits, or its rows'
        first error."""
        rows = [row for turn in turns for row in turn.rows]
        results = iter(forward_apart(self.pool, rows))
        for turn in turns:
            mine = [next(results) for _ in turn.rows]
            turn.answer = next((result for result in mine if isinstance(result, Exception)), mine)


class _Turn:
    """One task, run on a worker thread in turns with others: :meth:`resume` (the conductor's thread) runs it until
    it asks for a pass (:meth:`ask`, on its own thread) or finishes."""

    def __init__(self, task: Callable[[], object]) -> None:
        self.task = task
        self.rows: list[Row] = []  # the rows it waits for, while it waits
        self.answer: list[torch.Tensor] | Exception = []  # their logits, or the error of their pass
        self.outcome: object = None  # the task's result or exception, once finished
        self.finished = False
        self._go = threading.Semaphore(0)  # released: the turn may run
        self._paused = threading.Semaphore(0)  # released: the turn asked for a pass or finished

    def resume(self) -> None:
        self._go.release()
        self._paused.acquire()

    def play(self) -> None:
        self._go.acquire()
        try:
            self.outcome = self.task()
        except BaseException as error:
            self.outcome = error
        finally:
            self.finished = True
            self._paused.release()

    def ask(self, rows: list[Row]) -> list[torch.Tensor]:
        self.rows = rows
        self._paused.release()
        self._go.acquire()
        answer, self.answer, self.rows = self.answer, [], []
        if isinstance(answer, Exception):
            raise answer
        return answer


def _abandon(turns: list[_Turn]) -> None:
    """End turns left waiting for a pass that will not run: each is answered with an error until it finishes."""
    for turn in turns:
        while not turn.finished:
            turn.answer = RuntimeError("the drafting batch stopped before this pass")
            turn.resume()


class _Worker:
    """A daemon thread that runs the jobs put to it, one after another, until it is put None."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="exactspec-drafting", daemon=True).start()

    def _serve(self) -> None:
        while (job := self.jobs.get()) is not None:
            job()
