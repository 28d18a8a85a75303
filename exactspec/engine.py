"""The step loop: draft, score in one target pass, verify, roll back, emit.

The engine owns the loop and nothing else: the backend owns weights and KV cache, the proposer owns drafting,
the verifier owns exactness, the policy owns the draft length.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from exactspec.backends.base import CausalLM, FeatureSource, TreeScorer, declares, prefill, require
from exactspec.choices import check_logprobs, check_max_new_tokens, check_num_draft_tokens, check_tree
from exactspec.errors import UsageError
from exactspec.policy import (
    AUTO_MAX_K,
    PlannedByDrafter,
    Policy,
    draft_positions,
    fitted_depth,
    make_policy,
    tree_widths,
)
from exactspec.proposers.base import Combines, Draft, FeatureProposer, PlansRounds, Proposer, TreeProposer
from exactspec.rounds import Sequence, StopCondition, TokenLogprobs, path_rows, row_parents
from exactspec.sampling import LogitsAdjustment, SamplingParams
from exactspec.step import DraftTotals, PositionCounts, Round, make_generator
from exactspec.verify import TreeVerdict, Verdict

if TYPE_CHECKING:
    from exactspec.grammars import Grammar


@dataclass(frozen=True)
class GenerationConfig:
    """What to generate: how many tokens, how to sample, how far to draft."""

    max_new_tokens: int = 128
    num_draft_tokens: int | str = 4  # a fixed k, or a policy: "auto" (cost model) or "heuristic"
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: int | None = None
    stop_at_eos: bool = True
    # draft a tree: candidates at each depth (the last repeats), or "auto" (the cost model's shape); None: a chain
    tree: tuple[int, ...] | str | None = None
    logprobs: int | None = None  # None: none; n: each token's log-probability and the n most likely there
    adjustment: LogitsAdjustment | None = None  # logit_bias and penalties on the target's logits

    def __post_init__(self) -> None:
        check_max_new_tokens(self.max_new_tokens)
        check_logprobs(self.logprobs)
        check_num_draft_tokens(self.num_draft_tokens)
        check_tree(self.tree)

    def tree_widths(self, depth: int, policy: Policy | None = None) -> list[int] | None:
        """The candidates at each depth of a tree ``depth`` deep (with ``auto``, the shape ``policy`` chose);
        None for a chain."""
        return tree_widths(self.tree, depth, policy)

    @property
    def max_draft_tokens(self) -> int:
        """The longest draft a round may ask for."""
        return AUTO_MAX_K if isinstance(self.num_draft_tokens, str) else self.num_draft_tokens

    def draft_positions(self, depth: int) -> int:
        """Positions a draft ``depth`` deep takes in the target's pass, at most: its tokens, or its tree's nodes."""
        return draft_positions(self.tree, depth)


@dataclass
class GenerationStats(DraftTotals):
    """Counters over one generation. A round is one target forward pass over the drafted positions."""

    rounds: int = 0
    draft_nodes: int = 0  # draft positions scored (a tree scores more than its depth)
    new_tokens: int = 0
    seconds: float = 0.0  # the whole generation, prefill included
    draft_seconds: float = 0.0  # of which drafting
    target_seconds: float = 0.0  # of which the target's scoring passes and verification
    policy: str = "fixed"  # how k was chosen: fixed, heuristic or auto
    chosen_k: dict[int, int] = field(default_factory=dict)  # draft length the policy chose -> rounds
    positions: PositionCounts = field(default_factory=PositionCounts)  # drafted and accepted per draft position
    # a combined drafter's sources (hybrid): per source, [draft tokens scored, accepted tokens]
    sources: dict[str, list[int]] = field(default_factory=dict)

    def record(self, round_: Round) -> None:
        self.rounds += 1
        if round_.source:
            counts = self.sources.setdefault(round_.source, [0, 0])
            counts[0] += round_.draft_tokens
            counts[1] += round_.accepted
        self.positions.observe(round_)
        self.chosen_k[round_.asked] = self.chosen_k.get(round_.asked, 0) + 1
        self.draft_nodes += round_.draft_nodes
        self.new_tokens += len(round_.tokens)
        self.draft_seconds += round_.draft_seconds
        self.target_seconds += round_.target_seconds

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / draft tokens (0 when nothing was drafted)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def drafted_at(self) -> list[int]:
        """[i]: rounds that drafted a token at draft position i+1."""
        return self.positions.drafted

    @property
    def accepted_at(self) -> list[int]:
        """[i]: rounds whose draft token i+1 was accepted."""
        return self.positions.accepted

    @property
    def acceptance_by_position(self) -> list[float]:
        """Per draft position: the share of the drafted tokens there that were accepted."""
        return self.positions.rates()

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per target forward pass."""
        return self.new_tokens / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "rounds": self.rounds,
            "draft_tokens": self.draft_tokens,
            "draft_nodes": self.draft_nodes,
            "draft_nodes_per_round": self.draft_nodes / self.rounds if self.rounds else 0.0,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "new_tokens": self.new_tokens,
            "seconds": self.seconds,
            "tokens_per_second": self.tokens_per_second,
            "draft_seconds": self.draft_seconds,
            "target_seconds": self.target_seconds,
            "policy": self.policy,
            "chosen_k": {str(k): n for k, n in sorted(self.chosen_k.items())},
            "acceptance_by_position": [round(rate, 4) for rate in self.acceptance_by_position],
            **({"sources": self.source_shares()} if self.sources else {}),
        }

    def source_shares(self) -> dict[str, dict]:
        """Per source of a combined drafter: its draft and accepted tokens, and their shares (``source_shares``)."""
        return source_shares(self.sources)


def source_shares(counts: dict[str, tuple[int, int] | list[int]]) -> dict[str, dict]:
    """Per source of a combined drafter, from its (draft tokens, accepted tokens): those, and its shares of all
    sources' draft and accepted tokens (None where no source drafted, or none was accepted)."""
    drafted_total = sum(drafted for drafted, _ in counts.values())
    accepted_total = sum(accepted for _, accepted in counts.values())
    return {name: {"draft_tokens": drafted, "accepted_tokens": accepted,
                   "draft_share": drafted / drafted_total if drafted_total else None,
                   "accepted_share": accepted / accepted_total if accepted_total else None}
            for name, (drafted, accepted) in counts.items()}


@dataclass
class GenerationResult:
    token_ids: list[int]  # generated ids only
    stats: GenerationStats
    kinds: list[str]  # per generated token, how it came (see Round.kinds)
    logprobs: TokenLogprobs | None = None  # per generated token, where asked (GenerationConfig.logprobs)
    finish_reason: str = "length"  # "stop" (EOS, a stop string, the grammar's end) or "length"

    def take(self, round_: Round) -> None:
        """Add a round's tokens."""
        self.token_ids += round_.tokens
        self.kinds += round_.kinds
        if self.logprobs is not None:
            self.logprobs += round_.logprobs
        self.finish_reason = round_.finished or self.finish_reason


class Engine:
    """Speculative decoding of one sequence at a time with a target backend and a proposer."""

    def __init__(
        self,
        target: CausalLM,
        proposer: Proposer,
        eos_token_ids: set[int] | frozenset[int] = frozenset(),
    ) -> None:
        self.target = target
        self.proposer = proposer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.policies: dict[str, Policy] = {}  # adaptive policies by name, learning across requests
        self.reads_features = declares(proposer, FeatureProposer)  # each draft gets the target's hidden states
        if self.reads_features:
            require(target, FeatureSource, f"--drafter {proposer.name}")
            target.keep_hidden_states()

    def clear_cache(self) -> None:
        """Forget cached prefixes, target's and drafter's: the next request starts from an empty cache."""
        self.target.rollback(0)
        self.proposer.clear_cache()

    def generate(
        self,
        prompt_ids: list[int],
        config: GenerationConfig,
        on_round: Callable[[Round], None] | None = None,
        grammar: Grammar | None = None,
        stop: StopCondition | None = None,
    ) -> GenerationResult:
        """Generate up to config.max_new_tokens tokens; ``on_round`` sees each round as it is emitted. A
        ``grammar`` (a fresh matcher: ``grammars.grammar_for``) constrains them; a ``stop`` condition (stop
        strings: ``exactspec.stops.StopText``) ends them at the token that meets it."""
        policy = self.policy(config.num_draft_tokens, config.tree)
        stats = GenerationStats(policy=policy.name)
        if declares(self.proposer, Combines):
            stats.sources = {name: [0, 0] for name in self.proposer.source_names}
        result = GenerationResult(token_ids=[], stats=stats, kinds=[],
                                  logprobs=None if config.logprobs is None else [])
        start = time.perf_counter()
        for round_ in self.rounds(prompt_ids, config, policy, grammar, stop):
            stats.record(round_)
            result.take(round_)
            if on_round is not None:
                on_round(round_)
        stats.seconds = time.perf_counter() - start
        return result

    def rounds(self, prompt_ids: list[int], config: GenerationConfig, policy: Policy,
               grammar: Grammar | None = None, stop: StopCondition | None = None) -> Iterator[Round]:
        """The step loop, with ``policy`` choosing each round's draft length, over one :class:`Sequence`'s round.
        The target's cache holds every context token but the last, which is scored next. Under a ``grammar``, an
        end token ends it whatever ``stop_at_eos`` says, and so does a grammar that admits nothing more; so does a
        ``stop`` condition (stop strings) that is met."""
        if not prompt_ids:
            raise UsageError("the prompt is empty")
        self.check_tree(config.tree)
        if grammar is not None and config.tree is not None:
            raise UsageError("a grammar constrains a chain of draft tokens, not a tree: drop --tree")
        max_length = self.target.max_length
        if len(prompt_ids) >= max_length:
            raise UsageError(f"the prompt has {len(prompt_ids)} tokens; the model takes at most {max_length - 1}")
        sequence = Sequence(prompt_ids, config.max_new_tokens, max_length, config.sampling,
                            make_generator(config.seed, self.target.device), self.proposer,
                            self.eos_token_ids, stop_at_eos=config.stop_at_eos, adjustment=config.adjustment,
                            grammar=grammar, stop=stop, logprobs=config.logprobs)
        self.target.reserve(min(len(prompt_ids) + config.max_new_tokens
                                + config.draft_positions(config.max_draft_tokens) + 1, max_length))
        started = time.perf_counter()  # a prefix an earlier request left is reused where its bits are a prefill's
        policy.observe_prefill(prefill(self.target, prompt_ids[:-1]), time.perf_counter() - started)
        while sequence.finished is None:
            # 1. ask the policy how far to draft (the drafter's backlog counted); a round emits at most k+1 tokens
            asked = policy.next_k(config.max_draft_tokens, sequence.backlog, sequence.remaining)
            k = fitted_depth(config.tree, min(asked, sequence.room), sequence.room, policy)
            # 2. draft, after the drafter's catching up on rounds it missed, which is timed apart (Sequence.catch_up)
            started = time.perf_counter()
            backlog = sequence.catch_up(k)
            if backlog:
                policy.observe_catch_up(backlog, time.perf_counter() - started)
            started = time.perf_counter()
            features = self.target.hidden_states if self.reads_features and k else None
            draft = sequence.draft(k, config.tree_widths(k, policy), features)
            drafted = time.perf_counter()
            if isinstance(policy, PlannedByDrafter):
                asked = draft.proposed  # the drafter chose the length within the cap
            # 3-5. score the pending token and the draft in one target pass, verify, keep the accepted tokens
            logits, verdict = self._score_and_verify(sequence, draft)
            verified = time.perf_counter()  # verify_* read results on the host: the device has finished
            policy.observe(verdict, drafted - started, verified - drafted)
            # 6. emit, cut at EOS, a stop string and the token limit
            yield sequence.emit(draft, verdict, logits, asked, drafted - started, verified - drafted)

    def _score_and_verify(self, sequence: Sequence, draft: Draft) -> tuple[torch.Tensor, Verdict | TreeVerdict]:
        """One target pass over the pending token and the draft (a chain, or a tree with its attention mask), its
        logits as the sequence reads them ([n+1, vocab]), the verdict, and the target's cache cut to the accepted
        tokens (a tree's accepted branch moved into place)."""
        cached = len(self.target.tokens)
        pending = sequence.context[-1]
        if draft.parents is None:
            logits = self.target.extend([pending] + draft.tokens, num_logits=len(draft) + 1)  # [k+1, V]
        else:
            logits = self.target.extend_tree([pending] + draft.tokens, row_parents(draft))
        logits = sequence.adjusted(draft, logits)
        verdict = sequence.verify(draft, logits)
        if draft.parents is None:
            self.target.rollback(cached + 1 + verdict.accepted)
        else:
            self.target.keep_path(cached, path_rows(verdict))
        return logits, verdict

    def check_tree(self, tree: tuple[int, ...] | str | None) -> None:
        """Refuse a tree that this proposer cannot draft or this target cannot score."""
        if tree is None:
            return
        if not declares(self.proposer, TreeProposer):
            raise UsageError(f"--drafter {self.proposer.name} drafts chains only, not trees")
        require(self.target, TreeScorer, "a token tree", "use --backend lean (on llama.cpp a pass over several "
                "positions costs nearly that many passes over one, so trees cannot pay there)")

    def policy(self, num_draft_tokens: int | str, tree: tuple[int, ...] | str | None = None) -> Policy:
        """A fixed draft length, or the engine's adaptive policy of that name (kept, so it learns across requests);
        with ``tree="auto"``, its tree policy (the depth capped at a fixed k). A drafter that plans its own rounds
        (the hybrid) drafts up to k (with ``auto``, up to AUTO_MAX_K) as its own cost model chooses."""
        if declares(self.proposer, PlansRounds) and tree is None:
            auto = isinstance(num_draft_tokens, str)
            return PlannedByDrafter(self.proposer, AUTO_MAX_K if auto else num_draft_tokens,
                                    "auto" if auto else "fixed")
        if isinstance(num_draft_tokens, int) and tree != "auto":
            return make_policy(num_draft_tokens)
        name = "auto-tree" if tree == "auto" else num_draft_tokens
        if name not in self.policies:
            self.policies[name] = make_policy(num_draft_tokens, tree)
        return self.policies[name]
