"""One sequence's round, the same for the library's engine (one sequence) and the server's scheduler (many in one
pass): what happens around the target's pass over a draft.

1. draft: the drafter catches up on what it missed, then proposes (a chain, or a tree), after the tokens a grammar
   forces;
2. (the caller scores the pending token and the draft in a target pass)
3. adjust: logit_bias and penalties at each drafted position, with that position's own context; the grammar's mask;
4. verify (``step.py``): the longest prefix of draft tokens that are the target's own choices, and one more token;
5. (the caller cuts its cache back to the accepted tokens: a cache is the caller's, a pool slot or a runtime)
6. emit: cut at EOS, a stop string, the grammar's end and the token limit; each token's log-probabilities where
   asked; the sequence's context grows, and it finishes ("stop" or "length") where it must.

The callers decide only who runs, how far each drafts (the policy, the server's planner), and how the target's pass
is made: vLLM's split of the scheduler from the logits processors, the sampler and the output processor.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

import torch

from exactspec.backends.base import declares
from exactspec.proposers.base import EMPTY_DRAFT, CatchesUp, Draft, DraftsUnderGrammar, Guide, Proposer
from exactspec.sampling import LogitsAdjustment, SamplingParams
from exactspec.step import Round, constrained_draft, constrained_round, emitted_round, verify_draft, verify_draft_tree
from exactspec.verify import TreeVerdict, Verdict

if TYPE_CHECKING:
    from exactspec.grammars import Grammar

TokenLogprobs = list[tuple[float, list[tuple[int, float]]]]  # per token: its own log-probability, the top ones


class StopCondition(Protocol):
    """What ends a sequence at a token of its output besides EOS and the token limit: its stop strings
    (:class:`exactspec.stops.StopText`, over the tokenizer)."""

    def push(self, token_id: int) -> object:
        """Take the sequence's next token."""

    @property
    def stopped(self) -> bool:
        """Whether the tokens taken so far meet the condition."""


class Sequence:
    """One sequence being generated: its context, its drafter, its random generator, what ends it and what each of
    its positions' logits go through before verification. ``finished`` is None while it runs, then "stop" (EOS, a
    stop string or the grammar's end) or "length" (``max_new_tokens``, or the context full at ``max_length``)."""

    def __init__(self, prompt_ids: list[int], max_new_tokens: int, max_length: int, sampling: SamplingParams,
                 generator: torch.Generator, proposer: Proposer, eos_ids: frozenset[int], *, stop_at_eos: bool = True,
                 adjustment: LogitsAdjustment | None = None, grammar: Grammar | None = None,
                 stop: StopCondition | None = None, logprobs: int | None = None) -> None:
        """``eos_ids``: the end tokens, which end it where it ``stop_at_eos`` or a ``grammar`` constrains it;
        ``logprobs``: None for none, else each token's and the ``logprobs`` most likely."""
        self.context = list(prompt_ids)
        self.max_new_tokens = max_new_tokens
        self.max_length = max_length
        self.sampling = sampling
        self.generator = generator
        self.proposer = proposer
        self.stop_ids = eos_ids if stop_at_eos or grammar is not None else frozenset()
        self.adjustment = adjustment if adjustment is not None and adjustment.active else None
        self.grammar = grammar
        self.stop = stop
        self.logprobs = logprobs
        self.produced = 0
        self.finished: str | None = None
        self.counts: torch.Tensor | None = None  # [vocab]: how often each token was generated (for penalties)
        self.lagging = True  # the drafter has not seen the last round (none has run yet)

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - self.produced

    @property
    def room(self) -> int:
        """The draft positions the next round may score: it emits at most one token more, within the token limit
        and the context."""
        return min(self.remaining - 1, self.max_length - len(self.context) - 1)

    # 1. draft ------------------------------------------------------------------------------------------------------

    @property
    def backlog(self) -> int:
        """The tokens a drafter that keeps state would first catch up on before drafting (the prompt, or those of
        the rounds since it last drafted, as far as it reads them: ``CatchesUp.backlog``); 0 where it drafted the
        last round (a round's correction is part of its drafting) or keeps no state."""
        if not self.lagging or not declares(self.proposer, CatchesUp):
            return 0
        return self.proposer.backlog(self.context)

    def catch_up(self, k: int) -> int:
        """Before a round that drafts ``k`` tokens: a drafter that keeps state takes in the rounds it missed (the
        prompt, or rounds that drafted nothing). A backlog, not what drafting k tokens costs: callers time it apart.
        Returns the backlog's tokens (0: none was caught up on)."""
        backlog = self.backlog if k else 0
        if backlog:
            self.proposer.catch_up(self.context)
        self.lagging = k == 0
        return backlog

    def draft(self, k: int, widths: list[int] | None = None, features: torch.Tensor | None = None) -> Draft:
        """Up to k draft tokens (a tree ``widths`` wide at each depth, where given); under a grammar, the tokens it
        forces first, then the drafter's, up to a token it forbids. ``features``: the target's hidden states at the
        cached positions, for a drafter that reads them."""
        extra = {} if features is None else {"features": features}

        def propose(forced: list[int], n: int, guide: Guide | None = None) -> Draft:  # after the forced tokens
            context = self.context + forced if forced else self.context
            guided = {} if guide is None else {"guide": guide}
            return self.proposer.propose(context, n, self.sampling, self.generator, **extra, **guided)

        if self.grammar is not None:
            return constrained_draft(self.grammar, k, self.room, propose, declares(self.proposer, DraftsUnderGrammar))
        if k == 0:
            return EMPTY_DRAFT
        if widths is None:
            return propose([], k)
        return self.proposer.propose_tree(self.context, widths, self.sampling, self.generator, **extra)

    # 3-4. adjust and verify ----------------------------------------------------------------------------------------

    def adjusted(self, draft: Draft, logits: torch.Tensor) -> torch.Tensor:  # [n+1, vocab] -> [n+1, vocab]
        """The target's logits after the pending token and each draft node, as the sequence's distribution reads
        them: its logit bias and penalties (each row with its own context), then its grammar's mask."""
        if self.adjustment is not None:
            if self.adjustment.penalises and self.counts is None:
                self.counts = torch.zeros(logits.shape[-1], device=logits.device)
            logits = self.adjustment.apply(logits, self.counts, draft.tokens, draft.parents)
        if self.grammar is not None:
            logits = self.grammar.masked(logits, draft.tokens)
        return logits

    def verify(self, draft: Draft, logits: torch.Tensor) -> Verdict | TreeVerdict:  # logits [n+1, vocab], adjusted
        """The verdict on the draft: row 0 chooses the token after the context, row j the one after draft node j-1."""
        position = len(self.context)
        if draft.parents is None:
            return verify_draft(draft, logits, self.sampling, self.generator, position)
        return verify_draft_tree(draft, logits, self.sampling, self.generator, position)

    # 6. emit -------------------------------------------------------------------------------------------------------

    def emit(self, draft: Draft, verdict: Verdict | TreeVerdict, logits: torch.Tensor, asked: int = 0,
             draft_seconds: float = 0.0, target_seconds: float = 0.0) -> Round:
        """The round's tokens (``logits``: the adjusted ones the verdict read), taken into the context; the sequence
        finishes where it must."""
        round_ = emitted_round(draft, verdict, self.remaining, self.stop_ids, draft_seconds, target_seconds, asked)
        if self.grammar is not None:
            round_ = constrained_round(self.grammar, round_)
        if self.stop is not None:
            round_ = _until_stopped(round_, self.stop)
        if self.logprobs is not None:
            rows = logits[path_rows(verdict)[: len(round_.tokens)]]  # [n, vocab]: row i chose token i
            round_ = replace(round_, logprobs=token_logprobs(rows, round_.tokens, self.logprobs))
        self.context += round_.tokens
        self.produced += len(round_.tokens)
        if self.counts is not None:
            self.counts.index_add_(0, torch.tensor(round_.tokens, device=self.counts.device),
                                   torch.ones(len(round_.tokens), device=self.counts.device))
        self.finished = self._finish(round_.tokens[-1])
        return replace(round_, finished=self.finished) if self.finished else round_

    def _finish(self, last: int) -> str | None:
        if last in self.stop_ids or self.stop is not None and self.stop.stopped or \
                self.grammar is not None and self.grammar.stopped:
            return "stop"
        if self.remaining == 0 or len(self.context) >= self.max_length:
            return "length"
        return None


def row_parents(draft: Draft) -> list[int]:
    """Each token's parent in the pass's row for a tree draft (the pending token, then the nodes): -1 for the pending
    token (it follows the cache), node i's parent one further on."""
    return [-1] + [parent + 1 for parent in draft.parents]


def path_rows(verdict: Verdict | TreeVerdict) -> list[int]:
    """The rows of the verifying pass that chose the emitted tokens, in order: a chain's first ones; a tree's root
    row, then the row after each accepted node (for a tree, also the rows its cache keeps: ``keep_path``)."""
    if isinstance(verdict, TreeVerdict):
        return [0] + [node + 1 for node in verdict.path]
    return list(range(verdict.accepted + 1))


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> TokenLogprobs:
    """Each token's log-probability under the distribution of its row of ``logits`` ([len(tokens), vocab], the
    adjusted logits at its position), and the ``top`` most likely tokens there."""
    logprobs = torch.log_softmax(logits[: len(tokens)].double(), dim=-1)  # [n, vocab]
    chosen = logprobs[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()
    if not top:
        return [(lp, []) for lp in chosen]
    values, ids = torch.topk(logprobs, top, dim=-1)
    return [(lp, list(zip(i, v))) for lp, i, v in zip(chosen, ids.tolist(), values.tolist())]


def _until_stopped(round_: Round, stop: StopCondition) -> Round:
    """The round's tokens through the one that meets the stop condition (all of them if none does)."""
    for i, token in enumerate(round_.tokens):
        stop.push(token)
        if stop.stopped:
            return replace(round_, tokens=round_.tokens[: i + 1], kinds=round_.kinds[: i + 1])
    return round_

