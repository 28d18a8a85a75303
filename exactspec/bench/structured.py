"""``python -m exactspec.bench.structured``: constrained decoding with speculation and without, and llama.cpp's
grammar-constrained generation, side by side in one run, on a JSON extraction workload.

The workload: Spec-Bench's summarisation articles (or any prompt file's), each asked to be extracted into one fixed
JSON Schema (headline, people, places, date, topic, summary), greedy, on one target. The arms take turns prompt by
prompt, each from a cold cache:
- ``plain``: decoding under the grammar, nothing drafted;
- ``forced``: the grammar's forced tokens drafted, no drafter;
- ``prompt-lookup`` and ``retrieval`` (k auto), the forced tokens drafted too;
- ``llama.cpp``: llama-cpp-python's completion with the schema's GBNF grammar (``LlamaGrammar.from_json_schema``),
  over the same file and prompt tokens.
Per arm: output tokens per second, end to end and decoding alone (each prompt's prefill timed apart: no drafter
shortens it), mean accepted length, the share of output tokens
the grammar drafted as forced, and the share of the time spent in the grammar (masks, forced tokens, checks).
exactspec's arms emit the same tokens (checked); llama.cpp's grammar and arithmetic are its own.
"""

from __future__ import annotations

import argparse
import json
import time

from exactspec.backends.base import prefill
from exactspec.bench.prompts import read_prompts
from exactspec.bench.report import print_json
from exactspec.engine import Engine, GenerationConfig
from exactspec.grammars import GrammarSpec, grammar_for
from exactspec.loading import encode_prompt, load_target
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
ARMS = {"plain": ("none", 1), "forced": ("none", 8), "prompt-lookup": ("prompt-lookup", "auto"),
        "retrieval": ("retrieval", "auto")}


def run(args: argparse.Namespace) -> dict:
    loaded = load_target(args.model, threads=args.threads, drafters=("prompt-lookup", "retrieval"))
    tokenizer, runtime = loaded.target.tokenizer, loaded.runtime
    text = TokenText(tokenizer, runtime.vocab_size)
    spec = GrammarSpec.json_schema(SCHEMA)
    engines = {arm: Engine(runtime, make_proposer(drafter, runtime, None, None), loaded.stop_ids)
               for arm, (drafter, _) in ARMS.items()}
    prompts = [encode_prompt(tokenizer, INSTRUCTION.format(p.text.removeprefix("Summarize: ")[:args.max_chars]))
               for p in read_prompts(args.prompts, category=args.category, limit=args.limit)]
    llama = _llama(loaded.target.gguf or loaded.target.path, args) if args.llamacpp else None
    totals = {arm: {"tokens": 0, "seconds": 0.0, "prefill_seconds": 0.0, "rounds": 0, "forced": 0,
                    "grammar_seconds": 0.0, "valid": 0} for arm in [*ARMS, *(["llama.cpp"] if llama else [])]}
    outputs: dict[str, list] = {arm: [] for arm in ARMS}
    for prompt in prompts:
        for arm, (_, k) in ARMS.items():
            engine = engines[arm]
            engine.clear_cache()
            started = time.perf_counter()  # the prompt's prefill, timed apart: generate finds it cached
            prefill(runtime, prompt[:-1])
            prefilled = time.perf_counter() - started
            grammar = grammar_for(spec, text, loaded.stop_ids)
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
            row["valid"] += _valid(tokenizer.decode(result.token_ids, skip_special_tokens=True))
            outputs[arm].append(result.token_ids)
        if llama is not None:
            row = totals["llama.cpp"]
            tokens, prefilled, seconds, answer = _llama_run(llama, prompt, args.max_new_tokens)
            row["tokens"] += tokens
            row["seconds"] += seconds
            row["prefill_seconds"] += prefilled
            row["valid"] += _valid(answer)
    report = {"prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "arms": {},
              "same_tokens": all(outputs[arm] == outputs["plain"] for arm in ARMS)}
    for arm, row in totals.items():
        report["arms"][arm] = {
            "tokens_per_second": row["tokens"] / (row["seconds"] + row["prefill_seconds"]),
            "decode_tokens_per_second": row["tokens"] / row["seconds"], "tokens": row["tokens"],
            "mean_accepted_length": row["tokens"] / row["rounds"] if row["rounds"] else None,
            "forced_share": row["forced"] / row["tokens"] if row["rounds"] else None,
            "grammar_time_share": row["grammar_seconds"] / row["seconds"] if row["rounds"] else None,
            "valid_json": f"{row['valid']}/{len(prompts)}"}
    plain = report["arms"]["plain"]
    for arm in report["arms"].values():
        arm["over_plain"] = arm["tokens_per_second"] / plain["tokens_per_second"]
        arm["decode_over_plain"] = arm["decode_tokens_per_second"] / plain["decode_tokens_per_second"]
    return report


def _valid(answer: str) -> int:
    import jsonschema

    try:
        jsonschema.validate(json.loads(answer), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return 0
    return 1


def _llama(path, args: argparse.Namespace):
    from llama_cpp import Llama, LlamaGrammar

    model = Llama(model_path=str(path), n_ctx=args.max_model_len, n_threads=args.threads or 2, verbose=False)
    return model, LlamaGrammar.from_json_schema(json.dumps(SCHEMA), verbose=False)


def _llama_run(llama, prompt: list[int], max_new_tokens: int) -> tuple[int, float, float, str]:
    """Output tokens, prefill and decode seconds (the prompt evaluated first: the completion finds it cached)."""
    model, grammar = llama
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
    parser.add_argument("--prompts", required=True, help="a JSONL prompt file (Spec-Bench's)")
    parser.add_argument("--category", default="summarization")
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--max-chars", type=int, default=1500, help="each article is cut to this many characters")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--no-llamacpp", dest="llamacpp", action="store_false")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    return print_json(run(args), args.out)


if __name__ == "__main__":
    raise SystemExit(main())
