"""What a draft model's draft-grade copy keeps, chosen for each pair of models by measurement (``--draft-grade auto``).

Fewer bits make a draft token cheaper and its guesses worse, and which pays depends on the pair: a 0.5B drafting for
a 1.5B reads a fifth of a target step at 3 bits a weight, a quarter at 4, while the same 3 bits cost a 135M model
more of its guesses. So each recipe of :data:`RECIPES` is made (once: a copy is kept as any copy is) and measured:

- its **agreement**: how often its greedy choice is the draft model's own (as stored, its whole vocabulary), fed
  :data:`SAMPLE_TOKENS` tokens of the shipped corpus's held-out text. What a copy loses of its model's guesses is
  about what it loses of its acceptance, and this needs no pass of the target;
- its **cost**: the bytes a step of the copy reads over the bytes a step of the target reads.

The recipe :func:`expected_gain` rates highest (the pair's prior acceptance times the agreement, the cost) is chosen
among those that keep :data:`AGREEMENT_FLOOR` of the 4-bit copy's agreement (the issue's bar for a draft-grade
copy's acceptance against the full draft's is 0.95), and kept in ``draft_grades.json`` for the pair. ``--verbose``
says what was measured and which was chosen.

Measured (Qwen2.5-Coder-0.5B for the 1.5B, on a 2-core Zen 3): agreement 89.5%, 83.6% and 79.3% on the corpus's
held-out text for 4 bits, 3 in the feed-forward matrices and 3 in all; their acceptance of the target's own tokens
(12 prompts of 6 kinds, 64 tokens each) 0.984, 0.947-0.951 and 0.937 of the full draft's. The 3-bit recipes keep
0.93 and 0.89 of the 4-bit copy's agreement, so 4 bits is chosen for that pair (the held-out text is people's
writing, where a draft is less sure than on its target's own tokens, so agreement there falls faster than acceptance).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from exactspec.backends import DraftGrade
from exactspec.backends.gguf_file import read_gguf
from exactspec.cachefile import MeasurementCache, file_identity
from exactspec.draft_vocabulary import HELDOUT_SHARE, corpus_conversations
from exactspec.logs import detail

# What each position adds to the target's pass against one (5 positions cost 1.2x one on Zen 4, 1.94x on AVX2:
# issue 61): the slope of a round's cost in its drafted tokens, as :func:`expected_gain` weighs it.
PASS_SLOPE = 0.15
# The recipes tried, dearest first: 4 bits (what Q4_1 is), 3 bits in the feed-forward matrices alone (most of a
# layer's bytes), 3 bits in all.
RECIPES = (DraftGrade(bits=4), DraftGrade(bits=4, feed_forward_bits=3), DraftGrade(bits=3))
AGREEMENT_FLOOR = 0.95
SAMPLE_TOKENS = 512  # the held-out tokens each copy is fed: a share known to about 1% (sqrt(0.95 0.05 / 512))
CACHE = MeasurementCache("draft_grades.json", 1)


def expected_gain(acceptance: float, cost: float, longest: int = 8) -> float:
    """Plain decoding's rate times what a draft of the best length expects: a round drafting k tokens, each accepted
    with ``acceptance`` where those before it were, gives 1 + a + ... + a^k tokens, and costs a target pass over
    k + 1 positions (1 + PASS_SLOPE k steps) and k draft tokens (``cost`` of a step each)."""
    return max(sum(acceptance ** j for j in range(k + 1)) / (1 + PASS_SLOPE * k + cost * k)
               for k in range(1, longest + 1))


@dataclass(frozen=True)
class Measured:
    """A recipe as measured for a pair: its agreement with the draft model's own choices, its cost against a target
    step, and the gain :func:`expected_gain` expects of it."""

    grade: DraftGrade
    agreement: float
    cost: float
    gain: float

    @property
    def line(self) -> str:
        return f"{self.grade.label}: agrees {self.agreement:.1%}, {self.cost:.3f} of a target step, {self.gain:.2f}x"


def chosen_grade(runtime_kind, source: Path, target: Path, prior_acceptance: float, tokenizer: Callable[[], object],
                 vocabulary: Callable[[], tuple], threads: int | None = None) -> DraftGrade:
    """The recipe ``runtime_kind`` makes the draft model ``source``'s copy by, for the target ``target``: kept for the
    pair, else measured (:func:`measured`) and chosen (:func:`best`). ``prior_acceptance``: what the pair's drafts are
    expected to be accepted at as stored; ``tokenizer()``: the draft model's; ``vocabulary()``: its draft vocabulary,
    where a copy is made."""
    key = CACHE.key(f"{file_identity(source)} for {file_identity(target)} at {prior_acceptance:g}")
    kept = CACHE.get(key)
    if kept is not None:
        grade = DraftGrade(**kept["grade"])
        detail(f"the draft-grade copy of {source.name}: {grade.label} (measured before, {CACHE.path()})")
        return grade
    found = measured(runtime_kind, source, read_gguf(target).streamed_bytes(), prior_acceptance, tokenizer(),
                     vocabulary, threads)
    if not found:  # the runtime makes no copy of this file: the model drafts as loaded
        return RECIPES[0]
    chosen = best(found)
    detail(f"the draft-grade copy of {source.name}: {chosen.grade.label} (measured: "
           + "; ".join(m.line for m in found) + ")")
    CACHE.put(key, {"grade": asdict(chosen.grade), "measured": [m.line for m in found]})
    return chosen.grade


def best(found: list[Measured]) -> Measured:
    """The recipe of the highest gain among those keeping AGREEMENT_FLOOR of the first's agreement (4 bits: the
    copy nearest the model)."""
    floor = AGREEMENT_FLOOR * found[0].agreement
    return max((m for m in found if m.agreement >= floor), key=lambda m: m.gain)


def measured(runtime_kind, source: Path, target_bytes: int, prior_acceptance: float, tokenizer,
             vocabulary: Callable[[], tuple], threads: int | None) -> list[Measured]:
    """Each recipe's copy of ``source`` (made where it is not kept), fed the same held-out text as the model as
    stored: its agreement with the model's greedy choices, and its bytes a step over ``target_bytes``; none where the
    runtime reads the file or makes its copies otherwise."""
    tokens = heldout_tokens(tokenizer)
    full = runtime_kind.from_file(source, threads, None)
    if full is None:
        return []
    reference = _choices(full, tokens)
    found = []
    for grade in RECIPES:
        copy = runtime_kind.draft_from_file(source, grade, vocabulary)
        if copy is None:
            return []
        agreement = float(np.mean(_choices(copy, tokens) == reference))
        cost = copy.weight_bytes / target_bytes
        found.append(Measured(grade, agreement, cost, expected_gain(prior_acceptance * agreement, cost)))
    return found


def heldout_tokens(tokenizer, count: int = SAMPLE_TOKENS) -> list[int]:
    """The first ``count`` tokens of the shipped corpus's held-out conversations (its last HELDOUT_SHARE, which no
    draft vocabulary is ranked on), each turn encoded alone as the model writes it."""
    conversations = corpus_conversations()
    tokens: list[int] = []
    for turns in conversations[int(len(conversations) * (1 - HELDOUT_SHARE)) :]:
        for turn in turns:
            tokens += list(tokenizer.encode(turn, add_special_tokens=False))
            if len(tokens) >= count:
                return tokens[:count]
    return tokens


def _choices(runtime, tokens: list[int]) -> np.ndarray:
    """The runtime's greedy choice after each prefix of ``tokens``, fed them in one pass."""
    runtime.rollback(0)
    logits = runtime.extend(tokens, len(tokens))
    runtime.rollback(0)
    return logits.argmax(-1).numpy()
