"""``exactspec bench``: every configuration on the same prompts, in one process, interleaved per prompt."""

from __future__ import annotations

import functools
import json
import platform
import sys
from dataclasses import replace
from pathlib import Path

import torch

from exactspec.backends import CausalLM, precision_of
from exactspec.bench.contenders import Contender, ExactspecContender, LlamaCppContender, TransformersContender
from exactspec.bench.prompts import select_prompts
from exactspec.bench.report import BASELINE, Run, build_report, markdown
from exactspec.bench.roofline import measure_roofline, roofline_markdown
from exactspec.choices import CROSS_VOCABULARY_METHODS, DRAFT_GRADES, parse_num_draft_tokens, parse_tree
from exactspec.drafters.loading import parse_drafter_paths
from exactspec.engine import Engine, GenerationConfig
from exactspec.errors import UsageError
from exactspec.loading import Loaded, draft_grade_of, draft_source, encode_prompt, load_draft, load_target
from exactspec.proposers import PROPOSERS, NoProposer, make_proposer, role, takes_draft_model
from exactspec.sampling import SamplingParams

HF_DEFAULT_PROMPT_LOOKUP_TOKENS = 10  # transformers' own default, for an hf-prompt-lookup asked for an adaptive k


def _hf_prompt_lookup(name: str, target, draft, k: int | str, eos: set[int]) -> Contender:
    tokens = k if isinstance(k, int) else HF_DEFAULT_PROMPT_LOOKUP_TOKENS  # transformers has no adaptive lookup
    return TransformersContender(name, target.model, tokens, eos, prompt_lookup_num_tokens=tokens)


def _hf_assisted(name: str, target, draft, k: int | str, eos: set[int]) -> Contender:
    config = draft.model.generation_config
    config.num_assistant_tokens = k if isinstance(k, int) else 4
    config.num_assistant_tokens_schedule = "constant" if isinstance(k, int) else "heuristic"
    return TransformersContender(name, target.model, k, eos, assistant_model=draft.model)


def _llamacpp(name: str, target, draft, k: int | str, eos: set[int], prompt_lookup: bool = False) -> Contender:
    tokens = 0 if not prompt_lookup else k if isinstance(k, int) else HF_DEFAULT_PROMPT_LOOKUP_TOKENS  # its default too
    return LlamaCppContender(name, str(target.gguf), tokens, eos, _threads_of(target))


def _threads_of(target) -> int:
    """The CPU threads the target's runtime runs on (llama.cpp's, the fused runtime's team), else torch's."""
    return getattr(target.runtime, "threads", None) or torch.get_num_threads()


# the field's references: transformers' own assisted generation, and llama-cpp-python's own decoding on the same
# GGUF; name -> factory(label, target, draft, k, eos ids)
REFERENCE_CONTENDERS = {"hf-prompt-lookup": _hf_prompt_lookup, "hf-assisted": _hf_assisted, "llamacpp": _llamacpp,
                        "llamacpp-prompt-lookup": functools.partial(_llamacpp, prompt_lookup=True)}
NEEDS_TRANSFORMERS = {"hf-prompt-lookup", "hf-assisted"}
NEEDS_GGUF = {"llamacpp", "llamacpp-prompt-lookup"}
NEEDS_DRAFT_MODEL = {"hf-assisted"}


def parse_contender(spec: str, default_k: int | str) -> tuple[str, int | str, tuple[int, ...] | str | None]:
    """``name``, ``name:k`` or ``name:k:tree`` (k an integer, auto or heuristic; tree the candidates per depth,
    as 3/2/1, or auto) -> (drafter name, k, tree widths, "auto" or None). A name may end in ``@grade``: its draft
    model drafts as that --draft-grade says (``draft-model@off``: the model as it is)."""
    name, _, rest = spec.partition(":")
    k, _, tree = rest.partition(":")
    name, _, grade = name.partition("@")
    if grade and grade not in DRAFT_GRADES:
        raise UsageError(f"{spec}: a draft grade is one of {', '.join(DRAFT_GRADES)}, not {grade!r}")
    if grade and not (name.partition("/")[0] in PROPOSERS and takes_draft_model(name.partition("/")[0])):
        raise UsageError(f"{spec}: only a drafter that drafts with a draft model takes @grade")
    name, _, method = name.partition("/")
    if method and (name != "draft-model" or method not in CROSS_VOCABULARY_METHODS):
        raise UsageError(f"{spec}: only draft-model takes a cross-vocabulary method (draft-model/"
                         f"{'|'.join(CROSS_VOCABULARY_METHODS)})")
    if name not in PROPOSERS and name not in REFERENCE_CONTENDERS:
        raise UsageError(f"unknown drafter {name!r}; choose from "
                         f"{', '.join(list(PROPOSERS) + list(REFERENCE_CONTENDERS))}")
    if tree and name in REFERENCE_CONTENDERS:
        raise UsageError(f"{name} drafts no trees")
    return name + (f"/{method}" if method else "") + (f"@{grade}" if grade else ""), \
        parse_num_draft_tokens(k) if k else default_k, parse_tree(tree or None)


def build_contenders(specs: list[str], loaded: Loaded, num_draft_tokens: int | str,
                     drafter_paths: dict[str, str] | None = None) -> tuple[list[Contender], CausalLM]:
    """One contender per spec (``name`` or ``name:k``), ``none`` (the baseline) first; and the target backend
    exactspec's contenders share. Trained drafters come from ``drafter_paths`` (method -> directory), else from
    those shipped for the target; one drafter serves every spec of its method. The draft model, given or found
    for the hybrid (``loaded.draft_found``), drafts for every contender that drafts with one."""
    target, draft, precision, datastore = loaded.target, loaded.draft, loaded.precision, loaded.datastore
    parsed = {spec: parse_contender(spec, num_draft_tokens) for spec in dict.fromkeys(specs) if spec != BASELINE}
    names = {name for name, _, _ in parsed.values()}
    if (draft is None or loaded.draft_found) and NEEDS_DRAFT_MODEL & names:  # transformers' assistant: a given one
        raise UsageError("the hf-assisted configuration needs --draft-model PATH")
    if target.model is None and NEEDS_TRANSFORMERS & names:
        raise UsageError(f"{', '.join(sorted(NEEDS_TRANSFORMERS & names))} run transformers: use --backend lean")
    if target.gguf is None and NEEDS_GGUF & names:
        raise UsageError(f"{', '.join(sorted(NEEDS_GGUF & names))} run a .gguf file: the target is not one")
    backend, eos = loaded.runtime, loaded.stop_ids
    drafts = {loaded.draft_grade: draft}  # what the draft model drafts as -> the draft model loaded so
    sources: dict[str, object] = {}  # --drafter name -> what it drafts with, one for every spec of that name
    contenders: list[Contender] = [ExactspecContender(BASELINE, Engine(backend, NoProposer(), eos), 0)]
    for spec, (name, k, tree) in parsed.items():
        if name in REFERENCE_CONTENDERS:
            contenders.append(REFERENCE_CONTENDERS[name](spec, target, draft, k, eos))
        else:
            named, _, grade = name.partition("@")
            drafter, _, method = named.partition("/")
            store = datastore if role(drafter).reads_datastore else None
            if draft is not None and grade and grade not in drafts:
                drafts[grade] = load_draft(draft.source or draft.path, target.source or target.path,
                                           target.backend_name, draft_grade_of(grade), threads=_threads_of(target),
                                           target_tokenizer=target.tokenizer)
            if name not in sources:
                sources[name] = draft_source(drafter, target, backend, drafts[grade or loaded.draft_grade], precision,
                                             (drafter_paths or {}).get(drafter), method or "auto",
                                             found=loaded.draft_found)
            engine = Engine(backend, make_proposer(drafter, backend, sources[name], store), eos_token_ids=eos)
            engine.check_tree(tree)
            contenders.append(ExactspecContender(spec, engine, k, tree))
    return contenders, backend


def exactspec_drafters(specs: list[str]) -> tuple[str, ...]:
    """The exactspec drafters the contender specs name (``hybrid`` of ``hybrid:auto``; not the field's references):
    what ``load_target`` checks the backend against, and finds a draft model for where one of them takes it."""
    drafters = (spec.partition(":")[0].partition("@")[0].partition("/")[0] for spec in specs)
    return tuple(dict.fromkeys(name for name in drafters if name in PROPOSERS))


def _comma_separated(values: list[str]) -> list[str]:
    """The items of flags given once or more, each a comma-separated list, in order."""
    return [item.strip() for value in values for item in value.split(",") if item.strip()]


def run_interleaved(contenders: list[Contender], prompts: list[tuple[str, str, list[int]]],
                    config: GenerationConfig, repeats: int, seed: int | None, progress: bool = True) -> list[Run]:
    """Each prompt, each repeat: every contender once, the order rotated so none always goes first."""
    from tqdm import tqdm

    runs = []
    bar = tqdm(total=len(prompts) * repeats * len(contenders), disable=not progress, unit="run", file=sys.stderr)
    for i, (prompt_id, category, ids) in enumerate(prompts):
        for repeat in range(repeats):
            shift = (i * repeats + repeat) % len(contenders)
            run_config = replace(config, seed=None if seed is None else seed + i * repeats + repeat)
            for contender in contenders[shift:] + contenders[:shift]:
                bar.set_postfix_str(f"{contender.name} on {prompt_id}", refresh=False)
                runs.append(Run(contender.name, prompt_id, category, contender.run(ids, run_config), run_config.seed))
                bar.update()
    bar.close()
    return runs


def run_bench(args) -> int:
    k = parse_num_draft_tokens(args.num_draft_tokens)
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, num_draft_tokens=k,
                              sampling=SamplingParams(temperature=args.temperature, top_k=args.top_k,
                                                      top_p=args.top_p, method=args.sampling))
    if args.repeats < 1:
        raise UsageError(f"--repeats must be >= 1, got {args.repeats}")
    names = _comma_separated([args.drafters])
    drafter_paths = parse_drafter_paths(args.drafter_path)  # checked before the slow model load
    paths, categories = _comma_separated(args.prompts), _comma_separated([args.category] if args.category else [])
    bench_prompts = select_prompts(paths, categories or None, args.per_category, args.limit, args.last)

    loaded = load_target(args.model, dtype=args.dtype, device=args.device, backend=args.backend,
                         threads=args.threads, datastore=args.datastore, draft_model=args.draft_model,
                         drafters=exactspec_drafters(names), draft_grade=args.draft_grade,
                         trained=tuple(drafter_paths))
    target = loaded.target
    contenders, backend = build_contenders(names, loaded, k, drafter_paths)
    prompts = [(p.id, p.category, encode_prompt(target.tokenizer, p.text, None if p.chat else False))
               for p in bench_prompts]

    contenders[0].run(prompts[0][2], replace(config, seed=0))  # warm-up: first-call costs out of the timings
    runs = run_interleaved(contenders, prompts, config, args.repeats, args.seed, progress=not args.no_progress)
    roofline = measure_roofline(backend, prompts[0][2])
    settings = {
        "prompts": paths, "categories": categories or None, "per_category": args.per_category,
        "limit": args.limit, "num_prompts": len(prompts),
        "repeats": args.repeats, "max_new_tokens": args.max_new_tokens, "num_draft_tokens": k,
        "temperature": args.temperature, "sampling": args.sampling, "top_k": args.top_k, "top_p": args.top_p,
        "model": args.model or "default",
        "draft_model": str(loaded.draft.source or loaded.draft.path) if loaded.draft_found else args.draft_model,
        "draft_found": loaded.draft_found, "drafter_paths": drafter_paths,
        "dtype": precision_of(backend),
        "device": str(backend.device), "backend": backend.name,
        "threads": _threads_of(target),
        "machine": platform.machine(),
    }
    report = build_report(runs, contenders, settings)
    report["roofline"] = roofline.to_dict()
    print(markdown(report))
    print(roofline_markdown(roofline, f"{settings['dtype']}, {settings['threads']} threads"))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    return 0
