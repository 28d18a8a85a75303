"""``python -m exactspec.bench.structured``: constrained decoding with speculation and without, and llama.cpp's
grammar-constrained generation, side by side in one run, on a JSON extraction workload or a generative one.

The workloads (``--workload``):
- ``extraction``: Spec-Bench's summarisation articles (or any prompt file's), each asked to be extracted into one
  fixed JSON Schema (headline, people, places, date, topic, summary): the answer copies its input.
- ``generative``: records written from what the model knows, not copied: the catalogue record of a novel, a film's
  and a city's (8 string fields each), for held-out subjects (``GENERATIVE``; nothing was tuned on them).
Greedy, on one target. The arms (``--arms``) take turns prompt by prompt, each from a cold cache:
- ``plain``: decoding under the grammar, nothing drafted;
- ``forced``: the grammar's forced tokens drafted, no drafter;
- ``prompt-lookup``, ``retrieval``, ``draft-model`` and ``hybrid`` (k auto), the forced tokens drafted too; a draft
  model drafts under the grammar's mask, the tokens it forces after each of its own taken in;
- ``llama.cpp``: llama-cpp-python's completion with the schema's GBNF grammar (``LlamaGrammar.from_json_schema``),
  over the same file and prompt tokens.
Per arm: output tokens per second, end to end and decoding alone (each prompt's prefill timed apart: no drafter
shortens it), mean accepted length, the share of output tokens
the grammar drafted as forced, and the share of the time spent in the grammar (masks, forced tokens, checks).
exactspec's arms emit the same tokens (checked); llama.cpp's grammar and arithmetic are its own.
"""

from __future__ import annotations

import argparse
import functools
import json
import time

from exactspec.backends.base import prefill
from exactspec.bench.prompts import read_prompts
from exactspec.bench.report import print_json
from exactspec.engine import Engine, GenerationConfig
from exactspec.errors import run_script
from exactspec.grammars import GrammarSpec, grammar_for
from exactspec.loading import draft_source, encode_prompt, load_target
from exactspec.proposers import make_proposer
from exactspec.vocabularies import TokenText

SCHEMA = {
    "type": "object",
    "properties": {
        "headline": {"type": "string", "maxLength": 120},
        "people": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 5},
        "places": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 5},
        "date": {"type": ["string", "null"], "maxLength": 30},
        "topic": {"enum": ["politics", "business", "science", "sport", "crime", "health", "entertainment",
                           "other"]},
        "summary": {"type": "string", "maxLength": 400},
    },
    "required": ["headline", "people", "places", "date", "topic", "summary"],
    "additionalProperties": False,
}
INSTRUCTION = ("Extract from the article below, as JSON: its headline, the people and places it names, the date "
               "it gives (or null), its topic (politics, business, science, sport, crime, health, entertainment or "
               "other) and a one-sentence summary.\n\nArticle: {}")
def _record(fields: dict[str, int]) -> dict:
    """A JSON Schema of required string fields, each at most its length."""
    return {"type": "object", "properties": {name: {"type": "string", "maxLength": most}
                                             for name, most in fields.items()},
            "required": list(fields), "additionalProperties": False}


# the generative workload: (the instruction, its schema, the subjects); held out: nothing was tuned on them
GENERATIVE = {
    "novel": ("Write the library catalogue record of the novel {} as JSON: its title, author, year of first "
              "publication, genre, setting, protagonist, a two-sentence summary and its main themes.",
              _record({"title": 80, "author": 60, "year": 10, "genre": 40, "setting": 80, "protagonist": 60,
                       "summary": 400, "themes": 120}),
              ["Pride and Prejudice", "Moby-Dick", "Jane Eyre", "The Great Gatsby", "Frankenstein",
               "Great Expectations", "Little Women", "Treasure Island"]),
    "film": ("Write the catalogue record of the film {} as JSON: its title, director, year, genre, setting, lead "
             "actor, a two-sentence plot and its tagline.",
             _record({"title": 80, "director": 60, "year": 10, "genre": 40, "setting": 80, "lead_actor": 60,
                      "plot": 400, "tagline": 120}),
             ["Casablanca", "Jaws", "Star Wars", "Titanic", "The Godfather", "Jurassic Park", "Toy Story",
              "The Wizard of Oz"]),
    "city": ("Write the gazetteer record of the city of {} as JSON: its name, country, region, population, the "
             "century it was founded, its best-known landmark, its economy and a two-sentence description.",
             _record({"name": 60, "country": 60, "region": 60, "population": 30, "founded": 40, "landmark": 80,
                      "economy": 160, "description": 400}),
             ["Paris", "Tokyo", "Cairo", "Sydney", "Toronto", "Rome", "Mumbai", "Buenos Aires"]),
}
ARMS = {"plain": ("none", 1), "forced": ("none", 8), "prompt-lookup": ("prompt-lookup", "auto"),
        "retrieval": ("retrieval", "auto"), "draft-model": ("draft-model", "auto"), "hybrid": ("hybrid", "auto")}
DEFAULT_ARMS = "plain,forced,prompt-lookup,retrieval"


def workload(args: argparse.Namespace) -> list[tuple[str, dict]]:
    """The prompts' texts, each with its schema."""
    if args.workload == "generative":
        interleaved = [(instruction.format(subject), schema) for i in range(8)
                       for instruction, schema, subjects in GENERATIVE.values() for subject in subjects[i:i + 1]]
        return interleaved[: args.limit]
    return [(INSTRUCTION.format(p.text.removeprefix("Summarize: ")[: args.max_chars]), SCHEMA)
            for p in read_prompts(args.prompts, category=args.category, limit=args.limit)]


def _arms(text: str) -> dict[str, tuple[str, object]]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in ARMS]
    if unknown or "plain" not in names:
        raise SystemExit(f"--arms: plain and any of {', '.join(ARMS)} (got {text!r})")
    return {name: ARMS[name] for name in names}


def run(args: argparse.Namespace) -> dict:
    arms = _arms(args.arms)
    drafters = tuple(drafter for drafter, _ in arms.values() if drafter != "none")
    loaded = load_target(args.model, threads=args.threads, draft_model=args.draft_model, drafters=drafters)
    tokenizer, runtime = loaded.target.tokenizer, loaded.runtime
    text = TokenText(tokenizer, runtime.vocab_size)
    engines = {arm: Engine(runtime, make_proposer(drafter, runtime, _source(drafter, loaded), loaded.datastore),
                           loaded.stop_ids) for arm, (drafter, _) in arms.items()}
    cases = [(encode_prompt(tokenizer, prompt), schema) for prompt, schema in workload(args)]
    specs = {id(schema): GrammarSpec.json_schema(schema) for _, schema in cases}
    llama = _llama(loaded.target.gguf or loaded.target.path, args) if args.llamacpp else None
    totals = {arm: {"tokens": 0, "seconds": 0.0, "prefill_seconds": 0.0, "rounds": 0, "forced": 0,
                    "grammar_seconds": 0.0, "valid": 0} for arm in [*arms, *(["llama.cpp"] if llama else [])]}
    outputs: dict[str, list] = {arm: [] for arm in arms}
    for prompt, schema in cases:
        for arm, (_, k) in arms.items():
            engine = engines[arm]
            engine.clear_cache()
            started = time.perf_counter()  # the prompt's prefill, timed apart: generate finds it cached
            prefill(runtime, prompt[:-1])
            prefilled = time.perf_counter() - started
            grammar = grammar_for(specs[id(schema)], text, loaded.stop_ids)
            grammar.forcing = arm != "plain"
            result = engine.generate(prompt, GenerationConfig(max_new_tokens=args.max_new_tokens,
                                                              num_draft_tokens=k), grammar=grammar)
            row = totals[arm]
            row["tokens"] += len(result.token_ids)
            row["seconds"] += result.stats.seconds
            row["prefill_seconds"] += prefilled
            row["rounds"] += result.stats.rounds
            row["forced"] += grammar.forced_tokens
            row["grammar_seconds"] += grammar.seconds
            row["valid"] += _valid(tokenizer.decode(result.token_ids, skip_special_tokens=True), schema)
            outputs[arm].append(result.token_ids)
        if llama is not None:
            row = totals["llama.cpp"]
            tokens, prefilled, seconds, answer = _llama_run(llama, prompt, schema, args.max_new_tokens)
            row["tokens"] += tokens
            row["seconds"] += seconds
            row["prefill_seconds"] += prefilled
            row["valid"] += _valid(answer, schema)
    report = {"workload": args.workload, "prompts": len(cases), "max_new_tokens": args.max_new_tokens, "arms": {},
              "same_tokens": all(outputs[arm] == outputs["plain"] for arm in arms)}
    for arm, row in totals.items():
        report["arms"][arm] = {
            "tokens_per_second": row["tokens"] / (row["seconds"] + row["prefill_seconds"]),
            "decode_tokens_per_second": row["tokens"] / row["seconds"], "tokens": row["tokens"],
            "mean_accepted_length": row["tokens"] / row["rounds"] if row["rounds"] else None,
            "forced_share": row["forced"] / row["tokens"] if row["rounds"] else None,
            "grammar_time_share": row["grammar_seconds"] / row["seconds"] if row["rounds"] else None,
            "valid_json": f"{row['valid']}/{len(cases)}"}
    plain = report["arms"]["plain"]
    for arm in report["arms"].values():
        arm["over_plain"] = arm["tokens_per_second"] / plain["tokens_per_second"]
        arm["decode_over_plain"] = arm["decode_tokens_per_second"] / plain["decode_tokens_per_second"]
    return report


def _source(drafter: str, loaded):
    """What ``drafter`` drafts with on the loaded target (a draft model given, found or shipped; none for a copy)."""
    if drafter == "none":
        return None
    return draft_source(drafter, loaded.target, loaded.runtime, loaded.draft, loaded.precision,
                        found=loaded.draft_found)


def _valid(answer: str, schema: dict) -> int:
    import jsonschema

    try:
        jsonschema.validate(json.loads(answer), schema)
    except (ValueError, jsonschema.ValidationError):
        return 0
    return 1


def _llama(path, args: argparse.Namespace):
    from llama_cpp import Llama, LlamaGrammar

    model = Llama(model_path=str(path), n_ctx=args.max_model_len, n_threads=args.threads or 2, verbose=False)
    return model, functools.cache(lambda text: LlamaGrammar.from_json_schema(text, verbose=False))


def _llama_run(llama, prompt: list[int], schema: dict, max_new_tokens: int) -> tuple[int, float, float, str]:
    """Output tokens, prefill and decode seconds (the prompt evaluated first: the completion finds it cached)."""
    model, grammars = llama
    grammar = grammars(json.dumps(schema))
    model.reset()
    started = time.perf_counter()
    model.eval(prompt[:-1])
    prefilled = time.perf_counter()
    out = model.create_completion(prompt, max_tokens=max_new_tokens, temperature=0.0, grammar=grammar)
    done = time.perf_counter()
    return out["usage"]["completion_tokens"], prefilled - started, done - prefilled, out["choices"][0]["text"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m exactspec.bench.structured", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--workload", choices=["extraction", "generative"], default="extraction")
    parser.add_argument("--prompts", default=None, help="extraction's JSONL prompt file (Spec-Bench's)")
    parser.add_argument("--arms", default=DEFAULT_ARMS, help=f"comma-separated: plain and any of {', '.join(ARMS)}")
    parser.add_argument("--draft-model", default=None, help="the draft model's path (default: found or shipped)")
    parser.add_argument("--category", default="summarization")
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--max-chars", type=int, default=1500, help="each article is cut to this many characters")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--no-llamacpp", dest="llamacpp", action="store_false")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.workload == "extraction" and args.prompts is None:
        parser.error("the extraction workload needs --prompts FILE")
    return print_json(run(args), args.out)


if __name__ == "__main__":
    raise SystemExit(run_script(main))
