"""The Python API: load a target (and optionally a draft model), generate text with a chosen drafter."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass

from exactspec.choices import DEFAULT_DRAFTER, DEFAULT_SAMPLING_METHOD, MAX_STOP_STRINGS, check_datastore_drafter
from exactspec.engine import Engine, GenerationConfig, GenerationStats
from exactspec.errors import UsageError
from exactspec.grammars import Grammar, GrammarSpec, grammar_for
from exactspec.loading import Loaded, draft_source, encode_prompt, load_target
from exactspec.models import LoadedModel
from exactspec.proposers import make_proposer, role, takes_draft_model
from exactspec.rounds import TokenLogprobs
from exactspec.sampling import LogitsAdjustment, SamplingParams
from exactspec.step import Round
from exactspec.stops import StopText
from exactspec.view import Detokenizer
from exactspec.vocabularies import TokenText


@dataclass
class Completion:
    text: str
    token_ids: list[int]  # generated ids only
    stats: GenerationStats
    kinds: list[str]  # per generated token: "accepted", "recovered", "bonus" or "plain"
    finish_reason: str = "length"  # "stop" (EOS, a stop string or the grammar's end) or "length"
    # per generated token, where asked: its log-probability and the most likely (token id, log-probability) there
    logprobs: TokenLogprobs | None = None

    def to_dict(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "finish_reason": self.finish_reason,
                "stats": self.stats.to_dict(),
                **({} if self.logprobs is None else {"logprobs": [[lp, top] for lp, top in self.logprobs]})}


class SpecDecoder:
    """A target model, a drafter and a tokenizer: text in, exactly-target-distributed text out.

    >>> decoder = SpecDecoder.load(drafter="prompt-lookup")          # the default model
    >>> decoder.generate("Write a haiku about the sea", max_new_tokens=32).text
    """

    def __init__(self, target: LoadedModel, drafter: str = DEFAULT_DRAFTER,
                 draft: LoadedModel | None = None, precision: str | None = None, datastore=None,
                 drafter_path: str | os.PathLike | None = None, cross_vocabulary: str = "auto",
                 draft_found: bool = False):
        """``precision``: None runs the models in the dtype they were loaded in; "auto" lets the lean runtime pick,
        per kind of pass, the fastest weight precision that keeps the target's outputs (see backends/lean/precision.py).
        ``datastore``: a loaded retrieval datastore (exactspec.datastore.load), for the retrieval drafter.
        ``drafter_path``: a trained drafter's directory (``exactspec train``) for draft-model, mtp, eagle or
        early-exit; without it, the one shipped for the target.
        ``cross_vocabulary``: how a draft model with another tokenizer than the target's proposes: "text"
        (string-level exact match), "intersection" (the tokens both vocabularies hold) or "auto" (intersection when
        greedy with a draft that holds half of the target's frequent tokens or more, else text).
        ``draft_found``: ``draft`` is the default model, found to draft for the hybrid (not given by the user).
        """
        self.target = target
        self.tokenizer = target.tokenizer
        self.drafter = drafter
        loaded = Loaded(target, draft, datastore, precision)
        source = draft_source(drafter, target, loaded.runtime, draft, precision, drafter_path, cross_vocabulary,
                              draft_found)
        proposer = make_proposer(drafter, loaded.runtime, source, datastore)
        self.engine = Engine(loaded.runtime, proposer, eos_token_ids=loaded.stop_ids)
        self.stop_ids = loaded.stop_ids

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
        cross_vocabulary: str = "auto",
        draft_grade: str = "auto",
    ) -> SpecDecoder:
        """Load from local paths (a transformers directory or a .gguf file); ``model=None`` is the default model.

        ``backend``: lean (exactspec's runtime in PyTorch; ``torch``, its old name, is taken too), fused, llama.cpp
        (the GGUF's weights as stored) or auto (on the CPU with ``dtype="auto"`` the one measured fastest for this
        target here, else lean); ``threads``: llama.cpp's CPU threads.

        ``drafter`` defaults to the method of the drafter at ``drafter_path`` when one is given, else the hybrid,
        which drafts with a given draft model, datastore, or (named, with ``drafter_path``) trained eagle or mtp
        heads beside its copies. A draft model may have any tokenizer (``cross_vocabulary``, as in the
        constructor); ``draft_grade`` (``choices.DRAFT_GRADES``): whether it drafts as its draft-grade copy (a
        draft vocabulary, 4-bit matrices: ``backends/fused/draft_grade.py``), made once where its runtime makes one.
        """
        from exactspec.drafters.loading import parse_drafter_paths

        if drafter_path is not None and drafter is None:
            drafter = next(iter(parse_drafter_paths([str(drafter_path)])))
        drafter = drafter or DEFAULT_DRAFTER
        if draft_model is not None and drafter_path is not None and not role(drafter).takes_heads:
            raise UsageError("give a draft model either as --draft-model (a transformers model) or as "
                             "--drafter-path (a trained drafter), not both")
        check_datastore_drafter(drafter, datastore is not None)
        loaded = load_target(model, dtype=dtype, device=device, backend=backend, threads=threads, datastore=datastore,
                             draft_model=draft_model if takes_draft_model(drafter) else None,
                             drafters=(drafter,), draft_grade=draft_grade,
                             trained=(drafter,) if drafter_path is not None else ())
        return cls(loaded.target, drafter=drafter, draft=loaded.draft, precision=loaded.precision,
                   datastore=loaded.datastore, drafter_path=drafter_path, cross_vocabulary=cross_vocabulary,
                   draft_found=loaded.draft_found)

    def encode(self, prompt: str, chat: bool | None = None) -> list[int]:
        """Token ids of the prompt; ``chat`` applies the chat template (None: when the model has one)."""
        return encode_prompt(self.tokenizer, prompt, chat)

    def generate(
        self,
        prompt: str,
        *,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        sampling: str = DEFAULT_SAMPLING_METHOD,
        num_draft_tokens: int | str = "auto",
        tree: tuple[int, ...] | str | None = None,
        chat: bool | None = None,
        on_text: Callable[[str], None] | None = None,
        grammar: GrammarSpec | None = None,
        json_schema: dict | type | None = None,
        regex: str | None = None,
        stop: str | list[str] | None = None,
        logprobs: int | None = None,
        logit_bias: dict[int, float] | None = None,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
    ) -> Completion:
        """Generate a completion; ``on_text`` receives the text as it is produced. ``num_draft_tokens``: "auto"
        (the default: each round's draft length maximises expected tokens per second, from acceptance and costs
        measured as it runs, and is 0 where speculation does not pay), a fixed k, or "heuristic". ``tree``: draft
        token trees, the candidates at each depth, or "auto" (as ``--tree``). ``sampling``: "invariant" or
        "standard" (as ``--sampling``). Structured output, one of: ``json_schema`` (a JSON Schema, or a pydantic
        model class), ``regex``, or any ``grammar`` (``GrammarSpec``: a Lark or GBNF grammar too).

        As the server's requests: ``stop``, up to 4 strings that end the text (the text stops before the first;
        its tokens run through the token that completed it); ``logprobs``, each token's log-probability and the
        ``logprobs`` most likely tokens at its place (0-20), under the distribution it was drawn from;
        ``logit_bias`` (token id -> a number added to its logit), ``presence_penalty`` and ``frequency_penalty``
        (OpenAI's, over the tokens generated)."""
        config = GenerationConfig(
            max_new_tokens=max_new_tokens,
            num_draft_tokens=num_draft_tokens,
            sampling=SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, method=sampling),
            seed=seed,
            tree=tree,
            logprobs=logprobs,
            adjustment=LogitsAdjustment(dict(logit_bias or {}), presence_penalty, frequency_penalty),
        )
        spec = structured_output(grammar, json_schema, regex)
        return self.generate_ids(self.encode(prompt, chat), config, on_text, grammar=spec, stop=stop_strings(stop))

    @functools.cached_property
    def token_text(self) -> TokenText:
        """The tokenizer as bytes per token, over the target's logits' width (what a grammar reads)."""
        return TokenText(self.tokenizer, self.engine.target.vocab_size)

    def grammar(self, spec: GrammarSpec) -> Grammar:
        """A fresh matcher for ``spec`` over the target's vocabulary; GrammarError where it does not compile."""
        return grammar_for(spec, self.token_text, self.stop_ids)

    def generate_ids(
        self,
        prompt_ids: list[int],
        config: GenerationConfig,
        on_text: Callable[[str], None] | None = None,
        on_token: Callable[[str, str], None] | None = None,
        grammar: GrammarSpec | None = None,
        stop: tuple[str, ...] = (),
    ) -> Completion:
        """Generate from token ids. ``on_text`` receives text as it is produced; ``on_token`` receives each
        token's piece of text and its kind ("accepted", "recovered", "bonus" or "plain"); ``grammar`` constrains
        the tokens; ``stop`` strings end them (the text is cut before the first)."""
        if on_text is not None:
            on_token = lambda piece, kind, on_text=on_text: piece and on_text(piece)  # noqa: E731
        detokenizer = Detokenizer(self.tokenizer)

        def on_round(round_: Round) -> None:
            for token, kind in zip(round_.tokens, round_.kinds):
                on_token(detokenizer.push(token), kind)

        stop_text = StopText(self.tokenizer, stop) if stop else None
        result = self.engine.generate(prompt_ids, config, on_round=on_round if on_token is not None else None,
                                      grammar=None if grammar is None else self.grammar(grammar), stop=stop_text)
        if on_token is not None and result.kinds:
            on_token(detokenizer.flush(), result.kinds[-1])
        text = self.tokenizer.decode(result.token_ids, skip_special_tokens=True)
        if stop_text is not None and stop_text.stopped:
            text = text[: min((i for i in map(text.find, stop) if i >= 0), default=len(text))]
        return Completion(text=text, token_ids=result.token_ids, stats=result.stats, kinds=result.kinds,
                          finish_reason=result.finish_reason, logprobs=result.logprobs)


def stop_strings(stop: str | list[str] | tuple[str, ...] | None) -> tuple[str, ...]:
    """The stop strings given (one, or a list of up to MAX_STOP_STRINGS non-empty ones) as a tuple."""
    strings = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if len(strings) > MAX_STOP_STRINGS or not all(isinstance(s, str) and s for s in strings):
        raise UsageError(f"stop takes up to {MAX_STOP_STRINGS} non-empty strings, got {stop!r}")
    return strings


def structured_output(grammar: GrammarSpec | None, json_schema: dict | type | None, regex: str | None
                      ) -> GrammarSpec | None:
    """The one grammar given (a pydantic model class stands for its JSON Schema); None for none."""
    given = [g for g in (grammar, json_schema, regex) if g is not None]
    if len(given) > 1:
        raise UsageError("give one of grammar, json_schema and regex")
    if json_schema is not None:
        schema = json_schema.model_json_schema() if isinstance(json_schema, type) else json_schema
        return GrammarSpec.json_schema(schema)
    return GrammarSpec("regex", regex) if regex is not None else grammar
