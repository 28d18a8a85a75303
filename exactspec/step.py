"""One round's verification, shared by the engine (one sequence) and the server's scheduler (a batch): a draft
and the target's logits in, a verdict out; the verdict as the round's emitted tokens; the seeded generator each
sequence samples with; a round's draft under a grammar."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from exactspec.choices import MAX_DRAFT_TOKENS, check_seed
from exactspec.proposers.base import EMPTY_DRAFT, Draft, Guide
from exactspec.sampling import SamplingParams, TargetChoices, logits_to_probs
from exactspec.verify import TreeVerdict, Verdict, node_depths, verify, verify_choices, verify_tree, verify_tree_choices

if TYPE_CHECKING:
    from exactspec.grammars import Grammar


@dataclass(frozen=True)
class Round:
    """One round of the loop: what was drafted, what survived, what was emitted."""

    draft_tokens: int  # k actually drafted this round (a tree's depth)
    accepted: int  # draft tokens accepted
    tokens: list[int]  # tokens emitted (accepted prefix + recovered/bonus), cut at EOS or the token limit
    kinds: list[str]  # per emitted token: "accepted", "recovered", "bonus" or "plain"
    draft_seconds: float = 0.0  # time spent drafting
    target_seconds: float = 0.0  # time spent scoring, verifying and rolling back
    asked: int = 0  # the draft length the policy chose (the drafter may offer fewer)
    draft_nodes: int = 0  # draft positions the target scored: the draft tokens, or a tree's nodes
    # per emitted token, where asked: its log-probability and the most likely tokens' at its position
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    finished: str | None = None  # where the sequence ends with this round: "stop" or "length"
    source: str = ""  # which source of a combined drafter drafted it (hybrid); "" otherwise


@dataclass
class PositionCounts:
    """Per draft position ([i]: position i+1): rounds that drafted a token there, and rounds whose token there was
    accepted (a token after a rejection counts as drafted, not accepted: vLLM's per-position acceptance). The
    engine's stats and the server's metrics count with it."""

    drafted: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)

    def observe(self, round_: Round) -> None:
        grow = round_.draft_tokens - len(self.drafted)
        if grow > 0:
            self.drafted += [0] * grow
            self.accepted += [0] * grow
        for i in range(round_.draft_tokens):
            self.drafted[i] += 1
            self.accepted[i] += i < round_.accepted

    @property
    def draft_tokens(self) -> int:
        return sum(self.drafted)

    @property
    def accepted_tokens(self) -> int:
        return sum(self.accepted)

    @property
    def drafting_rounds(self) -> int:
        """Rounds that drafted at all: each drafted a token at position 1."""
        return self.drafted[0] if self.drafted else 0

    def rates(self) -> list[float]:
        """[i]: accepted / drafted tokens at draft position i+1."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted, self.drafted)]


class DraftTotals:
    """Draft and accepted token totals, read off a ``positions`` PositionCounts (the stats' and the metrics')."""

    positions: PositionCounts

    @property
    def draft_tokens(self) -> int:
        return self.positions.draft_tokens

    @property
    def accepted_tokens(self) -> int:
        return self.positions.accepted_tokens


def verify_draft(
    draft: Draft,
    logits: torch.Tensor,  # [k+1, vocab]
    params: SamplingParams,
    generator: torch.Generator,
    position: int,  # the absolute position of the token that row 0 chooses (the context's length)
) -> Verdict:
    """Greedy and invariant sampling keep draft tokens while they are the target's own choices; standard sampling
    tests them with min(1, p/q)."""
    if params.greedy or params.invariant:
        positions = [position + j for j in range(len(draft) + 1)]
        verdict = verify_choices(draft.tokens, TargetChoices(logits, params, generator, positions))
    else:
        draft_tokens = torch.tensor(draft.tokens, dtype=torch.long, device=logits.device)  # [k]
        verdict = verify(draft_tokens, draft.probs, logits_to_probs(logits, params), generator)
    return replace(verdict, forced=draft.forced) if draft.forced else verdict


def verify_draft_tree(
    draft: Draft,  # with parents
    logits: torch.Tensor,  # [m+1, vocab]: after the pending token, then after each node
    params: SamplingParams,
    generator: torch.Generator,
    position: int,  # the absolute position of the token that row 0 chooses; row 1+i chooses the one after node i
) -> TreeVerdict:
    if params.greedy or params.invariant:
        positions = [position] + [position + depth for depth in node_depths(draft.parents)]
        return verify_tree_choices(draft.tokens, draft.parents, TargetChoices(logits, params, generator, positions))
    return verify_tree(draft.tokens, draft.parents, draft.probs, logits_to_probs(logits, params), generator)


def emitted_round(draft: Draft, verdict: Verdict, limit: int, stop_ids: frozenset[int], draft_seconds: float,
                   target_seconds: float, asked: int) -> Round:
    """The round's tokens and how each came, cut after a stop token and at ``limit`` tokens."""
    tokens = verdict.emitted(draft.tokens)
    last_kind = "plain" if verdict.num_draft == 0 else ("bonus" if verdict.bonus else "recovered")
    kinds = ["accepted"] * verdict.accepted + [last_kind]
    cut = min(limit, len(tokens))
    for i, token in enumerate(tokens[:cut]):
        if token in stop_ids:
            cut = i + 1
            break
    return Round(draft_tokens=verdict.num_draft, accepted=verdict.accepted, tokens=tokens[:cut], kinds=kinds[:cut],
                 draft_seconds=draft_seconds, target_seconds=target_seconds, asked=asked, draft_nodes=len(draft),
                 source=draft.source if verdict.num_draft else "")


def constrained_draft(grammar: Grammar, k: int, room: int, propose: Callable[[list[int], int, Guide | None], Draft],
                      guided: bool = False) -> Draft:
    """A round's draft under a grammar, of at most ``room`` tokens (and MAX_DRAFT_TOKENS): the tokens it forces
    from here (with no drafter call), then up to k of the drafter's continuation after them (``propose(forced, n,
    guide)``; a drafter that drafts under the grammar, ``guided``, gets its guide, else None), up to its first
    token the grammar forbids. Forced tokens are point masses, accepted by construction, so they ride outside the
    drafter's k (those a guided drafter's tokens lead to as well): they cost only their share of the pass. A draft
    drawn from a distribution keeps the forbidden token, to be rejected for sure: under the standard rule the
    residual there takes the draft's mass on forbidden tokens, which cutting the draft would move."""
    room = min(room, MAX_DRAFT_TOKENS)  # a round's pass stays a round's (a longer one would run as a prompt's)
    if room <= 0:
        return EMPTY_DRAFT
    forced = grammar.forced(room)
    n = min(k, room - len(forced))
    if n <= 0:
        drafted = EMPTY_DRAFT
    elif guided:
        with grammar.guide(forced, room - len(forced)) as guide:
            drafted = propose(forced, n, guide)
    else:
        drafted = propose(forced, n, None)
    probs = drafted.probs
    if probs is not None and forced:
        points = torch.zeros(len(forced), probs.shape[-1], dtype=probs.dtype, device=probs.device)
        points[torch.arange(len(forced)), torch.tensor(forced, device=probs.device)] = 1
        probs = torch.cat([points, probs])
    draft = Draft(tokens=forced + drafted.tokens, probs=probs, forced=len(forced), source=drafted.source)
    admitted = grammar.admitted(draft.tokens)
    return draft.first(admitted + (probs is not None and admitted < len(draft)))


def constrained_round(grammar: Grammar, round_: Round) -> Round:
    """The round's tokens taken in by the grammar, cut after the one that completes it (nothing but an end token
    could follow): plain decoding stops there too, so an end token a verifying pass chose after it is dropped."""
    for i, token in enumerate(round_.tokens):
        grammar.advance([token])
        if grammar.stopped:
            return replace(round_, tokens=round_.tokens[: i + 1], kinds=round_.kinds[: i + 1])
    return round_


def make_generator(seed: int | None, device: torch.device) -> torch.Generator:
    check_seed(seed)
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator
