"""``python -m exactspec.bench.grammars``: the grammar engines on PyPI side by side, on this CPU, for a model's
vocabulary: how long each takes to compile a JSON Schema and to compute one step's token mask, and which of a suite
of schemas (the features structured outputs use) each compiles and keeps to.

Engines: llguidance (exactspec's, ``exactspec/grammars.py``), xgrammar and outlines-core, whichever are installed.
Each is given the same tokenizer, as bytes per token (``vocabularies.TokenText``). The mask time is measured along
a valid answer: at every token, the mask for the next one, then the token consumed. Coverage: a schema counts as
kept where the engine compiles it and each of ``--walks`` random walks through its masks (a fixed seed; the end
taken whenever the grammar allows it after the first 48 tokens, and from there tokens that close a string, an object
or a list preferred) ends in text that validates against the schema (``jsonschema``); a walk that finds no end in
600 tokens counts as unfinished.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import numpy as np

from exactspec.bench.report import print_json
from exactspec.errors import run_script
from exactspec.grammars import Grammar, GrammarSpec, llg_tokenizer, unpacked
from exactspec.models import load_tokenizer
from exactspec.vocabularies import TokenText

EXTRACTION = {  # the workload's schema: named fields extracted from a passage
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "people": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "year": {"type": ["integer", "null"]},
        "topic": {"enum": ["science", "history", "technology", "arts", "other"]},
        "summary": {"type": "string"},
    },
    "required": ["title", "people", "year", "topic", "summary"],
    "additionalProperties": False,
}
EXTRACTION_ANSWER = {"title": "The Voyage of the Beagle", "people": ["Charles Darwin", "Robert FitzRoy"],
                     "year": 1839, "topic": "science",
                     "summary": "A naturalist's account of a five-year survey voyage around South America."}
SUITE: dict[str, dict] = {  # the JSON Schema features structured outputs use, one or two a schema
    "types": {"type": "object", "properties": {"s": {"type": "string"}, "i": {"type": "integer"},
              "n": {"type": "number"}, "b": {"type": "boolean"}, "z": {"type": "null"}},
              "required": ["s", "i", "n", "b", "z"]},
    "enum": {"enum": ["red", "green", 3, None]},
    "const": {"type": "object", "properties": {"v": {"const": "fixed"}}, "required": ["v"]},
    "nested": {"type": "object", "properties": {"a": {"type": "object", "properties": {
               "b": {"type": "object", "properties": {"c": {"type": "integer"}}, "required": ["c"]}},
               "required": ["b"]}}, "required": ["a"]},
    "array-bounds": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4},
    "optional": {"type": "object", "properties": {"need": {"type": "string"}, "maybe": {"type": "integer"}},
                 "required": ["need"]},
    "ref": {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                                "required": ["x", "y"]}},
            "type": "object", "properties": {"from": {"$ref": "#/$defs/point"}, "to": {"$ref": "#/$defs/point"}},
            "required": ["from", "to"]},
    "recursive-ref": {"$defs": {"node": {"type": "object", "properties": {
                      "name": {"type": "string", "maxLength": 8},
                      "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}},
                      "required": ["name"]}}, "$ref": "#/$defs/node"},
    "any-of": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 5}]},
    "one-of": {"oneOf": [{"type": "object", "properties": {"kind": {"const": "a"}}, "required": ["kind"]},
                         {"type": "object", "properties": {"kind": {"const": "b"}, "n": {"type": "integer"}},
                          "required": ["kind", "n"]}]},
    "all-of": {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                         {"type": "object", "properties": {"b": {"type": "string"}}, "required": ["b"]}]},
    "string-length": {"type": "string", "minLength": 3, "maxLength": 6},
    "pattern": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
    "format-date-time": {"type": "string", "format": "date-time"},
    "format-email": {"type": "string", "format": "email"},
    "format-uuid": {"type": "string", "format": "uuid"},
    "number-range": {"type": "integer", "minimum": 10, "maximum": 99},
    "exclusive-range": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
    "additional-false": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                         "additionalProperties": False},
    "additional-schema": {"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 3},
    "type-list": {"type": ["string", "null"]},
    "prefix-items": {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}], "items": False},
    "unique-items": {"type": "array", "items": {"enum": [1, 2, 3]}, "uniqueItems": True, "maxItems": 3},
    "multiple-of": {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 100},
    "pattern-properties": {"type": "object", "patternProperties": {"^x-": {"type": "integer"}},
                           "additionalProperties": False, "maxProperties": 2},
    "extraction": EXTRACTION,
}


class Engine:
    """One grammar engine over one vocabulary: compile a schema, then per step a mask and a token consumed."""

    name = ""

    def compile(self, schema: dict):
        raise NotImplementedError

    def mask(self, state) -> np.ndarray:  # [vocab] bool
        raise NotImplementedError

    def consume(self, state, token: int) -> bool:
        raise NotImplementedError


class LLGuidance(Engine):
    name = "llguidance"

    def __init__(self, text: TokenText, eos: int) -> None:
        self.tokenizer = llg_tokenizer(text, (eos,))
        self.eos = eos

    def compile(self, schema: dict) -> Grammar:
        return Grammar(GrammarSpec("json_schema", json.dumps(schema)), self.tokenizer)

    def mask(self, state: Grammar) -> np.ndarray:
        return state.allowed()

    def consume(self, state: Grammar, token: int) -> bool:
        return state.advance([token])


class XGrammar(Engine):
    name = "xgrammar"

    def __init__(self, text: TokenText, eos: int) -> None:
        import xgrammar

        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo(list(text.pieces), xgrammar.VocabType.RAW, vocab_size=text.vocab_size,
                                      stop_token_ids=[eos])
        self.compiler = xgrammar.GrammarCompiler(info)
        self.bitmask = xgrammar.allocate_token_bitmask(1, text.vocab_size)
        self.vocab_size = text.vocab_size

    def compile(self, schema: dict):
        return self.xgr.GrammarMatcher(self.compiler.compile_json_schema(json.dumps(schema)))

    def mask(self, state) -> np.ndarray:
        state.fill_next_token_bitmask(self.bitmask)
        return unpacked([self.bitmask[0].numpy()], self.vocab_size)[0]

    def consume(self, state, token: int) -> bool:
        return state.accept_token(token)


class OutlinesCore(Engine):
    name = "outlines-core"

    def __init__(self, text: TokenText, eos: int) -> None:
        import outlines_core

        self.oc = outlines_core
        by_piece: dict[bytes, list[int]] = {}
        for token, piece in enumerate(text.pieces):
            if piece and token != eos and token not in text.control:
                by_piece.setdefault(piece, []).append(token)
        self.vocabulary = outlines_core.Vocabulary(eos, by_piece)
        self.vocab_size = text.vocab_size

    def compile(self, schema: dict):
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema))
        return self.oc.Guide(self.oc.Index(regex, self.vocabulary))

    def mask(self, state) -> np.ndarray:
        allowed = np.zeros(self.vocab_size, dtype=bool)
        allowed[[t for t in state.get_tokens() if t < self.vocab_size]] = True
        return allowed

    def consume(self, state, token: int) -> bool:
        state.advance(token)
        return True


WALK_STEPS, WANDER = 600, 48  # a walk's most tokens; after WANDER of them it heads for an end
CLOSING = set(b'"}]')
ENGINES = {"llguidance": LLGuidance, "xgrammar": XGrammar, "outlines-core": OutlinesCore}


def mask_times(engine: Engine, schema: dict, tokens: list[int]) -> tuple[float, list[float]]:
    """Seconds to compile, and of each step's mask along ``tokens`` (each then consumed)."""
    started = time.perf_counter()
    state = engine.compile(schema)
    compiled = time.perf_counter() - started
    times = []
    for token in tokens:
        started = time.perf_counter()
        allowed = engine.mask(state)
        times.append(time.perf_counter() - started)
        if not allowed[token] or not engine.consume(state, token):
            raise RuntimeError(f"{engine.name} refused a valid answer's token {token}")
    return compiled, times


def keeps(engine: Engine, schema: dict, text: TokenText, eos: int, walks: int, rng: random.Random) -> str:
    """The word "kept", or why not: the engine does not compile the schema, or a walk ended in text that does not
    validate."""
    import jsonschema

    for _ in range(walks):
        try:
            state = engine.compile(schema)
        except Exception as error:
            return f"not compiled: {str(error).splitlines()[0][:80]}"
        out: list[int] = []
        for step in range(WALK_STEPS):
            allowed = np.flatnonzero(engine.mask(state))
            if len(allowed) == 0 or eos in allowed and (step >= WANDER or len(allowed) == 1):
                break
            choices = [t for t in allowed if t != eos]
            if step >= WANDER:  # then towards an end: tokens that close a string, an object or a list
                choices = [t for t in choices if CLOSING.intersection(text.pieces[t])] or choices
            token = int(rng.choice(choices or [eos]))
            engine.consume(state, token)
            out.append(token)
        else:
            return "unfinished"  # no end within WALK_STEPS: not the engine's fault
        try:
            jsonschema.validate(json.loads(text.text_of(out)), schema)
        except Exception as error:
            return f"invalid output: {str(error).splitlines()[0][:80]}"
    return "kept"


def run(args: argparse.Namespace) -> dict:
    report: dict = {"models": {}}
    for model in args.models:
        tokenizer, vocab_size = load_tokenizer(model)
        text = TokenText(tokenizer, vocab_size)
        eos = int(tokenizer.eos_token_id)
        answer = text.encode(json.dumps(EXTRACTION_ANSWER).encode())[0]
        rows = {}
        for name in args.engines:
            try:
                engine = ENGINES[name](text, eos)
            except ImportError:
                rows[name] = {"error": "not installed"}
                continue
            compiled, times = mask_times(engine, EXTRACTION, answer)
            rng = random.Random(0)
            coverage = {schema: keeps(engine, SUITE[schema], text, eos, args.walks, rng) for schema in SUITE}
            rows[name] = {"compile_ms": 1000 * compiled, "mask_ms_mean": 1000 * statistics.mean(times),
                          "mask_ms_median": 1000 * statistics.median(times), "mask_ms_max": 1000 * max(times),
                          "kept": sum(v == "kept" for v in coverage.values()), "suite": len(SUITE),
                          "unfinished": sum(v == "unfinished" for v in coverage.values()),
                          "coverage": coverage}
        report["models"][f"{model or 'default'} (vocabulary {vocab_size})"] = rows
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m exactspec.bench.grammars", description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=[None, "qwen2.5-coder-1.5b"])
    parser.add_argument("--engines", nargs="+", choices=list(ENGINES), default=list(ENGINES))
    parser.add_argument("--walks", type=int, default=3, help="random walks per schema")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    return print_json(run(args), args.out)


if __name__ == "__main__":
    raise SystemExit(run_script(main))
