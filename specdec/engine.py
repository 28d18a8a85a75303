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

from specdec.backends.base import CausalLM, FeatureSource, TreeScorer, declares, prefill, require
from specdec.choices import MAX_TREE_WIDTH, check_max_new_tokens, check_num_draft_tokens, check_tree
from specdec.errors import UsageError
from specdec.policy import AUTO_MAX_K, AUTO_TREE_MAX_NODES, Policy, make_policy
from specdec.proposers.base import EMPTY_DRAFT, CatchesUp, Draft, FeatureProposer, Proposer, TreeProposer
from specdec.sampling import SamplingParams
from specdec.step import (
    DraftTotals,
    PositionCounts,
    Round,
    constrained_draft,
    constrained_round,
    emitted_round,
    make_generator,
    verify_draft,
    verify_draft_tree,
)
from specdec.verify import TreeVerdict, Verdict

if TYPE_CHECKING:
    from specdec.grammars import Grammar


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

    def __post_init__(self) -> None:
        check_max_new_tokens(self.max_new_tokens)
        check_num_draft_tokens(self.num_draft_tokens)
        check_tree(self.tree)

    def tree_widths(self, depth: int, policy: Policy | None = None) -> list[int] | None:
        """The candidates at each depth of a tree ``depth`` deep (with ``auto``, the shape ``policy`` chose);
        None for a chain."""
        if self.tree is None:
            return None
        if self.tree == "auto":
            return policy.tree_widths(depth)
        return [self.tree[min(d, len(self.tree) - 1)] for d in range(depth)]

    @property
    def max_draft_tokens(self) -> int:
        """The longest draft a round may ask for."""
        return AUTO_MAX_K if isinstance(self.num_draft_tokens, str) else self.num_draft_tokens

    def draft_positions(self, depth: int) -> int:
        """Positions a draft ``depth`` deep takes in the target's pass, at most: its tokens, or its tree's nodes."""
        if self.tree == "auto":
            return min(depth * MAX_TREE_WIDTH, AUTO_TREE_MAX_NODES)
        return depth if self.tree is None else sum(self.tree_widths(depth))


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

    def record(self, round_: Round) -> None:
        self.rounds += 1
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
        }


@dataclass
class GenerationResult:
    token_ids: list[int]  # generated ids only
    stats: GenerationStats
    kinds: list[str]  # per generated token, how it came (see Round.kinds)


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
    ) -> GenerationResult:
        """Generate up to config.max_new_tokens tokens; ``on_round`` sees each round as it is emitted. A
        ``grammar`` (a fresh matcher: ``grammars.grammar_for``) constrains them."""
        policy = self.policy(config.num_draft_tokens, config.tree)
        stats = GenerationStats(policy=policy.name)
        token_ids: list[int] = []
        kinds: list[str] = []
        start = time.perf_counter()
        for round_ in self.rounds(prompt_ids, config, policy, grammar):
            stats.record(round_)
            token_ids += round_.tokens
            kinds += round_.kinds
            if on_round is not None:
                on_round(round_)
        stats.seconds = time.perf_counter() - start
        return GenerationResult(token_ids=token_ids, stats=stats, kinds=kinds)

    def rounds(self, prompt_ids: list[int], config: GenerationConfig, policy: Policy,
               grammar: Grammar | None = None) -> Iterator[Round]:
        """The step loop, with ``policy`` choosing each round's draft length. The target's cache holds every
        context token but the last, which is scored next. Under a ``grammar``, an end token ends it whatever
        ``stop_at_eos`` says, and so does a grammar that admits nothing more."""
        if not prompt_ids:
            raise UsageError("the prompt is empty")
        self.check_tree(config.tree)
        if grammar is not None and config.tree is not None:
            raise UsageError("a grammar constrains a chain of draft tokens, not a tree: drop --tree")
        params = config.sampling
        generator = make_generator(config.seed, self.target.device)
        stop_ids = self.eos_token_ids if config.stop_at_eos or grammar is not None else frozenset()
        max_length = self.target.max_length
        context = list(prompt_ids)
        if len(context) >= max_length:
            raise UsageError(f"the prompt has {len(context)} tokens; the model takes at most {max_length - 1}")
        self.target.reserve(min(len(context) + config.max_new_tokens + config.draft_positions(config.max_draft_tokens)
                                + 1, max_length))
        prefill(self.target, context[:-1])  # reusing a prefix an earlier request left where its bits are a prefill's
        produced, lagging = 0, True  # lagging: the drafter has not seen the last round (none has run yet)
        while produced < config.max_new_tokens:
            remaining = config.max_new_tokens - produced
            # 1. ask the policy how far to draft; a round emits at most k+1 tokens
            asked = policy.next_k(config.max_draft_tokens)
            room = min(remaining - 1, max_length - len(context) - 1)  # the draft positions this round may score
            k = min(asked, room)
            while config.draft_positions(k) > room:
                k -= 1
            # 2. draft; a drafter that keeps state first takes in the rounds it missed, untimed: that backlog (the
            # prompt, or the tokens of rounds that drafted nothing) is not what drafting k tokens costs
            if k and lagging and declares(self.proposer, CatchesUp):
                self.proposer.catch_up(context)
            lagging = k == 0
            started = time.perf_counter()
            if grammar is None:
                draft = self._propose(context, k, config.tree_widths(k, policy), config.sampling, generator)
            else:
                def propose(forced: list[int], n: int, context=context) -> Draft:
                    return self._propose(context + forced, n, None, params, generator)

                draft = constrained_draft(grammar, k, room, propose)
            drafted = time.perf_counter()
            # 3-5. score the pending token and the draft in one target pass, verify, keep the accepted tokens
            verdict = self._score_and_verify(context[-1], draft, params, generator, grammar)
            verified = time.perf_counter()  # verify_* read results on the host: the device has finished
            policy.observe(verdict, drafted - started, verified - drafted)
            # 6. emit, cut at EOS and at the token limit
            round_ = emitted_round(draft, verdict, remaining, stop_ids, drafted - started, verified - drafted, asked)
            if grammar is not None:
                round_ = constrained_round(grammar, round_)
            context += round_.tokens
            produced += len(round_.tokens)
            yield round_
            if round_.tokens[-1] in stop_ids or len(context) >= max_length or grammar is not None and grammar.stopped:
                return

    def _propose(self, context: list[int], k: int, widths: list[int] | None, params: SamplingParams,
                 generator: torch.Generator) -> Draft:
        if k == 0:
            return EMPTY_DRAFT
        features = {"features": self.target.hidden_states} if self.reads_features else {}
        if widths is None:
            return self.proposer.propose(context, k, params, generator, **features)
        return self.proposer.propose_tree(context, widths, params, generator, **features)

    def _score_and_verify(self, pending: int, draft: Draft, params: SamplingParams, generator: torch.Generator,
                          grammar: Grammar | None = None) -> Verdict | TreeVerdict:
        """One target pass over the pending token and the draft (a chain, or a tree with its attention mask), the
        verdict (on logits the grammar masks), and the target's cache cut to the accepted tokens (a tree's accepted
        branch moved into place)."""
        cached = len(self.target.tokens)
        position = cached + 1  # of the token that follows the pending one
        if draft.parents is None:
            logits = self.target.extend([pending] + draft.tokens, num_logits=len(draft) + 1)  # [k+1, V]
            if grammar is not None:
                logits = grammar.masked(logits, draft.tokens)
            verdict = verify_draft(draft, logits, params, generator, position)
            self.target.rollback(cached + 1 + verdict.accepted)
            return verdict
        logits = self.target.extend_tree([pending] + draft.tokens, [-1] + [p + 1 for p in draft.parents])  # [m+1, V]
        verdict = verify_draft_tree(draft, logits, params, generator, position)
        self.target.keep_path(cached, [0] + [node + 1 for node in verdict.path])
        return verdict

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
        with ``tree="auto"``, its tree policy (the depth capped at a fixed k)."""
        if isinstance(num_draft_tokens, int) and tree != "auto":
            return make_policy(num_draft_tokens)
        name = "auto-tree" if tree == "auto" else num_draft_tokens
        if name not in self.policies:
            self.policies[name] = make_policy(num_draft_tokens, tree)
        return self.policies[name]
