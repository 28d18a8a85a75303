"""What a runtime declares about itself, in its wing's ``__init__.py`` (``KIND = RuntimeKind(...)``): its name as
``--backend`` spells it, how it loads a source (a GGUF file read alone, or a transformers module), what it refuses
and why, and whether ``--backend auto`` measures it. The registry (``exactspec.backends.kinds``) gathers the wings'
declarations; the loading layer (``models.py``, ``runtime_choice.py``, ``loading.py``) asks them, and never which
runtime a name is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from exactspec.backends.base import CausalLM


def _never(*_) -> None:
    return None


DRAFT_GRADE_VERSION = 1  # what a draft-grade copy holds and how it is made; up it when that changes


@dataclass(frozen=True)
class DraftGrade:
    """What a draft model's draft-grade copy keeps (a runtime that makes them: ``RuntimeKind.draft_from_file``):
    ``bits`` 4 (its matrices stored in more bits re-quantised to 4), 3 (all re-quantised to 3) or None (as stored),
    ``feed_forward_bits`` the same for its feed-forward matrices alone (None: ``bits``; they are most of a layer's
    bytes), and whether its LM head is cut to a draft vocabulary (``vocabulary``: the tokens its tokenizer writes
    most often, chosen as the copy is made). Exactness lives in the verifier and the target's bits: a draft-grade
    copy moves acceptance and cost alone."""

    bits: int | None = 4
    vocabulary: bool = True
    feed_forward_bits: int | None = None

    def __post_init__(self) -> None:
        for bits in (self.bits, self.feed_forward_bits):
            if bits not in (None, 3, 4):
                raise ValueError(f"a draft-grade copy keeps 3 or 4 bits or the stored ones, not {bits}")

    @property
    def feed_forward(self) -> int | None:
        """The bits of its feed-forward matrices."""
        return self.bits if self.feed_forward_bits is None else self.feed_forward_bits

    @property
    def label(self) -> str:
        bits = [f"{self.bits}-bit"] if self.bits else []
        if self.feed_forward != self.bits:
            bits = [f"{self.bits or 'stored'}-bit, {self.feed_forward}-bit feed-forward"]
        return ", ".join(bits + (["draft vocabulary"] if self.vocabulary else [])) or "as stored"

    def key(self) -> str:
        return (f"draft-grade v{DRAFT_GRADE_VERSION} bits {self.bits} vocabulary {self.vocabulary}"
                + (f" feed-forward {self.feed_forward}" if self.feed_forward != self.bits else ""))


@dataclass(frozen=True)
class RuntimeKind:
    """A runtime as the loading layer sees it. A loader returns None where this runtime does not run the source
    that way (the loading layer then tries the next way); a refusal is a line, or None where there is none."""

    name: str  # as --backend names it
    label: str  # as a notice names it ("exactspec's fused runtime")
    runtime: type  # the class that runs it: what it declares (base.py's capabilities) is asked before any load
    # a GGUF file read alone, no transformers module made: (path, threads, max_length) -> the runtime, or None where
    # it runs the file from its transformers conversion instead (one UsageError line where it runs it in no way)
    from_file: Callable[[Path, int | None, int | None], CausalLM | None] | None = None
    # whether from_file reads this path alone (a GGUF it covers), asked without loading it
    reads: Callable[[Path], bool] = lambda path: False
    # over a loaded transformers module: (model, its GGUF or None, precision) -> the runtime, or None where its code
    # does not cover the model (transformers' own module runs it then: hf.py)
    from_model: Callable[[object, Path | None, str | None], CausalLM | None] | None = None
    # the runtime's own tokenizer where the runtime read the file's vocabulary itself; else the file's is read apart
    tokenizer_of: Callable[[CausalLM], object] | None = None
    unavailable: Callable[[], str | None] = _never  # why it cannot run on this machine at all (a missing build)
    model_unavailable: Callable[[object], str | None] = _never  # why it cannot run this transformers module
    weights: str | None = None  # the weights it runs where it takes no --dtype and runs on the CPU only; None: any
    measured_by_auto: bool = True  # --backend auto times it against the others where it can run the target
    auto_precision: Callable[[], str | None] = _never  # the precision --backend auto times it in (None: as loaded)
    measures_drafts: bool = False  # a draft model beside a target on it runs where --backend auto measures it fastest
    # a draft model's draft-grade copy, made once and kept: (path, grade, vocabulary) -> the runtime over it, or None
    # where it makes none of this file; vocabulary() chooses the draft vocabulary (token ids, coverage) as it is made
    draft_from_file: Callable[[Path, DraftGrade, Callable[[], tuple]], CausalLM | None] | None = None

    @property
    def gguf_only(self) -> bool:
        """It runs nothing but a GGUF file read alone (no transformers module)."""
        return self.from_model is None

    def refusal(self, source: Path, dtype: str, device: str, others: list[RuntimeKind]) -> str | None:
        """Why it cannot run ``source`` as asked (``--dtype``, ``--device``), in one line, before anything loads;
        ``others``: the runtimes to name instead."""
        if self.gguf_only and source.suffix.lower() != ".gguf":
            instead = " or ".join(kind.name for kind in others if not kind.gguf_only)
            return (f"--backend {self.name} runs a .gguf file, and {source} is not one (a transformers directory runs "
                    f"with --backend {instead})")
        if self.weights is not None and device not in ("auto", "cpu"):
            return f"--backend {self.name} runs on the CPU here, not on {device}"
        if self.weights is not None and dtype != "auto":
            takers = " or ".join(kind.name for kind in others if kind.weights is None)
            return f"--backend {self.name} runs {self.weights}; --dtype {dtype} is for --backend {takers}"
        reason = self.unavailable()
        return None if reason is None else f"--backend {self.name} cannot run here: {reason}"
