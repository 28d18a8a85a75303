"""A draft vocabulary: the ids a draft-grade model's output matrix is cut to, chosen by how often a chat model writes
them.

A draft model's last matrix multiplies its hidden state by one row per token: with Qwen2.5's 151,936 tokens that row
set is most of a small draft's cost. FR-Spec keeps 32k of Llama 3's 128k, and EAGLE-3 drafts over a vocabulary of
its own. A token outside the draft vocabulary is one the draft can never propose, and nothing else changes: the
verifier compares the target's distribution p with the draft's q, which is simply 0 outside it (the draft's logits
-inf there), so every emitted token is still an exact draw from p. Only acceptance moves, and by a bounded amount:
under the standard rule a position's acceptance is sum_x min(p(x), q'(x)) with q' = q renormalised over the
vocabulary V, at least sum_{x in V} min(p(x), q(x)), so it drops by at most p's mass outside V; greedily (and under
the invariant sampler) the draft loses at most the positions where the target's own token is outside V. So the
share of the target's output tokens outside V bounds the acceptance lost per position.

The count is taken on text that ships with exactspec (``drafters/shipped/corpus``: ShareGPT's assistant turns,
prose and code, none of the benchmarks' prompts): each turn encoded alone, without BOS or other added tokens, as the
model writes it. The conversations are split in file order: the first 80% rank the ids, the last 20% measure how
much of unseen text the chosen ids cover, so the size chosen is not fitted on the text it is judged by. Its 2.5 MB
are about half a million tokens, which hold 16-19 thousand distinct ids of a 49k or 152k vocabulary: past those
the ranking is the ids' own order (ties go by id), which for a BPE is merge order, itself a ranking by frequency on
the tokenizer's training text.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from exactspec.cores import usable_cores
from exactspec.vocabularies import control_ids

CORPUS_PATH = Path(__file__).parent / "drafters" / "shipped" / "corpus" / "sharegpt-assistant.jsonl.gz"
HELDOUT_SHARE = 0.2  # the corpus's last conversations, kept out of the ranking to measure coverage on
# The coverage of held-out text a chosen vocabulary must reach. The issue asks a draft-grade draft for at least 0.95
# of the full draft's acceptance, aiming at 0.98; a position's acceptance drops by at most the target's mass outside
# the vocabulary (the module's docstring), so at a full-draft acceptance a the ratio is at least 1 - (1 - c) / a:
# c = 0.985 keeps 0.98 for a >= 0.75 and 0.95 for a >= 0.3. The bound is loose the right way: the tokens left out
# are the rare ones, which a draft guesses less often than its average.
TARGET_COVERAGE = 0.985
# Sizes are chosen in steps of 1024 rows: a multiple of every row block the kernels read an output matrix in (8-row
# repacked tiles, 64-row passes) that splits evenly over 16 threads, and fine enough (0.7% of Qwen's 152k, 2-3% of
# a 32k cut) that the step costs little beyond what the target asks; 4096 would overshoot by up to 12% at 32k.
SIZE_STEP = 1024
# Fewer held-out tokens than this and the corpus cannot tell coverage to a tenth of the 1.5% allowed to miss (the
# standard error of a share near 0.985 over n tokens is sqrt(0.985 * 0.015 / n): 0.0012 at 10,000): the tokenizer
# has no corpus fit, and ids are taken in their own order instead.
MIN_HELDOUT_TOKENS = 10_000
FALLBACK_SIZE = 32_768  # ids kept where the corpus says nothing (FR-Spec's cut of Llama 3), in merge order


def corpus_conversations(path: Path = CORPUS_PATH) -> list[list[str]]:
    """The shipped corpus: each conversation's assistant turns, in file order."""
    with gzip.open(path, "rt", encoding="utf-8") as lines:
        return [json.loads(line)["turns"] for line in lines if line.strip()]


def token_counts(tokenizer, vocab_size: int, texts: Iterable[str] | None = None) -> np.ndarray:  # [vocab] int64
    """How often each id occurs in ``texts`` (default: every turn of the shipped corpus), each text encoded alone
    without added tokens (no BOS): the ids a model writes for it. ``tokenizer`` is a LoadedModel's (llama.cpp's
    GGUF tokenizer or transformers'); ids at or past ``vocab_size`` (none for a model's own tokenizer) are not
    counted."""
    if texts is None:
        texts = [turn for turns in corpus_conversations() for turn in turns]

    def encoded(text: str) -> np.ndarray:
        return np.asarray(tokenizer.encode(text, add_special_tokens=False), dtype=np.int64)

    # on the cores this process may use: llama.cpp's tokenizer runs outside the GIL (ctypes lets it go), and each
    # call keeps its own state, as llama-server's HTTP threads tokenize side by side
    with ThreadPoolExecutor(usable_cores()) as pool:
        parts = list(pool.map(encoded, texts))
    ids = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    return np.bincount(ids[(ids >= 0) & (ids < vocab_size)], minlength=vocab_size).astype(np.int64)


@dataclass(frozen=True, eq=False)
class CorpusCounts:
    """Token counts of the corpus's two parts: ``fit``, its first conversations (1 - HELDOUT_SHARE of them, in file
    order), which rank the ids; ``heldout``, the rest, which measure coverage."""

    fit: np.ndarray  # [vocab] int64
    heldout: np.ndarray  # [vocab] int64

    @classmethod
    def of(cls, tokenizer, vocab_size: int, conversations: list[list[str]] | None = None) -> CorpusCounts:
        """The counts of ``conversations`` (default: the shipped corpus's) in ``tokenizer``'s ids."""
        conversations = corpus_conversations() if conversations is None else conversations
        cut = round(len(conversations) * (1 - HELDOUT_SHARE))
        fit = token_counts(tokenizer, vocab_size, [turn for turns in conversations[:cut] for turn in turns])
        heldout = token_counts(tokenizer, vocab_size, [turn for turns in conversations[cut:] for turn in turns])
        return cls(fit, heldout)

    @property
    def vocab_size(self) -> int:
        return len(self.fit)

    @property
    def fits(self) -> bool:
        """Whether the corpus ranks this tokenizer's ids: enough held-out tokens to measure coverage by."""
        return int(self.heldout.sum()) >= MIN_HELDOUT_TOKENS and int(self.fit.sum()) > 0


@dataclass(frozen=True, eq=False)
class DraftVocabulary:
    """The ids a draft proposes over: ``ids`` [size] int32, ascending; ``coverage``, the share of the held-out
    corpus's tokens they hold (nan where nothing was held out)."""

    ids: np.ndarray  # [size] int32
    coverage: float

    @property
    def size(self) -> int:
        return len(self.ids)

    @classmethod
    def choose(cls, counts: CorpusCounts, controls: Iterable[int], target: float = TARGET_COVERAGE,
               step: int = SIZE_STEP) -> DraftVocabulary:
        """The smallest vocabulary, in multiples of ``step`` ids (the whole vocabulary at most), whose coverage of
        the held-out corpus reaches ``target``: ``controls`` (EOS, a chat template's markers: a draft must be able
        to end) and the ids the fit part counts most often (ties by id). Where the corpus does not fit the tokenizer
        (:attr:`CorpusCounts.fits`), the first FALLBACK_SIZE ids in their own order (a BPE's ids are in merge
        order, a SentencePiece's by score: roughly by frequency)."""
        if not 0 < target <= 1:
            raise ValueError(f"a coverage target is in (0, 1], got {target}")
        if not counts.fits:
            unranked = CorpusCounts(np.zeros_like(counts.fit), counts.heldout)
            return cls.of_size(unranked, controls, min(FALLBACK_SIZE, counts.vocab_size))
        controls = set(controls)
        ranking, curve = _ranking_and_coverage(counts, controls)
        sizes = np.arange(step, counts.vocab_size + step, step).clip(max=counts.vocab_size)
        sizes = sizes[sizes >= len(controls)]  # every control id is kept
        reached = sizes[curve[sizes - 1] >= target - 1e-12]
        size = int(reached[0]) if len(reached) else counts.vocab_size
        return cls(np.sort(ranking[:size]).astype(np.int32), float(curve[size - 1]))

    @classmethod
    def of_size(cls, counts: CorpusCounts, controls: Iterable[int], size: int) -> DraftVocabulary:
        """The ``size`` ids ranked first (the controls, then by the fit part's counts, ties by id) and their
        coverage of the held-out part."""
        if not 0 < size <= counts.vocab_size:
            raise ValueError(f"a draft vocabulary holds 1..{counts.vocab_size} ids, not {size}")
        ranking, curve = _ranking_and_coverage(counts, controls)
        return cls(np.sort(ranking[:size]).astype(np.int32), float(curve[size - 1]))

    @classmethod
    def for_model(cls, tokenizer, vocab_size: int, target: float = TARGET_COVERAGE) -> DraftVocabulary:
        """The vocabulary :meth:`choose` picks for a model's tokenizer on the shipped corpus."""
        return cls.choose(CorpusCounts.of(tokenizer, vocab_size), control_ids(tokenizer, vocab_size), target)


def _ranking_and_coverage(counts: CorpusCounts, controls: Iterable[int]) -> tuple[np.ndarray, np.ndarray]:
    """Every id in rank order [vocab] (controls first, ascending; then by fit count, descending, ties by id) and the
    held-out coverage of each prefix [vocab]: ``curve[n - 1]`` is that of the first n."""
    vocab = counts.vocab_size
    is_control = np.zeros(vocab, dtype=bool)
    is_control[[t for t in set(controls) if 0 <= t < vocab]] = True
    ordinary = np.flatnonzero(~is_control)
    ordinary = ordinary[np.lexsort((ordinary, -counts.fit[ordinary]))]  # the last key sorts first
    ranking = np.concatenate([np.flatnonzero(is_control), ordinary])
    total = int(counts.heldout.sum())
    covered = np.cumsum(counts.heldout[ranking], dtype=np.int64)
    curve = covered / total if total else np.full(vocab, np.nan)
    return ranking, curve
