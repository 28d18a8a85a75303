"""The one cost model the engine's policies (one sequence) and the server's planner (a batch) decide with: what a
target pass over n positions costs, how often draft tokens are accepted, and the expected tokens these give.

- ``Acceptance``: accepted draft tokens over those reached, decayed, shrunk towards a prior while observations are
  few. The engine keeps one per draft position (each position's prior the estimate before it); the server one per
  request (its prior the rate over all requests) and one over all requests.
- ``survival`` and ``expected_tokens_by_k``: the chance a chain's first j draft tokens are all accepted, and the
  expected tokens of a round drafting k: 1 + sum over j <= k of that chance.
- The pass-cost curve, learnt two ways for the two situations: ``PassCosts`` learns every size a single sequence's
  rounds score, online (the fastest of the last few passes per size; optimistic steps between sizes, so that a
  size gets tried; a line beyond them); ``MeasuredPassCosts`` is the server's curve over up to batch x (k+1)
  positions, measured at start-up (interpolated between points) and only rescaled by the passes it runs, whose
  sizes are too few to move points without bending the curve's shape.
- ``TrialBudget``: while plain decoding wins, what keeps drafting's evidence fresh: a trial round once the plain
  rounds since the last took long enough that the trial's cost beyond them is a small share of the time.
- ``SequenceLengths``: how many more tokens a sequence may be expected to emit, from how long the last few ran.
- ``SourcePlan``: the same model over a combined drafter's sources (the hybrid's): per source, acceptance per
  draft position and drafting seconds per token; each round, the source and length that pay most, or none.
"""

from __future__ import annotations

import bisect
import math
import time
from collections import deque

from exactspec.backends.base import Pool, Row

AUTO_MAX_K = 16  # the longest draft the cost-model policies consider
BACKLOG = 32  # tokens: a model source's catching up on fewer is a cost of its rounds, on more a backlog
PRIOR_STRENGTH = 4.0  # draft tokens' worth of weight a prior has in an Acceptance's rate, by default
COST_LEARNING_RATE = 0.1  # how fast MeasuredPassCosts' scale follows the passes run
RECENT_PASSES = 8  # a pass size's cost is the fastest of its last this many passes (PassCosts)
EXPLORE_SHARE = 1 / 16  # the most of the time a SourcePlan spends trying model sources it would not choose
TRIAL_SHARE = 1 / 32  # the most of the time -k auto spends drafting where plain decoding is expected to win
CATCH_UP_DECAY = 0.5  # how fast the measured cost of a drafter's catching up forgets older catch-ups
LENGTHS_KEPT = 16  # the sequences whose lengths tell how many more tokens the current one will emit


class PassCosts:
    """What a round costs, measured as rounds run: the target's pass by the positions it scores (the fastest of the
    last few per size, and a line through the sizes seen for the others), drafting per draft step, and a drafter's
    catching up per token of its backlog (the prompt, rounds it did not draft)."""

    def __init__(self, prior_slope: float = 0.05) -> None:
        self.prior_slope = prior_slope  # extra cost per scored position, relative to one, before two sizes are seen
        self.score_seconds: dict[int, float] = {}  # positions scored -> the target's pass: the fastest of the last
        self._recent: dict[int, deque[float]] = {}  # RECENT_PASSES passes of that size
        self.draft_seconds_per_step: float | None = None
        self._caught_up = (0.0, 0.0)  # (seconds, tokens) of the drafter's catching up, older ones faded
        self.prefill_seconds_per_token: float | None = None  # the target's, as it prefilled prompts

    def observe(self, positions: int, target_seconds: float, draft_steps: int, draft_seconds: float) -> None:
        """A size's cost is the fastest of its last ``RECENT_PASSES`` passes. A pass is slowed by what shares the
        machine, or by the first pass of its size, never sped up, so a faster pass sets the cost at once (a size
        whose cost one slow pass inflated would not be chosen again, so never measured again); and the same low
        quantile for every size, however often each is measured, keeps their differences, on which the choice
        rests: a moving average that a slow pass moved up and a fast one set at once stood higher for the sizes
        passed most (plain decoding's, on a busy machine), so that a size seldom passed looked cheaper than it is."""
        recent = self._recent.setdefault(positions, deque(maxlen=RECENT_PASSES))
        recent.append(target_seconds)
        self.score_seconds[positions] = min(recent)
        if draft_steps:
            self.draft_seconds_per_step = moved(self.draft_seconds_per_step, draft_seconds / draft_steps)

    def observe_catch_up(self, tokens: int, seconds: float) -> None:
        """The drafter caught up on a backlog of ``tokens`` in ``seconds``. Weighed by tokens: a long backlog (a
        prompt) tells its cost per token better than a round's two."""
        if tokens:
            spent, taken = self._caught_up
            self._caught_up = (spent * CATCH_UP_DECAY + seconds, taken * CATCH_UP_DECAY + tokens)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """The target prefilled ``tokens`` of a prompt in ``seconds``."""
        if tokens:
            self.prefill_seconds_per_token = moved(self.prefill_seconds_per_token, seconds / tokens)

    def catch_up_seconds(self, tokens: int) -> float:
        """What the drafter's catching up on a backlog of ``tokens`` costs: as measured per token; until it is, at
        most what the target's prefill of as many costs (a draft model is not larger than its target), since a
        prompt's catching up is paid at once and in full where a draft step's cost is learnt from one round; 0
        where neither is measured."""
        spent, taken = self._caught_up
        per_token = spent / taken if taken else self.prefill_seconds_per_token or 0.0
        return tokens * per_token

    def round_seconds(self, draft_steps: int, positions: int, line: tuple[float, float] | None = None) -> float:
        return (self.draft_seconds_per_step or 0.0) * draft_steps + self.scoring_seconds(positions, line)

    def scoring_seconds(self, positions: int, line: tuple[float, float] | None = None) -> float:
        """The target's pass over ``positions`` positions: measured; between sizes measured, the dearest smaller
        one (a pass costs no less than a smaller one: the optimistic bound, so that the size gets tried and
        measured, since pass costs can step, as row-blocked kernels do); beyond them, from a line through the
        sizes measured (``line``: that line's (intercept, slope), when the caller has it already)."""
        seen = self.score_seconds
        if positions in seen:
            return seen[positions]
        below = [seconds for size, seconds in seen.items() if size < positions]
        if below and any(size > positions for size in seen):
            return max(below)
        intercept, slope = line or self.score_line()
        return max(intercept + slope * positions, 1e-9)

    def score_line(self) -> tuple[float, float]:
        """(intercept, slope) of the cost of a pass against its positions; a prior slope until two sizes are seen."""
        seen = self.score_seconds
        if len(seen) < 2:
            n, seconds = next(iter(seen.items()), (1, 1.0))  # arbitrary units until measured: only ratios matter
            base = seconds / (1 + self.prior_slope * (n - 1))
            return base * (1 - self.prior_slope), base * self.prior_slope
        xs, ys = list(seen), list(seen.values())
        mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
        slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)
        slope = max(slope, 0.0)
        return mean_y - slope * mean_x, slope


class MeasuredPassCosts:
    """Seconds of one pass over T positions: the shape measured at start-up (points linearly interpolated, and
    extrapolated past the last), times a scale learnt from the passes the server runs.

    Only the scale is learnt: the passes run are mostly of a few sizes, and moving single points would bend the
    curve's shape, on which the choice depends (a step's value is tokens over seconds, so a common scale cancels
    out of the comparison but for the drafting time added to it)."""

    def __init__(self, points: dict[int, float]) -> None:
        if not points:
            raise ValueError("need at least one measured pass")
        self.positions = sorted(points)
        self.seconds = [points[t] for t in self.positions]
        self.scale = 1.0

    def __call__(self, positions: int) -> float:
        return self.scale * self.measured(positions)

    def measured(self, positions: int) -> float:
        """The start-up measurement's seconds for a pass over ``positions``."""
        xs, ys = self.positions, self.seconds
        if len(xs) == 1:
            return ys[0] * positions / xs[0]
        i = min(max(bisect.bisect_left(xs, positions), 1), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return max(y0 + (y1 - y0) * (positions - x0) / (x1 - x0), 1e-9)

    def observe(self, positions: int, seconds: float) -> None:
        """Move the scale towards what a pass over ``positions`` took against the measurement."""
        self.scale *= (seconds / self(positions)) ** COST_LEARNING_RATE

    @classmethod
    def measure(cls, pool: Pool, max_positions: int, context_length: int = 64, repeats: int = 2
                ) -> MeasuredPassCosts:
        """Time passes over 1, 2, 4, ... max_positions positions, spread over up to all of the pool's slots,
        each slot holding ``context_length`` tokens; the pool is left as it was."""
        slots = [pool.open() for _ in range(pool.max_slots - len(pool.slots))]
        try:
            if not slots:
                raise ValueError("measuring the pass cost needs free slots")
            context_length = min(context_length, pool.max_length // 2)
            for slot in slots:
                pool.forward([Row(slot, [0] * context_length, 0)])
            points = {}
            positions = 1
            while True:
                points[positions] = min(_timed_pass(pool, slots, positions) for _ in range(repeats))
                if positions >= max_positions:
                    break
                positions = min(2 * positions, max_positions)
            return cls(points)
        finally:
            for slot in reversed(slots):
                pool.close(slot)


def _timed_pass(pool: Pool, slots: list, positions: int) -> float:
    rows = min(len(slots), positions)
    per_row = [positions // rows + (1 if r < positions % rows else 0) for r in range(rows)]
    lengths = [slot.length for slot in slots[:rows]]
    started = time.perf_counter()
    pool.forward([Row(slot, [0] * n, n) for slot, n in zip(slots, per_row)])
    elapsed = time.perf_counter() - started
    for slot, length in zip(slots, lengths):
        slot.length = length
    return elapsed


class TrialBudget:
    """While plain decoding is expected to win, a drafting round now and then all the same, so that what drafting
    gives keeps being measured (acceptance moves with the text): a trial is allowed once ``share`` of the plain time
    since the last one (the target's plain passes and prefills) covers what the trial costs beyond the plain rounds
    it replaces, the drafter's catching up included. So trials cost at most ``share`` of the time, however dear
    each one is: a drafter that would first catch up on a long prompt is tried seldom, a cheap one often."""

    def __init__(self, share: float = TRIAL_SHARE) -> None:
        self.share = share
        self.idle = 0.0  # plain seconds since the last drafting round

    def spend(self, seconds: float) -> None:
        """Time spent decoding plainly (a pass, a prefill)."""
        self.idle += seconds

    def allows(self, cost: float) -> bool:
        """Whether a trial costing ``cost`` seconds beyond plain rounds is due now (then the idle time restarts)."""
        if self.idle * self.share < cost:
            return False
        self.idle = 0.0
        return True

    def reset(self) -> None:
        """A round drafted as the best choice: the idle time restarts."""
        self.idle = 0.0


class SequenceLengths:
    """How many more tokens the current sequence may be counted on to emit, from the tokens the last few emitted: a
    cost paid once (a draft model's catching up on the prompt) is repaid over the tokens a sequence goes on to emit,
    which its token limit only bounds (an answer ends at its end token). So once short answers were seen, a new
    sequence is not counted on to run to its limit, and one that has outlived them is."""

    def __init__(self, kept: int = LENGTHS_KEPT) -> None:
        self.past: deque[int] = deque(maxlen=kept)
        self.current = 0  # tokens the current sequence has emitted

    def start(self) -> None:
        """A new sequence starts (the one before it, if any, ran to ``current`` tokens)."""
        if self.current:
            self.past.append(self.current)
        self.current = 0

    def emitted(self, tokens: int) -> None:
        self.current += tokens

    def expected_left(self, remaining: int | None) -> float:
        """The tokens the current sequence may be counted on to emit still, at most ``remaining`` (None: no
        limit): among the past sequences longer than it is so far, the lower median of what they emitted beyond
        that (the median, not the mean: where answers are short or long, one not yet past the short ones is not
        counted on to be long, so a short one does not pay a catch-up the long ones would repay, which costs it a
        large share of its time, and a long one waits a few tokens, a small share of its); ``remaining`` where none
        was longer."""
        limit = math.inf if remaining is None else remaining
        longer = sorted(min(length - self.current, limit) for length in self.past if length > self.current)
        return longer[(len(longer) - 1) // 2] if longer else limit


class Acceptance:
    """Accepted draft tokens over draft tokens that were reached (a rejected one ends the chain)."""

    def __init__(self) -> None:
        self.accepted = 0.0
        self.reached = 0.0

    def observe(self, accepted: float, reached: float, decay: float = 1.0) -> None:
        self.accepted = self.accepted * decay + accepted
        self.reached = self.reached * decay + reached

    def rate(self, prior: float, strength: float = PRIOR_STRENGTH) -> float:
        """The estimate: observations, plus ``strength`` observations' worth of ``prior``."""
        return (self.accepted + strength * prior) / (self.reached + strength)


def moved(average: float | None, value: float, weight: float = 0.2) -> float:
    """A moving average moved a ``weight`` of the way towards ``value`` (the value itself where there is none yet:
    None, or the 0 a cost starts from)."""
    return value if not average else (1 - weight) * average + weight * value


def chained_rates(positions: list[Acceptance], prior: float, strength: float) -> list[float]:
    """[i-1]: the estimated chance that draft position i is accepted once position i-1 was, each position's
    observations shrunk towards the estimate before it (the first's towards ``prior``) with ``strength``."""
    estimates, estimate = [], prior
    for position in positions:
        estimate = position.rate(estimate, strength)
        estimates.append(estimate)
    return estimates


def survival(acceptances: list[float]) -> list[float]:
    """[j-1]: the chance that draft tokens 1..j are all accepted, given each one's acceptance once the one before
    it was."""
    chances, chance = [], 1.0
    for a in acceptances:
        chance *= a
        chances.append(chance)
    return chances


def expected_tokens_by_k(acceptances: list[float]) -> list[float]:
    """[k]: expected tokens from a round that drafts k tokens (the accepted ones and one more)."""
    totals = [1.0]
    for chance in survival(acceptances):
        totals.append(totals[-1] + chance)
    return totals


class SourcePlan:
    """The cost model of a drafter with several sources (the hybrid): each round, the source and draft length with
    the best expected tokens per second, from each source's acceptance per draft position (as ``CostModelPolicy``
    measures it), its drafting seconds per token and the target's pass costs (``PassCosts``); none, plain decoding,
    where no source pays.

    A source whose drafts cost next to nothing (a copy from the context: ``free``) offers one every round, and each
    offer is scored against the tokens the round emitted, whichever source drafted: under greedy decoding and the
    invariant sampler those are the target's own choices whatever was drafted, so the score is what verifying that
    offer would have given. A model source is scored on its own rounds only; while another choice wins, it drafts
    a round anyway once the time since it last drafted is ``1 / explore_share`` times what that round would cost
    beyond a plain one (its catching up, its drafting, the wider pass), so that a source that stopped paying is
    dropped and one that pays again comes back, for at most that share of the time: a model that would first catch
    up on a long prompt is tried seldom, one that is current every few rounds.

    Acceptance is kept twice: over every sequence the plan served (``positions``), and per sequence (``local()``, a
    record each sequence keeps), whose estimates shrink towards the first with ``local_weight`` observations' worth:
    a new sequence starts from what the others taught, and one whose text differs (a translation after summaries)
    is weighed by its own rounds within a few of them, as the server's planner weighs each request."""

    def __init__(self, names: tuple[str, ...], free: frozenset[str], max_k: int = AUTO_MAX_K,
                 explore_every: int = 16, decay: float = 0.98, prior_acceptance: float = 0.5,
                 prior_weight: float = 2.0, local_weight: float = PRIOR_STRENGTH,
                 explore_share: float = EXPLORE_SHARE) -> None:
        self.names = names
        self.max_k = max_k
        self.local_weight = local_weight
        self.explore_every = explore_every  # rounds: a long backlog's cost is spread over these; a longer draft probed
        self.explore_share = explore_share
        self.decay = decay
        self.prior_acceptance = prior_acceptance
        self.prior_weight = prior_weight
        self.costs = PassCosts()  # the target's passes only: drafting costs are per source, below
        self.rounds = 0
        self.positions = {name: [Acceptance() for _ in range(max_k)] for name in names}
        self.seconds_per_token: dict[str, float] = {name: 0.0 for name in names}
        # a model source's cost per round beyond its tokens: bringing its cache up to the round's context (the
        # target's correction, a copy's accepted tokens), measured where it drafted the round before too
        self.seconds_per_round: dict[str, float] = {name: 0.0 for name in names}
        # a model source's catching up on a long backlog (the prompt, rounds it did not draft), per token
        self.seconds_per_backlog_token: dict[str, float] = {name: 0.0 for name in names}
        # seconds of target passes since a model source last drafted
        self.idle: dict[str, float] = {name: 0.0 for name in names if name not in free}

    def local(self) -> dict[str, list[Acceptance]]:
        """A new sequence's own record of each source's acceptance per draft position (filled as it drafts)."""
        return {}

    def _record(self, record: dict[str, list[Acceptance]], name: str) -> list[Acceptance]:
        """``record``'s acceptance per position for ``name``: a source, or a copy's grade of match (``copy/3``),
        kept from its first offer on."""
        if name not in record:
            record[name] = [Acceptance() for _ in range(self.max_k)]
        return record[name]

    def choose(self, offers: dict[str, int], limit: int, local: dict[str, list[Acceptance]] | None = None,
               backlogs: dict[str, int] | None = None) -> tuple[str | None, int]:
        """(source, draft length) for the round, given the longest draft each source offers (a model source:
        ``limit``), the sequence's own record (``local``) and, per model source, the tokens it would first catch up
        on (``backlogs``: a long one, the prompt, counts spread over ``explore_every`` rounds); (None, 0) for plain
        decoding."""
        line = self.costs.score_line()
        longest = min(max(offers.values(), default=0), limit, self.max_k)
        passes = [self.costs.scoring_seconds(n, line) for n in range(1, longest + 2)]  # [n-1]: a pass over n
        catching_up = {name: self._backlog_seconds(name, tokens) / self.explore_every
                       for name, tokens in (backlogs or {}).items()}
        best: tuple[float, str | None, int] = (1.0 / passes[0], None, 0)
        own_best: dict[str, tuple[float, int]] = {}
        for name, length in offers.items():
            rate, k = self._best_length(name, min(length, longest), passes, local, catching_up.get(name, 0.0))
            own_best[name] = (rate, k)
            if k and rate > best[0]:
                best = (rate, name, k)
        for name in self.idle:
            trial = own_best.get(name, (0.0, 0))[1]
            if best[1] == name:
                self.idle[name] = 0.0
            elif trial and self.idle[name] * self.explore_share >= self._trial_seconds(name, trial, passes, backlogs):
                self.idle[name] = 0.0
                return name, trial
        self.rounds += 1
        source, k = best[1], best[2]
        if source is not None and self.rounds % self.explore_every == 0 and k < min(offers[source], longest):
            return source, k + 1  # now and then a position more, so that the next size's cost is measured again
        return source, k

    def _trial_seconds(self, name: str, k: int, passes: list[float], backlogs: dict[str, int] | None) -> float:
        """What a round drafting ``k`` from the model source costs beyond a plain round: its catching up (on its
        backlog, or a round's few tokens), its drafting, and the pass's ``k`` more positions."""
        backlog = (backlogs or {}).get(name, 0)
        catching_up = self._backlog_seconds(name, backlog) if backlog >= BACKLOG else self.seconds_per_round[name]
        return catching_up + self.seconds_per_token[name] * k + passes[k] - passes[0]

    def _backlog_seconds(self, name: str, tokens: int) -> float:
        """What catching up on ``tokens`` would cost the model source: nothing for a round's few (its cost per
        round holds them)."""
        return tokens * self.seconds_per_backlog_token.get(name, 0.0) if tokens >= BACKLOG else 0.0

    def _best_length(self, name: str, most: int, passes: list[float], local: dict | None = None,
                     extra: float = 0.0) -> tuple[float, int]:
        """(expected tokens per second, k) of the best draft of 1..``most`` tokens from this source, given what a
        target pass over n positions costs (``passes[n-1]``); (0, 0) if none."""
        if most < 1:
            return 0.0, 0
        tokens = expected_tokens_by_k(self.acceptances(name, local)[:most])
        per_token = self.seconds_per_token.get(name, 0.0)
        per_round = self.seconds_per_round.get(name, 0.0) + extra
        best = (0.0, 0)
        for k in range(1, most + 1):
            rate = tokens[k] / (per_round + per_token * k + passes[k])
            if rate > best[0]:
                best = (rate, k)
        return best

    def acceptances(self, name: str, local: dict[str, list[Acceptance]] | None = None) -> list[float]:
        """[i-1]: the source's estimated chance that draft position i is accepted once position i-1 was: over every
        sequence, or, with a sequence's ``local`` record, its own, shrunk towards that."""
        shared = chained_rates(self._record(self.positions, name), self.prior_acceptance, self.prior_weight)
        if local is None:
            return shared
        return [own.rate(prior, self.local_weight) for own, prior in zip(self._record(local, name), shared)]

    def observe_offer(self, name: str, offered: list[int], emitted: list[int],
                      local: dict[str, list[Acceptance]] | None = None) -> None:
        """Score a draft the source ``offered`` against the tokens the round ``emitted`` from the same place: its
        matching prefix was accepted; the token after it was reached and refused, unless the round emitted no
        more (then it is untested). Into the sequence's ``local`` record too, where given."""
        if not offered:
            return
        accepted = 0
        while accepted < min(len(offered), len(emitted)) and offered[accepted] == emitted[accepted]:
            accepted += 1
        reached = min(len(offered), accepted + (accepted < len(emitted)))
        for record in (self.positions, local) if local is not None else (self.positions,):
            for i, position in enumerate(self._record(record, name), start=1):
                position.observe(float(i <= accepted), float(i <= reached), self.decay)

    def observe_drafting(self, name: str, tokens: int, seconds: float, catch_up_seconds: float | None = None,
                         backlog: int = 0) -> None:
        """A model source drafted ``tokens`` in ``seconds``, after catching up on the ``backlog`` tokens since it
        last drafted in ``catch_up_seconds``: a round's cost where they were few (the target's correction, a
        copy's tokens), a cost per token of backlog where they were many (the prompt)."""
        if tokens:
            self.seconds_per_token[name] = moved(self.seconds_per_token[name], seconds / tokens)
        if catch_up_seconds is None:
            return
        if backlog < BACKLOG:
            self.seconds_per_round[name] = moved(self.seconds_per_round[name], catch_up_seconds)
        else:
            per_token = catch_up_seconds / backlog
            self.seconds_per_backlog_token[name] = moved(self.seconds_per_backlog_token[name], per_token)

    def observe_pass(self, positions: int, seconds: float) -> None:
        self.costs.observe(positions, seconds, 0, 0.0)
        for name in self.idle:
            self.idle[name] += seconds
