"""Loading what a run needs, one recipe for the Python API, the server, the audit and the benchmarks: the datastore
(checked before the slow load), the target, a draft model on the right backend (its vocabulary the target's or its
own, bridged by text), the target's runtime and stop ids (:class:`Loaded`); what each drafter drafts with; and prompts
as token ids.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from exactspec.backends import DEFAULT, CausalLM, DraftGrade, gguf_tokenizer, kind, kinds, runtime_of, target_backend
from exactspec.backends.gguf_file import read_gguf
from exactspec.choices import DRAFT_GRADES
from exactspec.draft_grades import RECIPES, chosen_grade, expected_gain
from exactspec.errors import UsageError
from exactspec.logs import detail, notice
from exactspec.models import (
    BORROWED,
    LoadedModel,
    chat_prompt_ids,
    default_model_path,
    eos_token_ids,
    load_model,
    model_path,
)
from exactspec.runtime_choice import resolve_backend


@dataclass
class Loaded:
    """A run's models: the target, a draft model (or None), the retrieval datastore (or None), and the precision
    flag the runtimes take ("auto": measured per kind of pass; None: as loaded); and what every caller runs the
    target with: its runtime (built once, when first asked for) and its stop ids."""

    target: LoadedModel
    draft: LoadedModel | None = None
    datastore: object | None = None
    precision: str | None = None
    draft_found: bool = False  # the draft model is the default model, found for a hybrid (no --draft-model given)
    draft_grade: str = "auto"  # what the draft model drafts as (choices.DRAFT_GRADES)
    _runtime: CausalLM | None = field(default=None, repr=False)

    @property
    def runtime(self) -> CausalLM:
        """The runtime that computes the target's tokens, probed for pass invariance as it is built."""
        if self._runtime is None:
            self._runtime = target_backend(self.target, self.precision)
        return self._runtime

    @property
    def stop_ids(self) -> set[int]:
        """The target's end-of-sequence ids: a round's emitted tokens are cut after the first."""
        return eos_token_ids(self.target)


def load_target(model: str | os.PathLike | None = None, *, dtype: str = "auto", device: str = "auto",
                backend: str = "auto", threads: int | None = None, datastore: str | os.PathLike | None = None,
                draft_model: str | os.PathLike | None = None, drafters: tuple[str, ...] = (),
                draft_grade: str = "auto", trained: tuple[str, ...] = ()) -> Loaded:
    """Check what can be checked first (the datastore, that the backend serves ``drafters``), then load the target
    and the draft model (its draft-grade copy as ``draft_grade`` says: ``choices.DRAFT_GRADES``), and check the
    datastore's vocabulary against the target's. Where no draft model is given and one of ``drafters`` drafts with
    one (the hybrid; draft-model, unless ``trained`` names it: given its trained drafter's directory), the installed
    model expected to pay most drafts (:func:`found_draft_model`)."""
    from exactspec import datastore as datastores
    from exactspec.proposers import finds_draft_model

    grade = draft_grade_of(draft_grade)
    store = None if datastore is None else datastores.load(datastore)
    resolved = resolve_backend(backend, model, dtype, device, threads)
    for drafter in drafters:
        check_backend_serves(drafter, resolved)
    finding = draft_model is None and any(finds_draft_model(drafter, drafter in trained) for drafter in drafters)
    with ThreadPoolExecutor(max_workers=1) as beside:  # the draft model loads beside the target: reading and checking
        # their files is work for a core each (the target's tokenizer, checksums), so the draft adds next to no start
        drafting = beside.submit(_draft_for, model_path(model), resolved, draft_model, finding, grade, dtype, device,
                                 threads)
        target = load_model(model, dtype=dtype, device=device, backend=resolved, threads=threads)
        draft, found = drafting.result()
    if draft is not None and draft.tokenizer is BORROWED:
        draft.tokenizer = target.tokenizer
    loaded = Loaded(target, draft, store, "auto" if dtype == "auto" else None, draft_found=found,
                    draft_grade=draft_grade)
    if store is not None:
        store.check_vocabulary(target.vocab_size)
    return loaded


def _draft_for(target_path, backend: str, draft_model, finding: bool, grade: DraftGrade | Measured | None, dtype: str,
               device: str, threads: int | None) -> tuple[LoadedModel | None, bool]:
    """The draft model given, or the one found (``finding``: :func:`found_draft_model`), loaded for a target at
    ``target_path`` on ``backend``; and whether it was found. Its tokenizer is ``BORROWED`` where it is the target's."""
    found = finding
    if finding:
        draft_model = found_draft_model(target_path)
    if draft_model is None:
        return None, False
    return load_draft(draft_model, target_path, backend, grade, dtype=dtype, device=device, threads=threads), found


def load_draft(draft_model: str | os.PathLike, target_path, target_backend: str,
               grade: DraftGrade | Measured | None, *,
               dtype: str = "auto", device: str = "auto", threads: int | None = None,
               target_tokenizer: object = BORROWED) -> LoadedModel:
    """A draft model for the target at ``target_path`` (on ``target_backend``), on the backend :func:`draft_backend`
    chooses, as its draft-grade copy where ``grade`` asks for one and that runtime makes one. Where it tokenizes as
    the target does, its tokenizer is ``target_tokenizer`` (``BORROWED``: the caller gives it the target's once
    loaded)."""
    resolved = resolve_backend(draft_backend(target_backend, draft_model), draft_model, dtype, device, threads)
    same = draft_prospect(target_path, draft_model)[0]
    if isinstance(grade, Measured):
        grade = _measured_grade(kind(resolved), model_path(draft_model), model_path(target_path), same, threads)
    return load_model(draft_model, dtype=dtype, device=device, backend=resolved, threads=threads, draft_grade=grade,
                      vocabulary=draft_vocabulary, tokenizer=target_tokenizer if same else None)


class Measured:
    """--draft-grade auto: the recipe :func:`draft_grades.chosen_grade` measures best for the pair, resolved to a
    :class:`DraftGrade` where the draft is loaded (``load_draft``): no runtime is handed it unresolved."""

    def __repr__(self) -> str:
        return "MEASURED"


MEASURED = Measured()


def draft_grade_of(name: str) -> DraftGrade | Measured | None:
    """--draft-grade ``name`` as the recipe a runtime makes a draft model's copy by (None: the model as loaded;
    ``MEASURED``: the one measured best for the pair, :func:`draft_grades.chosen_grade`); one line for a name there
    is none of."""
    if name not in DRAFT_GRADES:
        raise UsageError(f"--draft-grade must be one of {', '.join(DRAFT_GRADES)}, not {name!r}")
    return {"auto": MEASURED, "vocabulary": DraftGrade(bits=None), "off": None}[name]


def _measured_grade(runtime_kind, source, target, same: bool, threads: int | None) -> DraftGrade:
    """The recipe measured best for the pair, where the runtime makes draft-grade copies of a GGUF draft model; else
    the first recipe (which it then makes none of)."""
    if runtime_kind.draft_from_file is None or runtime_kind.from_file is None or source.suffix.lower() != ".gguf":
        return RECIPES[0]
    return chosen_grade(runtime_kind, source, target, PRIOR_ACCEPTANCE[same], lambda: gguf_tokenizer(source),
                        lambda: draft_vocabulary(gguf_tokenizer(source)), threads)


def draft_vocabulary(tokenizer) -> tuple:
    """A draft model's draft vocabulary (token ids, their coverage of the shipped corpus's held-out text), chosen as
    its draft-grade copy is made."""
    from exactspec.draft_vocabulary import DraftVocabulary

    chosen = DraftVocabulary.for_model(tokenizer, tokenizer.vocab_size)
    detail(f"the draft vocabulary: {chosen.size} tokens, {chosen.coverage:.1%} of the corpus's held-out tokens")
    return chosen.ids, chosen.coverage


# What the default drafter expects of a draft model before it has measured one (the hybrid's plan then measures its
# acceptance and cost, and drops a model that does not pay): its acceptance per draft position with the target's own
# tokenizer (Qwen2.5-Coder-0.5B for the 1.5B: 0.84 of draft tokens on HumanEval, docs/benchmarks.md) and across
# tokenizers (a bridged draft is accepted less: SmolLM2 for the 1.5B).
PRIOR_ACCEPTANCE = {True: 0.8, False: 0.55}
MIN_EXPECTED_GAIN = 1.1  # a found draft model drafts where it is expected to give this many times plain decoding's rate
DRAFT_GRADE_BITS = 5  # a draft-grade copy's bits a weight, scales included (4 bits, a float16 scale and offset per 32)
DRAFT_HEAD_ROWS = 65536  # about the rows its head keeps (draft_vocabulary.py chooses by coverage: 70,656 of Qwen2.5)


def found_draft_model(target_path) -> os.PathLike | None:
    """The draft model where none is given (the hybrid's; draft-model's without a trained drafter): of the models
    exactspec finds without being told (the default model, SmolLM2-135M, which ships with it; the larger models whose
    parts are installed, ``model_parts.py``), the one :func:`expected_gain` rates highest for ``target``, where that
    reaches ``MIN_EXPECTED_GAIN``; else None. --verbose says which, and why. Its vocabulary is checked once loaded
    (:func:`draft_source`)."""
    rated = []
    for path in draft_candidates(target_path):
        same, cost = draft_prospect(target_path, path)
        rated.append((expected_gain(PRIOR_ACCEPTANCE[same], cost), path, same, cost))
    if not rated:
        detail("no draft model found: none smaller than the target is installed")
        return None
    gain, path, same, cost = max(rated, key=lambda entry: entry[0])
    why = (f"{'its' if same else 'another'} tokenizer, a draft token {cost:.2f} of a target step as a draft-grade "
           f"copy: {gain:.2f}x plain decoding expected")
    if gain < MIN_EXPECTED_GAIN:
        detail(f"no draft model found: the best installed, {path.name} ({why}), is under {MIN_EXPECTED_GAIN:g}x")
        return None
    detail(f"the draft model found: {path.name} ({why})")
    return path


def draft_candidates(target_path) -> list:
    """The models found without being told that are smaller than the target: the default model, and each parted
    model whose parts are installed (assembled on first use; one as large as the target is not)."""
    from exactspec.model_parts import PARTED_MODELS, installed

    found = []
    try:
        found.append(default_model_path())
    except UsageError as error:
        detail(f"the default model cannot draft: {error}")
    size = stored_bytes(target_path)
    found += [model_path(name) for name, parted in PARTED_MODELS.items() if parted.size < size and installed(name)]
    return [path for path in found if stored_bytes(path) < size]


def draft_prospect(target_path, draft_path) -> tuple[bool, float]:
    """Whether a draft model tokenizes as the target does (both GGUFs of one vocabulary), and what a draft token
    would cost against a target step: the bytes a step of its draft-grade copy reads over the target's."""
    target_path, draft_path = model_path(target_path), model_path(draft_path)
    if target_path.suffix.lower() != ".gguf" or draft_path.suffix.lower() != ".gguf":
        return False, stored_bytes(draft_path) / stored_bytes(target_path)
    target, draft = read_gguf(target_path), read_gguf(draft_path)
    same = target.vocabulary_digest() is not None and target.vocabulary_digest() == draft.vocabulary_digest()
    return same, draft.streamed_bytes(DRAFT_GRADE_BITS, DRAFT_HEAD_ROWS) / target.streamed_bytes()


def encode_prompt(tokenizer, prompt: str, chat: bool | None = None) -> list[int]:
    """Token ids of the prompt; ``chat`` applies the chat template (None: when the model has one)."""
    if not prompt or not prompt.strip():
        raise UsageError("the prompt is empty")
    has_template = getattr(tokenizer, "chat_template", None) is not None
    if chat and not has_template:
        raise UsageError("--chat: this model's tokenizer has no chat template")
    if chat or (chat is None and has_template):
        return chat_prompt_ids(tokenizer, [{"role": "user", "content": prompt}])
    return list(tokenizer.encode(prompt))


def draft_source(drafter: str, target: LoadedModel, backend, draft: LoadedModel | None, precision: str | None,
                 drafter_path: str | os.PathLike | None = None, cross_vocabulary: str = "auto", found: bool = False):
    """What --drafter ``drafter`` drafts with: a draft model's backend (a transformers model, or a trained draft
    LM; a ``ForeignDraft`` where its tokenizer is not the target's, proposing by ``cross_vocabulary``), a trained
    network (the other drafters whose role is ``trained``), or None (drafters that copy); for a drafter that takes
    a draft model or trained heads beside its copies (the hybrid), its ``HybridSources``: it goes on without a draft
    model it cannot bridge (``found``: the default model, found for it, which says why at --verbose only) and
    without heads the target's runtime cannot feed."""
    from exactspec.drafters.loading import load_trained
    from exactspec.drafters.runtime import DraftLMRuntime
    from exactspec.proposers import check_drafter_path, role

    check_backend_serves(drafter, target.backend_name)
    declared = role(drafter)
    if declared.needs_draft_model and draft is not None:
        return draft_model_source(target, draft, runtime_of(draft, precision), cross_vocabulary)
    if declared.takes_draft_model or declared.takes_heads:
        check_drafter_path(drafter, drafter_path is not None)
        from exactspec.proposers.hybrid import HybridSources

        model = None if draft is None else bridged_draft(target, draft, runtime_of(draft, precision),
                                                         cross_vocabulary, found)
        return HybridSources(model, trained_heads(target, backend, drafter_path) if declared.takes_heads else ())
    if declared.trained:
        network = load_trained(drafter, target.transformers_model(), drafter_path)
        return DraftLMRuntime(network, backend.max_length) if declared.needs_draft_model else network
    check_drafter_path(drafter, drafter_path is not None)
    return None


HEAD_METHODS = ("eagle", "mtp")  # trained heads over the target's hidden states, which a hybrid drafts with too


def trained_heads(target: LoadedModel, backend: CausalLM, drafter_path: str | os.PathLike | None
                  ) -> tuple[tuple[str, object], ...]:
    """The trained heads a hybrid drafts with beside its other sources, each (method, network): the eagle or mtp
    drafter at ``drafter_path``. None are looked for where no path is given (those shipped for the default model
    included): a head reads the target's embedding and LM head in float32, a copy that takes seconds to make (3.5 s
    for the default model), for drafters that measured 1.03-1.11x alone there. Where the target's runtime hands over
    no hidden states, none, with one line saying so."""
    from exactspec.backends.base import FeatureSource, declares
    from exactspec.drafters.loading import load_trained, parse_drafter_paths

    if drafter_path is None:
        return ()
    method, directory = next(iter(parse_drafter_paths([str(drafter_path)]).items()))
    if method not in HEAD_METHODS:
        raise UsageError(f"--drafter-path {drafter_path} holds a trained {method} drafter; the hybrid drafts with "
                         f"trained heads ({', '.join(HEAD_METHODS)}) beside its copies: for it, --drafter {method}")
    if not declares(backend, FeatureSource):
        notice(f"the hybrid drafts without its {method} heads: {type(backend).__name__} hands over no hidden states of "
               "the target (--backend lean or fused does)")
        return ()
    return ((method, load_trained(method, target.transformers_model(), directory)),)


def draft_model_source(target: LoadedModel, draft: LoadedModel, runtime: CausalLM, cross_vocabulary: str = "auto"):
    """The draft model's runtime where it shares the target's vocabulary; else a ``ForeignDraft``: the runtime and
    the bridge between the two tokenizers' texts. A pair that shares under half of the target's frequent tokens gets
    one line saying so (it still drafts exactly; it is accepted less)."""
    from exactspec.vocabularies import LOW_OVERLAP

    check_cross_vocabulary(cross_vocabulary)
    source = _bridged(target, draft, runtime, cross_vocabulary)
    overlap = _overlap(source)
    if overlap < LOW_OVERLAP:
        notice(f"the draft model's vocabulary holds {overlap:.0%} of the target's frequent tokens: it drafts across "
               "tokenizers, exactly, but little of its text may be accepted")
    return source


def check_cross_vocabulary(method: str) -> None:
    """Refuse, in one line, a --cross-vocabulary method there is none of."""
    from exactspec.choices import CROSS_VOCABULARY_METHODS

    if method not in CROSS_VOCABULARY_METHODS:
        raise UsageError(f"--cross-vocabulary must be one of {', '.join(CROSS_VOCABULARY_METHODS)}, not {method!r}")


def _overlap(source) -> float:
    """The share of the target's frequent tokens a draft model's vocabulary holds (all, where it is the target's)."""
    from exactspec.proposers.draft_model import ForeignDraft

    return source.overlap if isinstance(source, ForeignDraft) else 1.0


def _bridged(target: LoadedModel, draft: LoadedModel, runtime: CausalLM, cross_vocabulary: str):
    """The draft model's runtime, or a ``ForeignDraft`` over it (proposing by ``cross_vocabulary``, which the caller
    checked) where its tokenizer is not the target's."""
    from exactspec.proposers.draft_model import ForeignDraft
    from exactspec.vocabularies import ChatFraming, ContextBridge, TokenText, frequent_overlap, same_vocabulary

    if same_vocabulary(target.tokenizer, draft.tokenizer):
        return runtime
    target_text = TokenText(target.tokenizer, target.vocab_size)
    draft_text = TokenText(draft.tokenizer, runtime.vocab_size)
    overlap = frequent_overlap(target_text, draft_text)
    bridge = ContextBridge(target_text, draft_text, ChatFraming.of(target.tokenizer), ChatFraming.of(draft.tokenizer))
    return ForeignDraft(runtime, bridge, cross_vocabulary, overlap=overlap)


def stored_bytes(path: os.PathLike) -> int:
    """The bytes of a model's weights as stored: its GGUF file, or a transformers directory's weight files."""
    path = model_path(path)
    if path.is_file():
        return path.stat().st_size
    return sum(file.stat().st_size for pattern in ("*.safetensors", "*.bin", "*.gguf") for file in path.glob(pattern))


def bridged_draft(target: LoadedModel, draft: LoadedModel, runtime: CausalLM, cross_vocabulary: str, found: bool):
    """A draft model beside other sources (the hybrid's): its source where its vocabulary is the target's or can be
    bridged to it (it holds ``LOW_OVERLAP`` of the target's frequent tokens or more); else None, with one line
    naming the model and why (at --verbose only where it was ``found``, not given)."""
    from exactspec.vocabularies import LOW_OVERLAP

    say = detail if found else notice
    check_cross_vocabulary(cross_vocabulary)  # a bad flag is refused, not a draft model left out
    try:
        source = _bridged(target, draft, runtime, cross_vocabulary)
    except UsageError as error:
        say(f"the hybrid drafts without {draft.source or draft.path}: {error}")
        return None
    overlap = _overlap(source)
    if overlap < LOW_OVERLAP:
        say(f"the hybrid drafts without {draft.source or draft.path}: its vocabulary holds {overlap:.0%} of the "
            f"target's frequent tokens, under {LOW_OVERLAP:.0%}")
        return None
    return source


def check_backend_serves(drafter: str, backend: str) -> None:
    """Refuse, in one line and before anything slow loads, a drafter that needs a capability (its role's ``needs``)
    that the settled backend's runtime does not declare (llama.cpp's declares no ShallowRunner)."""
    from exactspec.proposers import PROPOSERS, role

    needed = role(drafter).needs if drafter in PROPOSERS else None  # bench's own rows (hf-assisted, ...) are none
    if needed is None or needed in kind(backend).runtime.__mro__:
        return
    serving = " or ".join(k.name for k in kinds() if needed in k.runtime.__mro__)
    raise UsageError(f"--drafter {drafter} needs a {needed.__name__}, which {backend}'s runtime is not: use "
                     f"--backend {serving}")


def draft_backend(target_backend: str, draft_model: str | os.PathLike) -> str:
    """Where a draft model runs: where --backend auto measures it fastest beside a target whose runtime declares so
    (``measures_drafts``: llama.cpp, for a GGUF draft too); on the target's runtime where that reads the draft's
    file alone (the fused runtime: no conversion, the draft's passes cost what its weights' bytes do); else on the
    default runtime."""
    runtime = kind(target_backend)
    if runtime.measures_drafts:
        return "auto"
    return runtime.name if runtime.reads(model_path(draft_model)) else DEFAULT
