"""The model-backend protocol: weights, a KV cache over one sequence, and rollback of that cache; the pool
protocol, many sequences' caches extended in one pass; and the capabilities beyond them that some backends declare
(token trees, hidden states, shallow runs, a pool), checked in one place.

Every runtime's wing (``lean/``, ``fused/``, ``llamacpp/``, and ``hf.py``) is written to these faces, and nothing
outside ``backends/`` asks which runtime it holds.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from exactspec.errors import UsageError
from exactspec.logs import notice


class CausalLM(Protocol):
    """A causal language model with a KV cache over one sequence, and the token ids that cache holds.

    ``extend`` appends tokens and returns the logits at the last ``num_logits`` of them; ``rollback`` cuts the
    cache back to a prefix, which is how rejected draft tokens are forgotten. The backend keeps ``tokens`` itself,
    so that every user of one backend (engines, benchmarks) sees the same truth about its cache.
    """

    name: str  # the runtime, as --backend names it ("lean", "fused", "llama.cpp", "transformers")
    device: torch.device
    vocab_size: int  # width of the logits
    max_length: int  # the most tokens the cache (and the model's positions) can hold
    tokens: list[int]  # the token ids in the cache, in order; read-only for callers
    weight_bytes: int  # the bytes of weights one decode pass (one position) reads: its weight-streaming cost
    precision_label: str  # the weights' precision, as a summary names it ("float16", "Q4_1 (GGUF, as stored)")
    runtime_label: str  # what computes its rows, as a notice names it ("exactspec's runtime (float16)")
    pass_invariant: bool  # whether each row is computed as it is alone by construction (else the load probe measures)

    def extend(self, token_ids: list[int], num_logits: int) -> torch.Tensor:  # [num_logits, vocab]
        """Append token_ids to the cache in one forward pass; logits at the last num_logits positions."""
        ...

    def rollback(self, length: int) -> None:
        """Cut the cache back to its first ``length`` tokens."""
        ...

    def reserve(self, length: int) -> None:
        """Make room for ``length`` tokens at once, so that no later pass reallocates (a hint; may do nothing)."""
        ...

    def remedy(self, path) -> str:
        """What makes its rows the same in any pass, where the load probe finds they are not (the model at
        ``path``)."""
        ...


class PoolFull(RuntimeError):
    """Every slot of the pool is taken."""


@dataclass(eq=False)
class Slot:
    """One sequence's place in a pool. ``index`` may move when the pool compacts; hold the Slot, not the index."""

    index: int
    length: int = 0  # positions cached


@dataclass(frozen=True)
class Row:
    """One sequence's share of a pass: tokens appended to its slot, logits wanted at the last ``num_logits``.
    ``restored``: the slot's positions just restored from a prefix cache, of the same prompt as these tokens; the
    row then runs as the prefill of that whole prompt would."""

    slot: Slot
    token_ids: list[int]
    num_logits: int
    restored: int = 0
    parents: list[int] | None = None  # a token tree: each token's parent in the row (-1: the slot's cached ones)


class Pool(Protocol):
    """KV caches for up to ``max_slots`` sequences of up to ``max_length`` tokens, all extended in one pass, so
    that the weights stream from memory once whatever the number of rows. A slot's rollback is its length: the
    positions past it are overwritten (or removed) before its next pass."""

    device: torch.device
    vocab_size: int  # width of the logits
    max_slots: int
    max_length: int
    slots: list[Slot]  # the open slots

    def open(self) -> Slot:
        """A free slot, empty; :class:`PoolFull` where none is."""
        ...

    def close(self, slot: Slot) -> None:
        """Free the slot and forget its cache."""
        ...

    def forward(self, rows: list[Row]) -> list[torch.Tensor]:  # per row [num_logits, vocab]
        """Append every row's tokens to its slot in one pass; each row's logits at its last ``num_logits``."""
        ...


def forward_apart(pool: Pool, rows: list[Row], split: Callable[[Exception], None] | None = None
                  ) -> list[torch.Tensor | Exception]:  # per row [num_logits, vocab], or the error of its pass alone
    """One pass over every row; should it fail, each row again alone, from where its slot stood before the pass, so
    that a fault in one sequence's share fails that sequence only: its exception in its place, the others' logits
    beside it. ``split`` is told the pass's error before the rows run alone."""
    starts = [row.slot.length for row in rows]
    try:
        return list(pool.forward(rows))
    except Exception as error:
        for row, start in zip(rows, starts):
            row.slot.length = start
        if len(rows) == 1:
            return [error]
        if split is not None:
            split(error)
    results: list[torch.Tensor | Exception] = []
    for row in rows:
        try:
            results.append(pool.forward([row])[0])
        except Exception as error:
            results.append(error)
    return results


class KeepsPrefixes(Protocol):
    """A pool that copies a slot's first cached positions out and back in: what lets a server restore a prompt's
    keys and values for a later request that opens with the same tokens, instead of prefilling them again (its
    prefix cache, ``server/prefixes.py``). A restored position holds the bits a prefill of the new prompt would
    write only where every row is computed as it is alone (``pass_invariant``), where both prompts were long enough
    to run as prompts (``prompt_positions``: a runtime may run prompts, rounds and single steps through different
    kernels), and where the rest of the prompt runs as its whole prefill would (its row's ``restored``)."""

    pass_invariant: bool
    prompt_positions: int  # the fewest positions a prefill runs as a prompt's
    position_bytes: int  # the bytes one position's keys and values take in a copy

    def copy_out(self, slot: Slot, length: int) -> torch.Tensor:
        """The keys and values of the slot's first ``length`` positions, copied."""
        ...

    def copy_in(self, slot: Slot, kept: torch.Tensor, length: int) -> None:
        """Make the slot hold the first ``length`` positions of what :meth:`copy_out` gave, and only them."""
        ...


class FeaturePool(Pool, Protocol):
    """A pool that hands back hidden states too (what training data for drafters reads)."""

    def forward_hidden(self, rows: list[Row], hidden: bool = True
                       ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """As ``forward``, and each row's final hidden states, normed as the LM head reads them, at every one of
        its new tokens: per row [num_logits, vocab] and [n, hidden]."""
        ...

    def states_after(self, rows: list[Row], layers: int) -> list[torch.Tensor]:  # per row [n, hidden]
        """Each row's residual stream after the first ``layers`` layers only, at every one of its new tokens."""
        ...


class TreePool(Pool, Protocol):
    """A pool whose rows may be token trees (``Row.parents``: each token attends to the cache and its ancestors;
    logits at every token), and that moves a scored tree's accepted path into place."""

    def keep_path(self, slot: Slot, start: int, path: list[int]) -> None:
        """Keep the slot's first ``start`` positions, then the tree's tokens at ``path`` (indexes into its row, root
        to leaf), in that order; forget the rest."""
        ...


class SlotFeatures(Pool, Protocol):
    """A pool that hands a drafter the target's final hidden states at a slot's cached positions (what the eagle
    and mtp heads read), once asked to keep them."""

    def keep_features(self) -> None:
        """From now on keep every slot's hidden states at its cached positions."""
        ...

    def features(self, slot: Slot) -> torch.Tensor:  # [slot.length, hidden]
        ...


class Pooled(Protocol):
    """Serves many sequences at once: declares the pool over its weights."""

    def pool(self, max_slots: int, max_length: int) -> Pool:
        """A pool of ``max_slots`` KV-cache slots of up to ``max_length`` tokens over this runtime's weights."""
        ...


class TreeScorer(Protocol):
    """Scores a token tree in one pass, each node attending to its ancestors, and keeps the accepted branch."""

    def extend_tree(self, token_ids: list[int], parents: list[int]) -> torch.Tensor:  # [n, vocab]
        """Append a tree (``token_ids[0]`` after the cache, each other token after ``token_ids[parents[i]]``);
        the logits after every node."""
        ...

    def keep_path(self, start: int, path: list[int]) -> None:
        """After ``extend_tree`` at cache length ``start``: keep the nodes ``path`` (root first) as the positions
        after ``start``; drop the rest."""
        ...


class PromptPasses(Protocol):
    """A runtime whose chain passes of ``prompt_positions`` or more positions (a prompt's) run another kernel than
    shorter ones (rounds, steps), and which counts the first positions of its cache such passes wrote, one after
    another from the start (``prefilled``): the positions whose bits a prefill of them alone would write."""

    prompt_positions: int
    prefilled: int


class FeatureSource(Protocol):
    """Keeps each cached position's final hidden state, normed as the LM head reads it (what eagle and mtp read).
    A backend that declares it keeps them in ``_hidden`` ([capacity, hidden], None until asked) beside ``tokens``."""

    _hidden: torch.Tensor | None
    tokens: list[int]

    def keep_hidden_states(self) -> None:
        """From now on keep them (a cost some backends pay only when asked)."""
        ...

    @property
    def hidden_states(self) -> torch.Tensor:  # [len(tokens), hidden]
        """The final hidden state, normed as the LM head reads it, of every cached position."""
        if self._hidden is None:
            raise RuntimeError("call keep_hidden_states() first")
        return self._hidden[: len(self.tokens)]


class ShallowRunner(Protocol):
    """Runs positions through the first layers only, keeping their keys and values for the full pass after
    (self-speculation's shared cache)."""

    def extend_shallow(self, token_ids: list[int], layers: int) -> torch.Tensor:  # [n, hidden]
        ...

    def layer_states(self, token_ids: list[int]) -> torch.Tensor:  # [num_layers + 1, n, hidden]
        ...

    def exit_logits(self, states: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab]
        """The LM head over the residual stream after any layer, normed as the last layer's is (an early exit)."""
        ...


class DraftsChains(Protocol):
    """Drafts a whole chain in one call, without returning to Python between its tokens: each token the greedy or the
    invariant sampler's choice among the LM head's rows, fed back as the next position's input. The cache then holds
    what ``extend([token], 1)`` token by token would write, bit for bit, and the tokens are those Python's choice over
    those logits gives. A draft model's proposer chains so where the sampling allows (greedy, or the invariant
    sampler without top-k or top-p) and ``chain_ids`` is not None; elsewhere it chains in Python."""

    # [rows] int32, ascending: the token id each LM head row stands for (every id for a full head, a draft-grade
    # model's kept ids for a cut one), or None where this runtime cannot chain in one call (then it is not asked)
    chain_ids: torch.Tensor | None

    def draft_chain(self, lead: list[int], k: int, width: int = 1, noise: torch.Tensor | None = None,
                    temperature: float = 1.0, allowed: torch.Tensor | None = None
                    ) -> tuple[list[int], list[list[int]]]:
        """Feed ``lead`` (the context's last tokens, 1 to CHAIN_LEAD: the cache holds every one before them; see
        ``lead_of``) in one pass, then the first k - 1 of the k tokens drafted after it; the k tokens, and per depth
        the ``width - 1`` ids its head ranks highest after the chosen one (``sampling.ranked``'s: a tree's
        alternatives). ``noise`` [k, rows] float64, the invariant sampler's Gumbel noise at each depth's position
        over ``chain_ids``, makes each choice its Gumbel-max at ``temperature``; None, the argmax. ``allowed`` [rows]
        bool: the rows it may choose and rank, as if the others' logits were -inf (a draft among the tokens another
        tokenizer holds); None, all."""
        ...


class PooledSequence(CausalLM):
    """One sequence in a pool's slot, seen as a CausalLM: what gives each of a server's requests a draft model of its
    own over one set of draft weights. The slot is taken at the first pass and given back when the sequence is
    rolled back to nothing (a drafter's ``clear_cache``, which the server calls when the request ends)."""

    def __init__(self, pool: Pool, runtime: CausalLM) -> None:
        self.pool = pool
        self.name = runtime.name
        self.device = pool.device
        self.vocab_size = pool.vocab_size
        self.max_length = pool.max_length
        self.weight_bytes = runtime.weight_bytes
        self.precision_label = runtime.precision_label
        self.runtime_label = runtime.runtime_label
        self.pass_invariant = runtime.pass_invariant
        self.tokens: list[int] = []
        self._slot: Slot | None = None

    def extend(self, token_ids: list[int], num_logits: int) -> torch.Tensor:  # [num_logits, vocab]
        if not token_ids and not num_logits:  # nothing to append (a drafter catching up to what it holds): no pass,
            return torch.empty(0, self.vocab_size, device=self.device)  # as a runtime's own cache answers it
        if self._slot is None:
            self._slot = self.pool.open()  # PoolFull when every slot is taken: the request decodes plainly
        self._slot.length = len(self.tokens)
        logits = self.pool.forward([Row(self._slot, list(token_ids), num_logits)])[0]
        self.tokens += token_ids
        return logits

    def rollback(self, length: int) -> None:
        self.tokens = self.tokens[:length]
        if self._slot is None:
            return
        if length == 0:
            self.pool.close(self._slot)
            self._slot = None
        else:
            self._slot.length = length

    def reserve(self, length: int) -> None:
        pass

    def remedy(self, path) -> str:
        return ""


class SequencePool(TreePool, SlotFeatures):
    """One sequence at a time in the runtime's own cache, seen as a pool of one slot: what serves a drafter or a
    tree that needs more of the target than a batched pool declares (the target's hidden states, its first layers
    alone, a tree's attention mask), each request then running exactly as the library's engine runs it."""

    max_slots = 1

    def __init__(self, runtime: CausalLM, max_length: int) -> None:
        self.runtime = runtime
        self.device = runtime.device
        self.vocab_size = runtime.vocab_size
        self.max_length = min(max_length, runtime.max_length)
        self.slots: list[Slot] = []

    def open(self) -> Slot:
        if self.slots:
            raise PoolFull("the one slot is taken")
        self.runtime.rollback(0)
        self.runtime.reserve(self.max_length)
        self.slots = [Slot(index=0)]
        return self.slots[0]

    def close(self, slot: Slot) -> None:
        self.slots.remove(slot)
        slot.index = -1
        self.runtime.rollback(0)

    def forward(self, rows: list[Row]) -> list[torch.Tensor]:  # per row [num_logits, vocab]; a tree's: [n, vocab]
        (row,) = rows
        self.runtime.rollback(row.slot.length)
        if row.parents is None:
            logits = self.runtime.extend(row.token_ids, row.num_logits)
        else:
            logits = self.runtime.extend_tree(row.token_ids, row.parents)
        row.slot.length += len(row.token_ids)
        return [logits]

    def keep_path(self, slot: Slot, start: int, path: list[int]) -> None:
        self.runtime.keep_path(start, path)
        slot.length = start + len(path)

    def keep_features(self) -> None:
        self.runtime.keep_hidden_states()

    def features(self, slot: Slot) -> torch.Tensor:  # [slot.length, hidden]
        return self.runtime.hidden_states[: slot.length]


def declares(thing: object, capability: type) -> bool:
    """Whether ``thing``'s class declares ``capability`` (names it among its bases): capabilities are declared, not
    guessed from the attributes an object happens to have."""
    return capability in type(thing).__mro__


def require(thing: object, capability: type, what: str, hint: str = "") -> None:
    """Refuse, in one line naming the capability, ``what`` on a backend or drafter that does not declare it."""
    if not declares(thing, capability):
        raise UsageError(f"{what} needs a {capability.__name__}, which {type(thing).__name__} is not"
                         + (f": {hint}" if hint else ""))


def streamed_parameters(model) -> int:
    """Parameters a one-position pass reads: all but the input embedding (of which it reads one row), unless the
    LM head shares that matrix. ``model.parameters()`` yields a shared matrix once."""
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    return sum(p.numel() for p in model.parameters()) - (0 if head is embed else embed.numel())


def sync(model: CausalLM, context: list[int], num_logits: int) -> torch.Tensor:  # [num_logits, vocab]
    """Make the model's cache hold exactly ``context``; logits at its last ``num_logits`` positions.

    Keeps the longest prefix shared with what is cached and re-feeds at least ``num_logits`` tokens: a request
    that extends an earlier one (the next chat turn, another sample of the same prompt) skips the shared
    prefill, and a drafter forgets its rejected draft tokens by itself.
    """
    shared = min(common_prefix_length(model.tokens, context), len(context) - num_logits)
    model.rollback(shared)
    return model.extend(context[shared:], num_logits)


def unfed(model: CausalLM, context: list[int]) -> int:
    """The tokens ``sync(model, context, 0)`` would feed: those of ``context`` past what the cache shares with it."""
    return len(context) - common_prefix_length(model.tokens, context)


# The most tokens a draft's first pass feeds before it drafts (``lead_of``): a round's accepted tokens and the
# target's own, which a pass of their own would cost about a draft step more (a pass over a few rows costs what one
# does); a longer backlog (a prompt, rounds the draft did not draft) is fed before, its cost measured apart.
CHAIN_LEAD = 8


def before_lead(model: CausalLM, context: list[int]) -> int:
    """The tokens ``feed_before_lead`` would feed: the unfed ones of ``context`` but its last CHAIN_LEAD."""
    return max(unfed(model, context) - CHAIN_LEAD, 0)


def feed_before_lead(model: CausalLM, context: list[int]) -> None:
    """Make the cache hold all of ``context`` but at most its last CHAIN_LEAD tokens, feeding none it holds already
    (a drafter's catching up on a backlog: the rest is its draft's lead)."""
    if before_lead(model, context):
        sync(model, context[:-CHAIN_LEAD], num_logits=0)


def lead_of(model: CausalLM, context: list[int]) -> list[int]:
    """The tokens a chain after ``context`` feeds first (``DraftsChains.draft_chain``'s lead): those past the longest
    prefix the cache shares with ``context``, its last token at least, at most CHAIN_LEAD (any before them are fed
    now); the cache rolled back to that prefix (a rejected draft's tokens forgotten)."""
    shared = min(common_prefix_length(model.tokens, context), len(context) - 1)
    if len(context) - shared > CHAIN_LEAD:  # a backlog the caller did not catch up on
        feed_before_lead(model, context)
        shared = len(context) - CHAIN_LEAD
    model.rollback(shared)
    return context[shared:]


def prefill(model: CausalLM, prompt: list[int]) -> int:
    """Make the model's cache hold exactly ``prompt``, prefilled: as a prefill of the prompt alone writes it, bit for
    bit, where the model runs prompts through their own kernel (``PromptPasses``). A cached prefix is kept only
    where that holds: a long prompt keeps what prompt passes wrote and runs a rest long enough to be one (or
    nothing); a short prompt keeps what rounds wrote, never what a prompt pass did. Elsewhere, the longest shared
    prefix (``sync``). Returns the tokens it fed (the prompt but the prefix kept)."""
    keep = common_prefix_length(model.tokens, prompt)
    if declares(model, PromptPasses):
        if len(prompt) >= model.prompt_positions:
            keep = min(keep, model.prefilled)
            if keep < len(prompt):
                keep = max(0, min(keep, len(prompt) - model.prompt_positions))
        elif model.prefilled:
            keep = 0
    model.rollback(keep)
    model.extend(prompt[keep:], 0)
    return len(prompt) - keep


def pass_seconds(model: CausalLM, positions: int) -> float:
    """Seconds of one pass over ``positions`` tokens appended to the cache, then forgotten: the cost of a decode
    pass (1) or of scoring k+1 positions. The tokens repeat the cache's last one; the cache must not be empty."""
    cached = len(model.tokens)
    started = time.perf_counter()
    model.extend(model.tokens[-1:] * positions, positions)
    elapsed = time.perf_counter() - started
    model.rollback(cached)
    return elapsed


def median_pass_seconds(runtimes: dict[str, CausalLM], sizes: tuple[int, ...], repeats: int
                        ) -> dict[str, dict[int, float]]:
    """Per runtime, the median seconds of a pass over each number of positions in ``sizes``
    (:func:`pass_seconds`): ``repeats`` rounds, each giving every runtime its turn at every size, after one round
    that warms up and is dropped. A runtime's turn opens with an untimed pass: the runtime before it may still
    hold a core while its threads spin down. The caches must not be empty."""
    seconds = {name: {n: [] for n in sizes} for name in runtimes}
    for repeat in range(repeats + 1):
        for name, runtime in runtimes.items():
            pass_seconds(runtime, 1)
            for n in sizes:
                elapsed = pass_seconds(runtime, n)
                if repeat:
                    seconds[name][n].append(elapsed)
    return {name: {n: statistics.median(times) for n, times in by_size.items()} for name, by_size in seconds.items()}


PROBE_PREFIX = (1, 7, 42)  # the pass-invariance probe: a cached prefix, then five positions (ids mod the vocabulary)
PROBE_TOKENS = (100, 1000, 10000, 20000, 30000)


def rows_are_pass_invariant(model: CausalLM) -> bool:
    """Whether a few positions' logits, computed one position per pass (plain decoding), equal those of one pass
    over them all (a verifying pass), bit for bit, after a cached prefix; the cache is left empty. Where they do,
    speculation cannot change a greedy or seeded token on that backend; where not, it can at near-ties."""
    prefix = [token % model.vocab_size for token in PROBE_PREFIX]
    probe = [token % model.vocab_size for token in PROBE_TOKENS]
    model.rollback(0)
    model.extend(prefix, 0)
    alone = torch.cat([model.extend([token], 1) for token in probe])  # [5, vocab]
    model.rollback(len(prefix))
    together = model.extend(probe, len(probe))  # [5, vocab]
    model.rollback(0)
    return torch.equal(alone, together)


def probe_pass_invariance(model: CausalLM, name: str, runtime: str, remedy: str) -> None:
    """One notice, naming ``remedy``, where ``model``'s rows are not pass-invariant (:func:`rows_are_pass_invariant`;
    nothing where its context is too short to probe, and no probe where the runtime computes each row alone by
    construction: its ``pass_invariant``, which the tests check on every CPU path)."""
    if model.pass_invariant or model.max_length < len(PROBE_PREFIX) + len(PROBE_TOKENS):
        return
    if not rows_are_pass_invariant(model):
        notice(f"{name}: {runtime} computes a position's logits differently alone and in a pass of several, so "
               f"speculation can part from plain decoding where two tokens nearly tie; {remedy}")


def common_prefix_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
