"""The ``draft-model`` drafter: a smaller causal LM drafts autoregressively, with the target's vocabulary or its own.

It keeps its own KV cache. Before each proposal the cache is cut back to the longest prefix it shares with the
context (:func:`sync`), so that rejected draft tokens are forgotten without the engine telling it what
happened.

A draft model with another tokenizer (:class:`ForeignDraftProposer`) reads the target's context as text in its own
tokens (``vocabularies.ContextBridge``) and proposes target tokens in one of two ways (Timor et al., ICML 2025):
``text``, string-level exact match (its text re-encoded by the target's tokenizer, the part whose tokens are
settled), or ``intersection``, its distribution restricted to the tokens both vocabularies hold, so that it drafts
target tokens with a proper q.

Either reads a long context through a :class:`ContextWindow`: its first tokens and its last ``DRAFT_WINDOW`` or so,
so that a 2,000-token prompt costs the draft about a window's catch-up, not 2,000 tokens. Only acceptance moves:
exactness is the verifier's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from exactspec.backends.base import CausalLM, DraftsChains, before_lead, declares, feed_before_lead, lead_of, sync
from exactspec.choices import CROSS_VOCABULARY_METHODS
from exactspec.errors import UsageError
from exactspec.proposers.base import (
    EMPTY_DRAFT,
    CatchesUp,
    Draft,
    DraftsUnderGrammar,
    Guide,
    Role,
    TreeProposer,
    draft_of,
    spine_tree,
)
from exactspec.sampling import SamplingParams, draft_token, gumbel_noise_at, noise_seed, ranked
from exactspec.vocabularies import LOW_OVERLAP, ContextBridge, SharedTokens

# What a draft model reads of a long context (ContextWindow): its first DRAFT_WINDOW_HEAD tokens, where the system
# prompt, the instruction and the start of a document stand, and its last DRAFT_WINDOW (up to twice that before the
# cut moves on): a first catch-up of at most 768 tokens, where a 2,000-token prompt's was 2,000. Measured (issue 61)
# with Qwen2.5-Coder-0.5B's draft-grade copy drafting for the 1.5B on Spec-Bench's summarization and rag (prompts of
# the first 68 of each, none of the 12 held out): the draft's greedy agreement with the target's 64 plain tokens, fed
# them (a first-position acceptance), against the draft reading the whole context:
#                              summarization         rag            6 longest summ.   4 longest rag
#                              (8: 422-1154 tok.)    (8: 671-805)   (1298-1517)       (853-872)
#   whole context              0.869                 0.792          0.797             0.798
#   head 32,  window 512       0.508                 0.772
#   head 128, window 256       0.766                 0.745
#   head 256, window 256       0.857                 0.762          0.721             0.829
#   head 256, window 512       0.871                 0.792          0.732             0.815
#   head 384, window 384                                            0.766             0.811
#   head 512, window 128                                            0.784             0.782
#   head 512, window 256       0.867                 0.792          0.763             0.769
#   head 512, window 512                                            0.779             0.798
#   head 768, window 256                                            0.786             0.798
# A summary copies its document's lead, which a 32-token head (the 23-token system turn and a line) leaves out
# (windows of 64-512 tokens behind it: 0.28-0.45 where the whole reads 0.86, first 4 prompts); a 512-token head
# keeps it, and past it the window's width moves little. Spec-Bench's usual prompts (medians 694 and 753 tokens) are
# read whole. In chains (k = 4, bench/draft_window.py, greedy, 2 shared cores) on the 2 longest summarization prompts
# (1473, 1517 tokens): acceptance 64.3% whole, 57.9% here (50.0% with a 256-token head), the draft's catch-up 15.3 s
# and 8.3 s, a request of 64 new tokens 0.80x and 0.88x plain decoding's speed (its target prefill included); on
# rag's 2 longest (867, 872) 70.5% both, 9.6 s and 8.3 s.
DRAFT_WINDOW_HEAD = 512
DRAFT_WINDOW = 256


@dataclass
class ContextWindow:
    """A draft model's view of a growing id list: its first ``head`` ids, then its ids from a cut point on, so that a
    long context costs the draft about ``width`` tokens of catch-up, not all of them (``width`` None: the whole list).

    The view grows as the list grows, so that ``sync`` keeps the draft's cache and feeds it only the new ids: the
    cut is made once a sequence's list first holds more than head + width ids (``width`` ids after it), and moved
    only when the ids past it exceed ``2 * width`` (one catch-up of ``width`` ids). A list that does not continue the
    one the cut was made for (its ids before the cut differ) is another sequence, cut afresh. The draft reads its
    view at the view's own positions: compressed, which moves only how well it drafts."""

    width: int | None = DRAFT_WINDOW
    head: int = DRAFT_WINDOW_HEAD
    _before: list[int] = field(default_factory=list, init=False, repr=False)  # the ids before the cut (none: none)

    def __post_init__(self) -> None:
        if self.width is not None and self.width < 1:
            raise UsageError(f"a draft model's context window must be at least one token, not {self.width}")

    def view(self, ids: list[int]) -> list[int]:
        """The ids the draft reads of ``ids``: all of them, or the head and the ids from the cut on."""
        if self.width is None:
            return ids
        cut = self._cut(ids)
        self._before = ids[:cut]
        return ids[: self.head] + ids[cut:] if cut else ids

    def peek(self, ids: list[int]) -> list[int]:
        """What ``view`` would give for ``ids``, the cut left where it is."""
        cut = 0 if self.width is None else self._cut(ids)
        return ids[: self.head] + ids[cut:] if cut else ids

    def _cut(self, ids: list[int]) -> int:
        """Where the view of ``ids`` is cut (0: it is not)."""
        cut = len(self._before)
        if cut and ids[:cut] != self._before:
            cut = 0  # another sequence
        if len(ids) - (cut or self.head) > (2 if cut else 1) * self.width:
            cut = len(ids) - self.width
        return cut

    def unview(self, cached: list[int]) -> list[int]:
        """The ids a draft cache of this window's view stands for (``cached``: a view and the tokens drafted after
        it): the ids before the cut put back. A cache that is no view of the current cut is returned as it is."""
        cut = len(self._before)
        if not cut or len(cached) < self.head or cached[: self.head] != self._before[: self.head]:
            return cached
        return self._before + cached[self.head:]

    def forget(self) -> None:
        """Start afresh: the next list is cut as a new sequence's."""
        self._before = []


class _ChainsInOneCall:
    """A draft model's proposer whose chains go in one call where its model and the sampling allow."""

    model: CausalLM

    def _chains_in_one_call(self, params: SamplingParams) -> bool:
        return chains_in_one_call(self.model, params)


class DraftModelProposer(_ChainsInOneCall, TreeProposer, CatchesUp, DraftsUnderGrammar):
    name = "draft-model"

    def __init__(self, model: CausalLM, target_vocab_size: int, window: int | None = DRAFT_WINDOW,
                 head: int = DRAFT_WINDOW_HEAD) -> None:
        """``window``, ``head``: the recent tokens of a long context the draft model reads, and its first ones
        (:class:`ContextWindow`; window None: all of it)."""
        if model.vocab_size > target_vocab_size:
            raise UsageError(
                f"the draft model's logits are wider ({model.vocab_size}) than the target's ({target_vocab_size})"
            )
        self.model = model
        self.target_vocab_size = target_vocab_size
        self.window = ContextWindow(window, head)

    def propose(self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator | None,
                guide: Guide | None = None) -> Draft:
        if guide is not None:
            seen = self.window.view(context)
            if not k or not self._embeds(seen):
                return EMPTY_DRAFT
            logits = sync(self.model, seen, num_logits=1)[0]  # [vocab_d]
            return guided_chain(self._wide(logits), k, params, generator, len(context), guide, self._step)
        tokens, rows, _ = self._chain(context, [1] * k, params, generator)
        return draft_of(tokens, rows)

    def _step(self, tokens: list[int]) -> torch.Tensor | None:
        """The draft model's logits after ``tokens`` (None where it cannot embed one)."""
        if max(tokens) >= self.model.vocab_size:
            return None
        return self._wide(self.model.extend(tokens, num_logits=1)[0])

    def _wide(self, logits: torch.Tensor) -> torch.Tensor:  # [vocab_d] -> [target vocab]
        """Draft logits over the target's width; ids the draft model lacks at -inf (q = 0)."""
        return F.pad(logits, (0, self.target_vocab_size - logits.shape[-1]), value=float("-inf"))

    def propose_tree(self, context: list[int], widths: list[int], params: SamplingParams,
                     generator: torch.Generator | None) -> Draft:
        """The draft model's chain, and beside each of its tokens the next best, widths[d] candidates at depth d."""
        tokens, rows, alternatives = self._chain(context, widths, params, generator)
        return spine_tree(tokens, rows, alternatives) if tokens else EMPTY_DRAFT

    def _chain(self, context: list[int], widths: list[int], params: SamplingParams,
               generator: torch.Generator | None) -> tuple[list[int], list, list[list[int]]]:
        """len(widths) tokens drafted autoregressively (and their distributions), with the ``widths[d] - 1`` tokens
        the draft model ranks next at each. The draft reads its window's view of the context; the tokens are drawn
        at the context's own positions, as the target draws them."""
        seen = self.window.view(context)
        if not widths or not self._embeds(seen):
            return [], [], []
        if self._chains_in_one_call(params):
            return self._one_call_chain(seen, len(context), widths, params, generator)
        logits = sync(self.model, seen, num_logits=1)[0]  # [vocab_d]: rejected draft tokens are dropped here
        tokens: list[int] = []
        rows: list[torch.Tensor | None] = []
        alternatives: list[list[int]] = []
        for i, width in enumerate(widths):
            token, probs = draft_token(logits, params, generator, len(context) + i)
            tokens.append(token)
            rows.append(None if probs is None else self._pad(probs))
            alternatives.append(ranked(logits, width - 1, exclude=token) if width > 1 else [])
            if i < len(widths) - 1:
                logits = self.model.extend([token], num_logits=1)[0]
        return tokens, rows, alternatives

    def _one_call_chain(self, seen: list[int], position: int, widths: list[int], params: SamplingParams,
                        generator: torch.Generator | None) -> tuple[list[int], list, list[list[int]]]:
        """_chain's tokens and alternatives in one call: the cache synced to the draft's view ``seen`` but its lead
        (``lead_of``), which the call feeds; under the invariant sampler, each depth's noise over the head's ids at
        its position in the context (the first at ``position``), as the target will draw it."""
        k = len(widths)
        noise = None if params.greedy else \
            chain_noise(self.model.chain_ids, noise_seed(generator), range(position, position + k))
        tokens, alternatives = self.model.draft_chain(lead_of(self.model, seen), k, max(widths), noise,
                                                      params.temperature or 1.0)
        return tokens, [None] * k, [others[: width - 1] for others, width in zip(alternatives, widths)]

    def catch_up(self, context: list[int]) -> None:
        seen = self.window.view(context)
        if self._embeds(seen):
            feed_before_lead(self.model, seen)

    def backlog(self, context: list[int]) -> int:
        seen = self.window.peek(context)
        return before_lead(self.model, seen) if self._embeds(seen) else 0

    def _embeds(self, ids: list[int]) -> bool:
        """Whether the draft model can embed every one of ``ids`` (a wider target's may lie past its own)."""
        return max(ids) < self.model.vocab_size

    def clear_cache(self) -> None:
        self.model.rollback(0)
        self.window.forget()

    def _pad(self, probs: torch.Tensor) -> torch.Tensor:  # [vocab_d] -> [target vocab]
        """Draft probabilities over the target's logit width; ids the draft model lacks get q = 0."""
        return F.pad(probs, (0, self.target_vocab_size - probs.shape[-1]))


def chains_in_one_call(model: CausalLM, params: SamplingParams) -> bool:
    """Whether a draft model drafts a chain in one call (DraftsChains): where it can here, and where each token is a
    choice it makes itself over its head's logits (greedy, or the invariant sampler's Gumbel-max with nothing cut by
    top-k or top-p); a draw with a distribution, or a grammar, chains in Python."""
    choice = params.greedy or (params.invariant and params.top_k == 0 and params.top_p == 1.0)
    return choice and declares(model, DraftsChains) and model.chain_ids is not None


def chain_noise(ids: torch.Tensor, seed: int, positions: range) -> torch.Tensor:  # [len(positions), len(ids)] float64
    """The invariant sampler's noise at each position over a head's ``ids``: the target's noise at those ids."""
    return torch.stack([gumbel_noise_at(seed, position, ids) for position in positions])


@dataclass(frozen=True)
class ForeignDraft:
    """A draft model with another tokenizer than the target's: the model, the bridge between the two texts, and how
    it proposes (``CROSS_VOCABULARY_METHODS``)."""

    model: CausalLM
    bridge: ContextBridge
    method: str = "auto"
    shared: SharedTokens | None = None  # the tokens both vocabularies hold (made once, when not given)
    overlap: float = 1.0  # the share of the target's frequent tokens the draft holds (vocabularies.frequent_overlap)

    def __post_init__(self) -> None:
        if self.shared is None:
            object.__setattr__(self, "shared", SharedTokens.of(self.bridge.target, self.bridge.draft))

    def on(self, model: CausalLM) -> ForeignDraft:
        """The same draft for another sequence (a server's request): ``model`` over the same weights, a bridge of
        its own (it remembers its sequence's prompt), the tokenizers and shared tokens read once."""
        return replace(self, model=model, bridge=self.bridge.fresh())


class ForeignDraftProposer(_ChainsInOneCall, TreeProposer, CatchesUp, DraftsUnderGrammar):
    """A draft model with its own vocabulary: ``text`` proposes the target's tokens of its text (the draft's mode,
    point masses); ``intersection`` drafts among the tokens both vocabularies hold, sampled as a same-vocabulary
    draft is (a proper q; under the invariant sampler, noise keyed by the target's ids and positions). ``auto``, as
    measured on the 1.5B (docs/benchmarks.md, issue 36): greedy, the shared tokens, where the draft holds at least
    half of the target's frequent tokens (each proposed token one draft pass, where text needs one more a round to
    settle its last token); when sampling, text (a small draft's mode, re-encoded, is accepted more often than its
    draw among the shared tokens, coupled noise or not); text too where the draft holds under half. Trees draft
    among the shared tokens."""

    name = "draft-model"

    def __init__(self, source: ForeignDraft, target_vocab_size: int, window: int | None = DRAFT_WINDOW,
                 head: int = DRAFT_WINDOW_HEAD) -> None:
        """``window``, ``head``: the recent tokens of a long context the draft model reads, and its first ones, in
        its own tokens (:class:`ContextWindow`; window None: all of it)."""
        if source.method not in CROSS_VOCABULARY_METHODS:
            raise UsageError(f"the cross-vocabulary method must be one of {', '.join(CROSS_VOCABULARY_METHODS)}, "
                             f"not {source.method!r}")
        self.model = source.model
        self.bridge = source.bridge
        self.method = source.method
        self.target_vocab_size = target_vocab_size
        self.shared = source.shared
        self.overlap = source.overlap
        self._targets: torch.Tensor | None = None  # the target's id of each head row's token (_row_targets)
        self.window = ContextWindow(window, head)

    def propose(self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator | None,
                guide: Guide | None = None) -> Draft:
        """Under a grammar's ``guide``, among the shared tokens it allows (text would be cut at its first token the
        grammar forbids)."""
        if k == 0:
            return EMPTY_DRAFT
        if guide is not None:
            return self._guided(context, k, params, generator, guide)
        if self.method == "text" or (self.method == "auto" and (not params.greedy or self.overlap < LOW_OVERLAP)):
            return self._text_draft(context, k)
        tokens, rows, _ = self._shared_chain(context, [1] * k, params, generator)
        return draft_of(tokens, rows)

    def _guided(self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator | None,
                guide: Guide) -> Draft:
        ids, pending = self._draft_context(context)
        if not ids or pending:  # the draft's context must reach the target's last byte
            return EMPTY_DRAFT
        first = self.shared.target_logits(sync(self.model, ids, num_logits=1)[0], self.target_vocab_size)

        def step(tokens: list[int]) -> torch.Tensor | None:
            if any(token not in self.shared.draft_of for token in tokens):
                return None
            logits = self.model.extend([self.shared.draft_of[token] for token in tokens], num_logits=1)[0]
            return self.shared.target_logits(logits, self.target_vocab_size)

        return guided_chain(first, k, params, generator, len(context), guide, step)

    def propose_tree(self, context: list[int], widths: list[int], params: SamplingParams,
                     generator: torch.Generator | None) -> Draft:
        tokens, rows, alternatives = self._shared_chain(context, widths, params, generator)
        return spine_tree(tokens, rows, alternatives) if tokens else EMPTY_DRAFT

    def catch_up(self, context: list[int]) -> None:
        ids, _ = self._draft_context(context)
        if ids:
            feed_before_lead(self.model, ids)

    def backlog(self, context: list[int]) -> int:
        ids, _ = self.bridge.draft_context(context, self.window.unview(self.model.tokens))
        return before_lead(self.model, self.window.peek(ids)) if ids else 0

    def clear_cache(self) -> None:
        self.model.rollback(0)
        self.window.forget()

    def _draft_context(self, context: list[int]) -> tuple[list[int], bytes]:
        """What the draft reads of the target's ``context``: its window's view of the draft's own tokens for it
        (``ContextBridge.draft_context``, which reuses the tokens the draft wrote, read back through the view), and
        the target's bytes past them. The view ends where those tokens end, so it reaches the same byte."""
        ids, pending = self.bridge.draft_context(context, self.window.unview(self.model.tokens))
        return self.window.view(ids), pending

    def _text_draft(self, context: list[int], k: int) -> Draft:
        """String-level exact match: the draft model writes on greedily (its text is proposed as point masses,
        each accepted with the target's probability of it: the draft's mode is its best guess at any temperature)
        until its text holds k target tokens whose tokenisation is settled (all but the last, unless its text
        ended), at most 2(k+1) of its own tokens; the target's tokenizer reads that text past what the target has
        written."""
        ids, pending = self._draft_context(context)
        if not ids:
            return EMPTY_DRAFT
        logits = sync(self.model, ids, num_logits=1)[0]  # [vocab_d]
        drafted: list[int] = []
        proposal: list[int] = []
        while True:
            token = int(logits.argmax())  # a point mass is accepted with the target's probability of it: the mode
            drafted.append(token)
            ended = token in self.bridge.draft.control
            proposal = self._settled(self.bridge.draft.text_of(drafted), pending, ended)
            if ended or len(proposal) >= k or len(drafted) >= 2 * (k + 1):
                break
            logits = self.model.extend([token], num_logits=1)[0]
        return Draft(tokens=proposal[:k])

    def _settled(self, text: bytes, pending: bytes, ended: bool) -> list[int]:
        """The target's tokens of the draft's ``text`` past ``pending`` (what the target wrote that the draft's
        context did not hold): none if the text does not begin with it; the last left out unless the text ended,
        since more text could merge into it."""
        if not text.startswith(pending):
            return []
        new = text[len(pending):]
        tokens, consumed = self.bridge.target.encode(new, final=ended)
        if not (ended and consumed == len(new)):
            tokens = tokens[:-1]
        valid = 0
        while valid < len(tokens) and 0 <= tokens[valid] < self.target_vocab_size:
            valid += 1
        return tokens[:valid]

    def _shared_chain(self, context: list[int], widths: list[int], params: SamplingParams,
                      generator: torch.Generator | None) -> tuple[list[int], list, list[list[int]]]:
        """Token-level intersection: len(widths) target tokens drafted from the draft's distribution over the
        shared tokens (renormalised, the target's sampling settings applied, at the target's positions), with the
        ``widths[d] - 1`` shared tokens it ranks next at each depth."""
        ids, pending = self._draft_context(context)
        if not ids or pending:  # the draft's context must reach the target's last byte
            return [], [], []
        if self._chains_in_one_call(params):
            return self._one_call_shared_chain(context, ids, widths, params, generator)
        logits = sync(self.model, ids, num_logits=1)[0]  # [vocab_d]
        tokens: list[int] = []
        rows: list[torch.Tensor | None] = []
        alternatives: list[list[int]] = []
        for i, width in enumerate(widths):
            over_target = self.shared.target_logits(logits, self.target_vocab_size)  # [target vocab]
            token, probs = draft_token(over_target, params, generator, len(context) + i)
            tokens.append(token)
            rows.append(probs)
            others = ranked(over_target, width - 1, exclude=token) if width > 1 else []
            alternatives.append([t for t in others if over_target[t] > float("-inf")])
            if i < len(widths) - 1:
                logits = self.model.extend([self.shared.draft_of[token]], num_logits=1)[0]
        return tokens, rows, alternatives


    def _one_call_shared_chain(self, context: list[int], ids: list[int], widths: list[int], params: SamplingParams,
                               generator: torch.Generator | None) -> tuple[list[int], list, list[list[int]]]:
        """_shared_chain's tokens and alternatives in one call over the draft's context ``ids``: its head's rows
        allowed where their tokens are shared, each chosen row's token the target's of the same text; under the
        invariant sampler, each depth's noise at the target's ids and positions, as the target will draw it."""
        lead = lead_of(self.model, ids)
        targets = self._row_targets()  # [rows]: the target's id of each head row's token, -1 where not shared
        k = len(widths)
        noise = None
        if not params.greedy:
            noise = chain_noise(targets.clamp(min=0), noise_seed(generator), range(len(context), len(context) + k))
        drafted, ranked_rows = self.model.draft_chain(lead, k, max(widths), noise, params.temperature or 1.0,
                                                      targets >= 0)
        tokens = [self.shared.target_of[token] for token in drafted]
        alternatives = [[t for t in dict.fromkeys(self.shared.target_of[o] for o in others) if t != token][: w - 1]
                        for others, token, w in zip(ranked_rows, tokens, widths)]
        return tokens, [None] * k, alternatives

    def _row_targets(self) -> torch.Tensor:  # [rows] long
        """The target's id of the token each of the draft's head rows stands for (-1 where the target lacks it),
        made once."""
        if self._targets is None:
            self._targets = torch.tensor([self.shared.target_of.get(int(token), -1)
                                          for token in self.model.chain_ids.tolist()], dtype=torch.long)
        return self._targets


def guided_chain(logits: torch.Tensor, k: int, params: SamplingParams, generator: torch.Generator | None,
                 position: int, guide: Guide, step: Callable[[list[int]], torch.Tensor | None]) -> Draft:
    """A chain of at most k drafted tokens under a grammar's ``guide``, with the tokens it forces after each, from
    a draft model's ``logits`` [width] for the token at absolute ``position``: each token drafted among those the
    guide allows (the logits of the rest at -inf, so a draw's q is renormalised over the allowed), then the tokens
    the guide forces after it (point masses: one-hot rows where the drafted tokens have distributions), all fed
    back through ``step`` (the model's logits after them, or None where it cannot read one: the chain ends there).
    It ends early where nothing the model can draft is allowed, or the guide says the draft is full."""
    tokens: list[int] = []
    rows: list[torch.Tensor | None] = []
    fed: list[int] = []  # the last drafted token and those forced after it, fed only where the chain goes on
    for _ in range(k):
        allowed = guide.allowed()
        if allowed is None:
            break
        if fed:
            logits = step(fed)
            if logits is None:
                break
        mask = torch.from_numpy(allowed[: logits.shape[-1]]).to(logits.device)
        if mask.shape[0] < logits.shape[-1]:
            mask = F.pad(mask, (0, logits.shape[-1] - mask.shape[0]))
        masked = logits.masked_fill(~mask, float("-inf"))
        if not bool(torch.isfinite(masked).any()):
            break
        token, probs = draft_token(masked, params, generator, position + len(tokens))
        forced = guide.take(token)
        fed = [token, *forced]
        tokens += fed
        rows += [probs] + [None if probs is None else F.one_hot(torch.tensor(t, device=probs.device),
                                                               probs.shape[-1]).to(probs.dtype) for t in forced]
    return draft_of(tokens, rows)


# a second model drafts: --draft-model PATH (its own runtime, any tokenizer), or a trained draft LM (exactspec train)
ROLE = Role(needs_draft_model=True, trained=True)


def make(target: CausalLM, source: CausalLM | ForeignDraft | None, datastore, window: int | None = DRAFT_WINDOW,
         head: int = DRAFT_WINDOW_HEAD) -> DraftModelProposer | ForeignDraftProposer:
    """A draft model's proposer: ``source`` is the draft model (loading.draft_source finds it), or a
    :class:`ForeignDraft` where its tokenizer is not the target's; reading a long context's first ``head`` tokens and
    its recent ``window`` (:class:`ContextWindow`; window None: all of it)."""
    if source is None:
        raise UsageError("--drafter draft-model needs a draft model: --draft-model PATH, --drafter-path DIR, or the "
                         "default target (whose trained draft model ships with exactspec)")
    if isinstance(source, ForeignDraft):
        return ForeignDraftProposer(source, target_vocab_size=target.vocab_size, window=window, head=head)
    return DraftModelProposer(source, target_vocab_size=target.vocab_size, window=window, head=head)
