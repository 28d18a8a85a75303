"""The Python API: load a target (and optionally a draft model), generate text with a chosen drafter."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from specdec.backends import target_backend
from specdec.engine import Engine, GenerationConfig, GenerationStats, Round
from specdec.errors import UsageError
from specdec.models import LoadedModel, load_model, resolve_backend
from specdec.proposers import make_proposer
from specdec.sampling import SamplingParams
from specdec.view import Detokenizer


@dataclass
class Completion:
    text: str
    token_ids: list[int]  # generated ids only
    stats: GenerationStats
    kinds: list[str]  # per generated token: "accepted", "recovered", "bonus" or "plain"

    def to_dict(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "stats": self.stats.to_dict()}


class SpecDecoder:
    """A target model, a drafter and a tokenizer: text in, exactly-target-distributed text out.

    >>> decoder = SpecDecoder.load(drafter="prompt-lookup")          # the default model
    >>> decoder.generate("Write a haiku about the sea", max_new_tokens=32).text
    """

    def __init__(self, target: LoadedModel, drafter: str = "prompt-lookup", draft: LoadedModel | None = None,
                 precision: str | None = None, datastore=None, drafter_path: str | os.PathLike | None = None):
        """``precision``: None runs the models in the dtype they were loaded in; "auto" lets the lean runtime pick,
        per kind of pass, the fastest weight precision that keeps the target's outputs (see backends/precision.py).
        ``datastore``: a loaded retrieval datastore (specdec.datastore.load), for the retrieval drafter.
        ``drafter_path``: a trained drafter's directory (``specdec train``) for draft-model, mtp, eagle or early-exit; without
        it, the one shipped for the target.
        """
        if draft is not None:
            check_same_vocabulary(target, draft)
        self.target = target
        self.tokenizer = target.tokenizer
        self.drafter = drafter
        backend = target_backend(target, precision)
        proposer = make_proposer(drafter, backend, drafter_of(drafter, target, backend, draft, precision,
                                                              drafter_path), datastore)
        self.engine = Engine(backend, proposer, eos_token_ids=eos_token_ids(target))

    @classmethod
    def load(
        cls,
        model: str | os.PathLike | None = None,
        draft_model: str | os.PathLike | None = None,
        drafter: str | None = None,
        dtype: str = "auto",
        device: str = "auto",
        datastore: str | os.PathLike | None = None,
        drafter_path: str | os.PathLike | None = None,
        backend: str = "auto",
        threads: int | None = None,
    ) -> "SpecDecoder":
        """Load from local paths (a transformers directory or a .gguf file); ``model=None`` is the default model.

        ``backend``: torch (specdec's runtime), llama.cpp (the GGUF's weights as stored) or auto (llama.cpp for a
        .gguf file on the CPU with ``dtype="auto"``, else torch); ``threads``: llama.cpp's CPU threads.

        ``drafter`` defaults to ``draft-model`` when a draft model is given, ``retrieval`` when a datastore is,
        the method of the drafter at ``drafter_path`` when one is given, else ``prompt-lookup``.
        """
        from specdec import datastore as datastores
        from specdec.drafters.loading import parse_drafter_paths

        if drafter_path is not None and drafter is None:
            drafter = next(iter(parse_drafter_paths([str(drafter_path)])))
        drafter = drafter or ("draft-model" if draft_model is not None else
                              "retrieval" if datastore is not None else "prompt-lookup")
        if draft_model is not None and drafter_path is not None:
            raise UsageError("give a draft model either as --draft-model (a transformers model) or as "
                             "--drafter-path (a trained drafter), not both")
        if datastore is not None and drafter != "retrieval":
            raise UsageError(f"--datastore drafts only with --drafter retrieval, not {drafter}")
        store = None if datastore is None else datastores.load(datastore)  # checked before the slow model load
        check_backend_serves(drafter, resolve_backend(backend, model, dtype, device))
        target = load_model(model, dtype=dtype, device=device, backend=backend, threads=threads)
        draft = load_model(draft_model, dtype=dtype, device=device, backend=draft_backend(target), threads=threads) \
            if drafter == "draft-model" and draft_model is not None else None
        if store is not None:
            store.check_vocabulary(target.vocab_size)
        return cls(target, drafter=drafter, draft=draft, precision="auto" if dtype == "auto" else None,
                   datastore=store, drafter_path=drafter_path)

    def encode(self, prompt: str, chat: bool | None = None) -> list[int]:
        """Token ids of the prompt; ``chat`` applies the chat template (None: when the model has one)."""
        if not prompt or not prompt.strip():
            raise UsageError("the prompt is empty")
        has_template = getattr(self.tokenizer, "chat_template", None) is not None
        if chat and not has_template:
            raise UsageError("--chat: this model's tokenizer has no chat template")
        if chat or (chat is None and has_template):
            return chat_prompt_ids(self.tokenizer, [{"role": "user", "content": prompt}])
        return list(self.tokenizer.encode(prompt))

    def generate(
        self,
        prompt: str,
        *,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        num_draft_tokens: int | str = 4,
        tree: tuple[int, ...] | str | None = None,
        chat: bool | None = None,
        on_text: Callable[[str], None] | None = None,
    ) -> Completion:
        """Generate a completion; ``on_text`` receives the text as it is produced. ``tree``: draft token trees,
        the candidates at each depth, or "auto" (as ``--tree``)."""
        config = GenerationConfig(
            max_new_tokens=max_new_tokens,
            num_draft_tokens=num_draft_tokens,
            sampling=SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p),
            seed=seed,
            tree=tree,
        )
        return self.generate_ids(self.encode(prompt, chat), config, on_text)

    def generate_ids(
        self,
        prompt_ids: list[int],
        config: GenerationConfig,
        on_text: Callable[[str], None] | None = None,
        on_token: Callable[[str, str], None] | None = None,
    ) -> Completion:
        """Generate from token ids. ``on_text`` receives text as it is produced; ``on_token`` receives each
        token's piece of text and its kind ("accepted", "recovered", "bonus" or "plain")."""
        if on_text is not None:
            on_token = lambda piece, kind, on_text=on_text: piece and on_text(piece)  # noqa: E731
        detokenizer = Detokenizer(self.tokenizer)

        def on_round(round_: Round) -> None:
            for token, kind in zip(round_.tokens, round_.kinds):
                on_token(detokenizer.push(token), kind)

        result = self.engine.generate(prompt_ids, config, on_round=on_round if on_token is not None else None)
        if on_token is not None and result.kinds:
            on_token(detokenizer.flush(), result.kinds[-1])
        text = self.tokenizer.decode(result.token_ids, skip_special_tokens=True)
        return Completion(text=text, token_ids=result.token_ids, stats=result.stats, kinds=result.kinds)


def drafter_of(drafter: str, target: LoadedModel, backend, draft: LoadedModel | None, precision: str | None,
               drafter_path: str | os.PathLike | None = None):
    """What the proposer ``drafter`` drafts with: a draft model's backend (a transformers model, or a trained draft
    LM), a trained network (mtp, eagle, early-exit), or None."""
    from specdec.drafters.loading import TRAINED_METHODS, load_trained
    from specdec.drafters.runtime import DraftLMRuntime

    check_backend_serves(drafter, target.backend_name)
    if drafter == "draft-model" and draft is not None:
        return target_backend(draft, precision)
    if drafter in TRAINED_METHODS:
        network = load_trained(drafter, target.transformers_model(), drafter_path)
        return DraftLMRuntime(network, backend.max_length) if drafter == "draft-model" else network
    if drafter_path is not None:
        raise UsageError(f"--drafter-path is for trained drafters (draft-model, mtp, eagle, early-exit), not {drafter}")
    return None


# drafters that need the target's first layers alone, which llama.cpp's runtime does not run
TORCH_ONLY_DRAFTERS = {
    "early-exit": "drafts with the target's first layers alone",
}


def check_backend_serves(drafter: str, backend: str) -> None:
    """Refuse, in one line, a drafter that the target's backend cannot serve."""
    if backend == "llama.cpp" and drafter in TORCH_ONLY_DRAFTERS:
        raise UsageError(f"--drafter {drafter} {TORCH_ONLY_DRAFTERS[drafter]}, which the llama.cpp backend does "
                         "not give: use --backend torch")


def draft_backend(target: LoadedModel) -> str:
    """Where a draft model runs: on llama.cpp too when it is a GGUF file and the target runs there (auto), else on
    torch, as the target."""
    return "auto" if target.backend_name == "llama.cpp" else "torch"


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of chat messages through the tokenizer's chat template, ready for the assistant's answer."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # transformers 5 returns a BatchEncoding


def check_same_vocabulary(target: LoadedModel, draft: LoadedModel) -> None:
    """Refuse a draft model whose tokenizer maps text to other ids than the target's."""
    target_vocab = target.tokenizer.get_vocab()
    draft_vocab = draft.tokenizer.get_vocab()
    if target_vocab != draft_vocab:
        differing = sum(1 for token, i in draft_vocab.items() if target_vocab.get(token) != i)
        raise UsageError(
            f"the draft model's vocabulary differs from the target's ({len(draft_vocab)} vs {len(target_vocab)} "
            f"tokens, {differing} mapped differently): a draft model must share the target's tokenizer"
        )


def eos_token_ids(loaded: LoadedModel) -> set[int]:
    """Token ids that end a generation: the tokenizer's EOS and the generation config's."""
    ids = set()
    if loaded.tokenizer.eos_token_id is not None:
        ids.add(int(loaded.tokenizer.eos_token_id))
    config_eos = getattr(getattr(loaded.model, "generation_config", None), "eos_token_id", None)
    if config_eos is not None:
        ids.update([config_eos] if isinstance(config_eos, int) else config_eos)
    return ids
