"""The things a benchmark compares: exactspec drafters, and transformers' own assisted generation as reference.

Every contender decodes one prompt under one GenerationConfig from a cold cache and says what it did.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from exactspec.engine import Engine, GenerationConfig
from exactspec.errors import UsageError


@dataclass(frozen=True)
class Outcome:
    """One contender's run on one prompt. Counters a contender cannot observe are None."""

    token_ids: list[int]
    seconds: float
    rounds: int | None = None
    draft_tokens: int | None = None  # a tree counts its depth
    draft_nodes: int | None = None  # draft positions scored: a tree counts its nodes
    accepted_tokens: int | None = None
    draft_seconds: float | None = None
    target_seconds: float | None = None
    drafted_at: tuple[int, ...] = ()  # per draft position, tokens drafted there (GenerationStats.drafted_at)
    accepted_at: tuple[int, ...] = ()  # per draft position, tokens accepted there
    # a combined drafter's (the hybrid's) sources: name -> (draft tokens, accepted tokens) (GenerationStats.sources)
    sources: dict[str, tuple[int, int]] = field(default_factory=dict)


class Contender(Protocol):
    name: str
    num_draft_tokens: int | str

    def run(self, prompt_ids: list[int], config: GenerationConfig) -> Outcome: ...


class ExactspecContender:
    """A exactspec engine: a drafter over the shared target backend, with its own draft length or policy (0: the
    baseline, which drafts nothing)."""

    def __init__(self, name: str, engine: Engine, num_draft_tokens: int | str,
                 tree: tuple[int, ...] | str | None = None) -> None:
        self.name = name
        self.engine = engine
        self.num_draft_tokens = num_draft_tokens
        self.tree = tree

    def run(self, prompt_ids: list[int], config: GenerationConfig) -> Outcome:
        self.engine.clear_cache()
        if self.num_draft_tokens:
            config = replace(config, num_draft_tokens=self.num_draft_tokens, tree=self.tree)
        result = self.engine.generate(prompt_ids, config)
        s = result.stats
        return Outcome(token_ids=result.token_ids, seconds=s.seconds, rounds=s.rounds, draft_tokens=s.draft_tokens,
                       draft_nodes=s.draft_nodes, accepted_tokens=s.accepted_tokens, draft_seconds=s.draft_seconds,
                       target_seconds=s.target_seconds, drafted_at=tuple(s.drafted_at),
                       accepted_at=tuple(s.accepted_at),
                       sources={name: (drafted, accepted) for name, (drafted, accepted) in s.sources.items()})


class TransformersContender:
    """transformers' ``generate`` with its own speculation settings (prompt lookup, an assistant model)."""

    def __init__(self, name: str, model, num_draft_tokens: int | str, eos_token_ids: set[int], **generate_kwargs
                 ) -> None:
        self.name = name
        self.model = model
        self.num_draft_tokens = num_draft_tokens
        self.eos_token_ids = sorted(eos_token_ids)
        self.generate_kwargs = generate_kwargs

    def run(self, prompt_ids: list[int], config: GenerationConfig) -> Outcome:
        params = config.sampling
        sampling = (
            {"do_sample": False}
            if params.greedy
            else {"do_sample": True, "temperature": params.temperature, "top_k": params.top_k or None,
                  "top_p": params.top_p}
        )
        if config.seed is not None:
            torch.manual_seed(config.seed)
        input_ids = torch.tensor([prompt_ids], device=self.model.device)
        with torch.inference_mode():
            start = time.perf_counter()
            out = self.model.generate(
                input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=config.max_new_tokens,
                eos_token_id=self.eos_token_ids or None, pad_token_id=(self.eos_token_ids or [0])[0],
                **sampling, **self.generate_kwargs,
            )
            seconds = time.perf_counter() - start
        return Outcome(token_ids=out[0, len(prompt_ids):].tolist(), seconds=seconds)


class LlamaCppContender:
    """llama-cpp-python's own ``Llama.generate`` on the same GGUF file and threads: plain greedy decoding, or its
    prompt-lookup speculation (``LlamaPromptLookupDecoding``) with ``num_draft_tokens`` tokens per draft."""

    def __init__(self, name: str, gguf: str, num_draft_tokens: int, eos_token_ids: set[int], threads: int,
                 context: int = 8192) -> None:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        self.name = name
        self.num_draft_tokens = num_draft_tokens
        self.eos_token_ids = frozenset(eos_token_ids)
        draft = LlamaPromptLookupDecoding(num_pred_tokens=num_draft_tokens) if num_draft_tokens else None
        self.llama = Llama(model_path=gguf, n_ctx=context, n_threads=threads, n_threads_batch=threads,
                           draft_model=draft, verbose=False)

    def run(self, prompt_ids: list[int], config: GenerationConfig) -> Outcome:
        params = config.sampling
        if not params.greedy:
            raise UsageError(f"{self.name} decodes greedily only (--temperature 0)")
        self.llama.reset()  # a cold cache, as every contender
        tokens: list[int] = []
        start = time.perf_counter()
        for token in self.llama.generate(prompt_ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, reset=True):
            tokens.append(int(token))
            if len(tokens) >= config.max_new_tokens or (config.stop_at_eos and token in self.eos_token_ids):
                break
        return Outcome(token_ids=tokens, seconds=time.perf_counter() - start)
