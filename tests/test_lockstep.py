"""Requests drafting with one draft model in batched passes (issue 51: the shipped model "shared by the server's
requests in one batched draft pass"): :class:`LockstepPool` alone, over a pool whose logits are a function of each
slot's tokens (so any correct batching returns them bit for bit), and in the server on the tiny random models of
test_server.py: the tokens of ``--drafter none``, fewer passes over the draft model than draft tokens, the drafts
of each request alone, and a fault in one request's drafting that ends that request's speculation only."""

from __future__ import annotations

import threading

import pytest
import torch
from test_hybrid_server import EOS, PROMPTS, served, settings
from test_server import tiny  # noqa: F401  (the model fixture)
from tiny import perturbed_copy

from exactspec.backends import LeanRuntime
from exactspec.backends.base import Pool, PooledSequence, Row, Slot
from exactspec.backends.fused import FusedRuntime
from exactspec.backends.lockstep import LockstepPool
from exactspec.choices import DEFAULT_DRAFTER
from exactspec.server import build_scheduler
from exactspec.server.scheduler import GenerationRequest

VOCAB = 16
POISON = 13  # a token whose rows the recording pool refuses to run


class RecordingPool(Pool):
    """Slots whose logits at a position are drawn from a generator seeded by the slot's tokens up to there; it
    records the rows of every pass, and refuses any pass with a row holding ``POISON``."""

    device = torch.device("cpu")
    vocab_size = VOCAB
    max_slots = 8
    max_length = 64

    def __init__(self) -> None:
        self.slots: list[Slot] = []
        self.passes: list[list[list[int]]] = []  # per pass, its rows' tokens
        self._held: dict[int, list[int]] = {}

    def open(self) -> Slot:
        slot = Slot(index=len(self.slots))
        self.slots.append(slot)
        return slot

    def close(self, slot: Slot) -> None:
        self.slots.remove(slot)

    def forward(self, rows: list[Row]) -> list[torch.Tensor]:
        self.passes.append([row.token_ids for row in rows])
        if any(POISON in row.token_ids for row in rows):
            raise RuntimeError("poisoned row")
        logits = []
        for row in rows:
            held = self._held.get(id(row.slot), [])[: row.slot.length] + row.token_ids
            self._held[id(row.slot)] = held
            row.slot.length = len(held)
            logits.append(torch.stack([_logits(held[:n]) for n in range(len(held) - row.num_logits + 1,
                                                                        len(held) + 1)]))
        return logits


def _logits(tokens: list[int]) -> torch.Tensor:  # [VOCAB]
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(hash(tuple(tokens)) % 2**31))


class Runtime:
    """What a ``PooledSequence`` reads of its runtime."""

    name = "recording"
    weight_bytes = 0
    precision_label = runtime_label = "float32"
    pass_invariant = True


def greedy(sequence: PooledSequence, prompt: list[int], steps: int) -> list[int]:
    """``steps`` tokens written greedily after ``prompt``, one pass each: a draft model's chain."""
    tokens, logits = [], sequence.extend(prompt, 1)[0]
    for _ in range(steps):
        tokens.append(int(logits.argmax()))
        logits = sequence.extend(tokens[-1:], 1)[0]
    return tokens


def run_within(pool: LockstepPool, tasks, seconds: float = 10.0) -> list:
    """``pool.run(tasks)`` on a thread of its own, failing the test should it not return in ``seconds``."""
    outcome = []
    thread = threading.Thread(target=lambda: outcome.append(pool.run(tasks)), daemon=True)
    thread.start()
    thread.join(seconds)
    assert outcome, "the lockstep did not return"
    return outcome[0]


PROMPT_STEPS = [([3, 4, 5], 4), ([7, 2], 1), ([9, 9, 1, 0], 3)]


def alone() -> list[list[int]]:
    """Each chain of PROMPT_STEPS written by a sequence alone in its pool."""
    return [greedy(PooledSequence(RecordingPool(), Runtime()), prompt, steps) for prompt, steps in PROMPT_STEPS]


def test_sequences_in_lockstep_share_one_pass_per_step_and_write_what_each_writes_alone():
    recording = RecordingPool()
    pool = LockstepPool(recording)
    sequences = [PooledSequence(pool, Runtime()) for _ in PROMPT_STEPS]
    chains = run_within(pool, [lambda s=s, p=p, n=n: greedy(s, p, n) for s, (p, n) in zip(sequences, PROMPT_STEPS)])
    assert chains == alone()
    # the prompts in one pass, then one pass per step over the chains still going (5, 2 and 4 passes in all)
    assert [len(rows) for rows in recording.passes] == [3, 3, 2, 2, 1]
    assert recording.passes[0] == [prompt for prompt, _ in PROMPT_STEPS]


def test_turns_run_one_at_a_time_in_the_order_given_and_workers_persist():
    """Between two passes each turn runs alone, in the tasks' order; the worker threads are kept from one run to
    the next (one per task at most), and end when stopped."""
    pool = LockstepPool(RecordingPool())
    events: list[tuple[str, int]] = []
    running = []

    def task(name: str, steps: int):
        sequence = PooledSequence(pool, Runtime())
        for step in range(steps):
            running.append(name)
            assert running == [name]  # nobody else runs meanwhile
            events.append((name, step))
            running.pop()
            sequence.extend([step + 1], 1)
        return name

    def workers() -> set[threading.Thread]:
        return {thread for thread in threading.enumerate() if thread.name == "exactspec-drafting"}

    before = workers()
    for _ in range(3):
        events.clear()
        assert run_within(pool, [lambda: task("a", 2), lambda: task("b", 3), lambda: task("c", 1)]) == ["a", "b", "c"]
        assert events == [("a", 0), ("b", 0), ("c", 0), ("a", 1), ("b", 1), ("b", 2)]
    mine = workers() - before
    assert len(mine) == 3
    pool.stop()
    for thread in mine:
        thread.join(5)
    assert not any(thread.is_alive() for thread in mine)


def test_a_turn_that_raises_leaves_and_the_others_go_on():
    recording = RecordingPool()
    pool = LockstepPool(recording)

    def faulty():
        sequence = PooledSequence(pool, Runtime())
        sequence.extend([1, 2], 1)
        raise ValueError("drafter exploded")

    sequences = [PooledSequence(pool, Runtime()) for _ in PROMPT_STEPS]
    tasks = [lambda s=s, p=p, n=n: greedy(s, p, n) for s, (p, n) in zip(sequences, PROMPT_STEPS)]
    outcomes = run_within(pool, [tasks[0], faulty, tasks[1], tasks[2]])
    assert isinstance(outcomes[1], ValueError) and str(outcomes[1]) == "drafter exploded"
    assert outcomes[:1] + outcomes[2:] == alone()
    assert len(recording.passes[0]) == 4 and len(recording.passes[1]) == 3  # it left after its first pass


def test_a_pass_that_fails_for_one_turns_rows_fails_that_turn_only():
    """A pass with a poisoned row runs each row again alone: the poisoned turn's pass raises in it (it may catch
    the error and go on), the others get their logits, and later passes batch again."""
    recording = RecordingPool()
    pool = LockstepPool(recording)
    caught = []

    def poisoned():
        sequence = PooledSequence(pool, Runtime())
        try:
            sequence.extend([POISON], 1)
        except RuntimeError as error:
            caught.append(error)
        return greedy(sequence, [2], 2)

    sequences = [PooledSequence(pool, Runtime()) for _ in PROMPT_STEPS]
    tasks = [lambda s=s, p=p, n=n: greedy(s, p, n) for s, (p, n) in zip(sequences, PROMPT_STEPS)]
    outcomes = run_within(pool, [tasks[0], poisoned, tasks[1], tasks[2]])
    assert len(caught) == 1 and str(caught[0]) == "poisoned row"
    assert outcomes[:1] + outcomes[2:] == alone()
    assert outcomes[1] == greedy(PooledSequence(RecordingPool(), Runtime()), [2], 2)
    assert [len(rows) for rows in recording.passes[:6]] == [4, 1, 1, 1, 1, 4]  # the pass, each row alone, together


def test_a_pass_outside_a_turn_runs_at_once():
    recording = RecordingPool()
    sequence = PooledSequence(LockstepPool(recording), Runtime())
    assert greedy(sequence, [3, 4, 5], 4) == alone()[0]
    assert [len(rows) for rows in recording.passes] == [1] * 5


def test_a_sequence_asked_to_append_nothing_makes_no_pass():
    """As a runtime's own cache: a drafter catching up to what its sequence holds gets no logits, and no pass (a
    pool refuses a row without tokens)."""
    recording = RecordingPool()
    sequence = PooledSequence(recording, Runtime())
    assert sequence.extend([], 0).shape == (0, VOCAB)
    sequence.extend([3, 4], 1)
    assert sequence.extend([], 0).shape == (0, VOCAB)
    assert recording.passes == [[[3, 4]]] and sequence.tokens == [3, 4]


# --- in the server -----------------------------------------------------------------------------------------------

def counting(scheduler) -> list[int]:
    """The rows of every pass over the scheduler's draft model, from now on."""
    rows, beneath = [], scheduler.draft_pool.pool
    forward = beneath.forward

    def counted(batch):
        rows.append(len(batch))
        return forward(batch)
    beneath.forward = counted
    return rows


@pytest.mark.parametrize("drafter", ["draft-model", DEFAULT_DRAFTER])
def test_requests_draft_with_the_draft_model_in_batched_passes_and_serve_the_tokens_of_no_drafter(tiny, drafter):
    """Four greedy requests at once, drafting with one tiny draft model (the draft-model drafter every round; the
    hybrid where its plan chooses it): token for token what ``--drafter none`` serves; under the draft-model drafter
    fewer passes over the draft model than draft tokens, several rows in a pass."""
    runtime = LeanRuntime(tiny[0])
    draft = LeanRuntime(perturbed_copy(tiny[0], noise=0.05, seed=1).double())
    plain, _, _ = served(runtime, settings("none", speculation="never"), PROMPTS, max_tokens=24)
    passes: list[list[int]] = []
    answers, scheduler, _ = served(runtime, settings(drafter), PROMPTS, draft=draft, max_tokens=24,
                                   prepare=lambda scheduler: passes.append(counting(scheduler)))
    assert answers == plain
    assert scheduler.metrics.drafter_errors == 0
    rows = passes[0]
    if drafter == "draft-model":
        assert max(rows) >= 3 and len(rows) < scheduler.metrics.draft_tokens <= sum(rows)


def test_each_request_drafts_in_the_batch_as_it_drafts_alone(tiny):
    """On a draft pool whose rows are pass-invariant (the fused runtime's), each request's rounds (what each token
    was: accepted, recovered, bonus) are the same served beside the others as served alone: the same drafts."""
    runtime = LeanRuntime(tiny[0])
    draft = FusedRuntime(perturbed_copy(tiny[0], noise=0.05, seed=1).float())
    assert draft.pass_invariant

    def rounds(prompts):
        scheduler = build_scheduler(runtime, settings("draft-model"), {EOS}, draft=draft)
        scheduler.start()
        try:
            handles = [scheduler.submit(GenerationRequest(prompt, max_tokens=24, stop_at_eos=False))
                       for prompt in prompts]
            return [[event.kinds for event in _events(handle)] for handle in handles]
        finally:
            scheduler.shutdown(timeout=5)

    together = rounds(PROMPTS)
    assert together == [rounds([prompt])[0] for prompt in PROMPTS]
    assert any("accepted" in kinds for request in together for kinds in request)


def _events(handle) -> list:
    """A request's Tokens events, each within 30 s, up to its last."""
    events = []
    while not hasattr(event := handle.events.get(timeout=30), "reason"):
        events.append(event)
    assert event.reason == "length"
    return events


@pytest.mark.parametrize("fault", ["drafter", "pass"])
def test_a_fault_in_one_requests_drafting_ends_its_speculation_only(tiny, fault):
    """One request's drafting fails (its draft model raises on its third pass; or the draft model's pass fails on its
    rows, which hold a poisoned token): that request decodes plainly from there, every request gets the tokens of
    ``--drafter none``, nothing hangs, and the others go on drafting in batched passes."""
    runtime = LeanRuntime(tiny[0])
    draft = LeanRuntime(perturbed_copy(tiny[0], noise=0.05, seed=1).double())
    prompts = PROMPTS if fault == "drafter" else PROMPTS[:1] + [[4, 57, 3, 57]] + PROMPTS[2:]
    plain, _, _ = served(runtime, settings("none", speculation="never"), prompts, max_tokens=24)
    passes: list[list[int]] = []
    faults: list[int] = []  # the passes made before each fault

    def prepare(scheduler):
        passes.append(counting(scheduler))
        if fault == "pass":
            beneath = scheduler.draft_pool.pool
            forward = beneath.forward

            def poisoned(rows):
                if any(57 in row.token_ids for row in rows):
                    faults.append(len(passes[0]))
                    raise RuntimeError("injected fault")
                return forward(rows)
            beneath.forward = poisoned
            return
        make, made = scheduler.new_proposer, []

        def second_raises():
            proposer = make()
            made.append(proposer)
            if len(made) == 2:
                model, calls = proposer.model, []
                extend = model.extend

                def failing(token_ids, num_logits):
                    calls.append(1)
                    if len(calls) == 3:
                        faults.append(len(passes[0]))
                        raise RuntimeError("injected fault")
                    return extend(token_ids, num_logits)
                model.extend = failing
            return proposer
        scheduler.new_proposer = second_raises

    answers, scheduler, _ = served(runtime, settings("draft-model"), prompts, draft=draft, max_tokens=24,
                                   prepare=prepare)
    assert answers == plain
    assert scheduler.metrics.drafter_errors == 1
    assert max(passes[0][faults[-1]:]) >= 3  # the other three still drafted together after it
