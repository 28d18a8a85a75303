"""What a server batches: its settings (:class:`BatchSettings`, which check themselves), the pool of KV-cache slots
over the target runtime's weights, and the scheduler over that pool with its drafters and planner."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from exactspec.backends import pool_of
from exactspec.backends.base import (
    FeatureSource,
    Pooled,
    PooledSequence,
    SequencePool,
    SlotFeatures,
    TreeScorer,
    declares,
    require,
)
from exactspec.backends.lockstep import LockstepPool
from exactspec.choices import DEFAULT_DRAFTER, SPECULATION_MODES, check_datastore_drafter, check_tree
from exactspec.costs import MeasuredPassCosts
from exactspec.errors import UsageError
from exactspec.logs import notice
from exactspec.proposers import PROPOSERS, role
from exactspec.proposers.base import Proposer, Role, SharesPlan
from exactspec.proposers.hybrid import HybridSources, sources_of
from exactspec.proposers.retrieval import ChainedIndex, SharedIndex
from exactspec.server.prefixes import prefix_cache
from exactspec.server.scheduler import Scheduler
from exactspec.server.speculation import SpeculationPlanner


@dataclass(frozen=True)
class BatchSettings:
    speculation: str = "auto"  # auto, always or never
    drafter: str = DEFAULT_DRAFTER
    num_draft_tokens: int = 4  # the most draft tokens per request per step
    max_batch_size: int = 64  # requests decoded together (KV-cache slots)
    max_model_len: int = 2048  # prompt + output tokens of one request
    max_waiting: int = 256  # requests queued beyond the batch; more are refused with 429
    # retrieval: the shared suffix index every finished answer (and, if asked, its prompt) goes into, in tokens
    datastore_capacity: int = 65536
    learn_prompts: bool = False
    save_learned: Path | None = None  # where the shared index is kept at shutdown and read back at start
    prefix_cache_mib: int = 1024  # finished prompts' keys and values kept for the prompts they open; 0: none
    prefix_cache_tokens: int | None = None  # the same capacity in prompt tokens, where given (over the MiB)
    tree: tuple[int, ...] | str | None = None  # draft token trees: candidates per depth, or "auto"; None: chains

    def __post_init__(self) -> None:
        if self.speculation not in SPECULATION_MODES:
            raise UsageError(f"speculation must be one of {', '.join(SPECULATION_MODES)}, got {self.speculation!r}")
        if self.drafter not in PROPOSERS:
            raise UsageError(f"unknown drafter {self.drafter!r}; choose from {', '.join(PROPOSERS)}")
        check_tree(self.tree)
        for name, low in (("num_draft_tokens", 1), ("max_batch_size", 1), ("max_model_len", 2), ("max_waiting", 0),
                          ("datastore_capacity", 1), ("prefix_cache_mib", 0), ("prefix_cache_tokens", 0)):
            if getattr(self, name) is not None and getattr(self, name) < low:
                raise UsageError(f"{name.replace('_', '-')} must be >= {low}, got {getattr(self, name)}")


def build_scheduler(runtime, settings: BatchSettings, eos_token_ids: set[int], datastore=None,
                    draft=None) -> Scheduler:
    """A scheduler over a pool of ``max_batch_size`` KV-cache slots on the runtime's weights (exactspec's runtime, or
    llama.cpp's with a ``seq_id`` per slot), or, where the drafter or the tree needs more of the target than a
    batched pool gives (:func:`served_alone`), over the runtime's own cache one request at a time; ``auto`` first
    measures what passes over 1 to max_batch_size x (k+1) positions cost here. ``draft``: the drafter's source
    (``loading.draft_source``): a draft model's runtime, or a ``ForeignDraft`` where its tokenizer is another, whose
    pool gives each request a slot; a trained network; the hybrid's ``HybridSources`` (its draft model, and its
    trained heads, for which the pool keeps each slot's hidden states)."""
    check_datastore_drafter(settings.drafter, datastore is not None)
    declared = role(settings.drafter)
    if (declared.needs_draft_model or declared.trained) and draft is None:
        raise UsageError(f"the server's {settings.drafter} drafter needs what it drafts with: --draft-model PATH "
                         "or --drafter-path DIR")
    heads = ()
    if declared.takes_heads:  # a hybrid's sources: its draft model, its trained heads
        sources = sources_of(draft)
        draft, heads = sources.model, sources.heads
    needs = declared.needs or (FeatureSource if heads else None)
    if needs is not None:
        require(runtime, needs, f"--drafter {settings.drafter}")
    if settings.tree is not None:
        require(runtime, TreeScorer, "--tree", "use --backend lean or fused")
    pool = make_pool(runtime, settings)
    alone = served_alone(pool, settings, declared, draft, needs)
    if alone:
        notice(f"serving one request at a time: {alone}")
        pool = SequencePool(runtime, settings.max_model_len)
    features = needs is FeatureSource
    if features:
        pool.keep_features()
    prefixes = None if features else prefix_cache(pool, settings.prefix_cache_mib, settings.prefix_cache_tokens,
                                                  pool.max_length)  # (before the measuring: it may refuse its size)
    cost = None
    if settings.speculation == "auto":
        cost = MeasuredPassCosts.measure(pool, settings.max_batch_size * (settings.num_draft_tokens + 1))
    factory = PROPOSERS[settings.drafter]
    memory = None
    if declared.reads_datastore:
        memory = LearnedAnswers(settings, runtime.vocab_size)
        datastore = ChainedIndex([memory.index] + ([datastore] if datastore is not None else []))
    drafts_with_model = draft is not None and (declared.needs_draft_model or declared.takes_draft_model)
    drafts = draft_pool(draft, settings) if drafts_with_model and not alone else None
    model = per_request(draft, drafts) if drafts is not None else lambda: draft
    source = (lambda: HybridSources(model(), heads)) if heads else model
    return Scheduler(pool, learning_together(lambda **plan: factory(runtime, source(), datastore, **plan)),
                     SpeculationPlanner(settings.speculation, cost), eos_token_ids,
                     max_draft_tokens=settings.num_draft_tokens, max_waiting=settings.max_waiting,
                     drafter=settings.drafter, memory=memory,
                     prefixes=prefixes,
                     tree=settings.tree, draft_pool=drafts)


def served_alone(pool, settings: BatchSettings, declared: Role, draft, needs: type | None) -> str | None:
    """Why this server's requests run one at a time in the runtime's own cache (as the library's engine runs
    them), or None where they batch in ``pool``: a drafter that needs a capability of the target (``needs``: its
    role's, or the hidden states its trained heads read) that the pool does not give (the target's hidden states
    where it keeps no features, its first layers alone), a tree (a batched pool scores chains), a draft model whose
    runtime batches nothing (a trained draft LM)."""
    if needs is not None and (needs is not FeatureSource or not declares(pool, SlotFeatures)):
        return f"--drafter {settings.drafter} reads the target's own {needs.__name__}"
    if settings.tree is not None:
        return "--tree scores token trees"
    if draft is not None and (declared.needs_draft_model or declared.takes_draft_model) \
            and not declares(draft_runtime(draft), Pooled):
        return f"--drafter {settings.drafter}'s draft model batches nothing"
    return None


def draft_runtime(draft):
    """The runtime a draft model's drafts run on: the draft itself, or a ``ForeignDraft``'s model."""
    from exactspec.proposers.draft_model import ForeignDraft

    return draft.model if isinstance(draft, ForeignDraft) else draft


def learning_together(make: Callable[..., Proposer]) -> Callable[[], Proposer]:
    """What makes each request's drafter with ``make``: where the drafters share a cost model (``SharesPlan``: the
    hybrid's), every one after the first is made on the first one's (``make(plan=...)``), so that what earlier
    requests measured (each source's acceptance, the target's pass costs) carries over to the next, which
    otherwise would start cold."""
    shared = None

    def made() -> Proposer:
        nonlocal shared
        proposer = make() if shared is None else make(plan=shared)
        if shared is None and declares(proposer, SharesPlan):
            shared = proposer.plan
        return proposer
    return made


def draft_pool(draft, settings: BatchSettings) -> LockstepPool:
    """The pool over the draft model's weights that every request drafts in, a slot each: loaded once, and run in
    lockstep, so that the requests drafting in one step share one pass per draft position."""
    return LockstepPool(pool_of(draft_runtime(draft), settings.max_batch_size, settings.max_model_len))


def per_request(draft, pool: LockstepPool):
    """What makes each request's draft model: a sequence in a slot of ``pool``, over the draft's weights (a
    ``ForeignDraft`` over it where the tokenizers differ)."""
    from exactspec.proposers.draft_model import ForeignDraft

    runtime = draft_runtime(draft)

    def make():
        sequence = PooledSequence(pool, runtime)
        return draft.on(sequence) if isinstance(draft, ForeignDraft) else sequence
    return make


class LearnedAnswers:
    """The server's memory of finished requests: one shared suffix index that every request's retrieval drafter
    reads, fed each finished answer (with its prompt where ``learn_prompts``), bounded by ``datastore_capacity``
    tokens; read back from ``save_learned`` at start and written there at shutdown, where asked."""

    def __init__(self, settings: BatchSettings, vocab_size: int) -> None:
        self.index = SharedIndex(settings.datastore_capacity)
        self.learn_prompts = settings.learn_prompts
        self.directory = settings.save_learned
        self.vocab_size = vocab_size
        if self.directory is not None:
            self.index.load(self.directory, vocab_size)

    def learn(self, context: list[int], prompt_length: int) -> None:
        self.index.add(context if self.learn_prompts else context[prompt_length:])

    def close(self) -> None:
        if self.directory is not None:
            path = self.index.save(self.directory, self.vocab_size)
            notice(f"kept the shared suffix index ({self.index.tokens:,} tokens) in {path}")


def make_pool(runtime, settings: BatchSettings):
    """The KV-cache slots a batch runs in, over the weights the runtime holds."""
    return pool_of(runtime, settings.max_batch_size, settings.max_model_len)
