"""Structured output (issue 37): a grammar masks the target's logits at every verified position, puts its forced
tokens in the draft and cuts a draft at a forbidden token, so constrained output is the same with speculation and
without, greedy and seeded, and every token is a draw from the masked, renormalised distribution."""

from __future__ import annotations

import json
from collections import Counter

import jsonschema
import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from tiny_gguf import write_tiny_gguf
from two_processes import in_two_processes

from exactspec.api import SpecDecoder
from exactspec.engine import GenerationConfig
from exactspec.errors import UsageError
from exactspec.grammars import GrammarError, GrammarSpec
from exactspec.sampling import SamplingParams, logits_to_probs

SCHEMA = {  # enums, a nested object, an array with bounds, an optional field and a $ref
    "$defs": {"tag": {"type": "string", "enum": ["red", "green", "blue"]}},
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "size": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}, "minItems": 1, "maxItems": 3},
        "owner": {"type": "object", "properties": {"id": {"type": "integer"}, "active": {"type": "boolean"}},
                  "required": ["id", "active"], "additionalProperties": False},
        "note": {"type": "string", "maxLength": 8},
    },
    "required": ["name", "size", "tags", "owner"],
    "additionalProperties": False,
}
PROMPTS = ["Describe the item as JSON.", "{\"name\": \"lamp\", \"size\": 3, \"tags\": [\"red\"]}"]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    """A random model over the default model's vocabulary (49152 byte-level BPE tokens)."""
    return str(write_tiny_gguf(tmp_path_factory.mktemp("grammar") / "tiny.gguf"))


@pytest.fixture(scope="module")
def draft(tmp_path_factory) -> str:
    """``model`` rounded to 4 bits, to draft for it: its choices are mostly the target's, and not always."""
    return str(write_tiny_gguf(tmp_path_factory.mktemp("grammar_draft") / "draft.gguf", tensor_type="Q4_0"))


def outputs(decoder: SpecDecoder, spec: GrammarSpec, k: int | str, sampling: SamplingParams, seed: int | None
            ) -> tuple[list[list[int]], int]:
    config = GenerationConfig(max_new_tokens=160, num_draft_tokens=k, sampling=sampling, seed=seed)
    results = [decoder.generate_ids(decoder.encode(p, chat=False), config, grammar=spec) for p in PROMPTS]
    return [r.token_ids for r in results], sum(r.stats.accepted_tokens for r in results)


@pytest.mark.parametrize("backend", ["fused", "lean"])
def test_constrained_output_is_the_same_with_speculation_and_without(model, backend):
    """A JSON Schema with enums, nesting, bounded arrays, an optional field and a $ref: greedy and seeded (the
    invariant sampler), with prompt lookup at k = 3 and k auto, the tokens of decoding without a drafter, bit for
    bit; each answer validates, and draft tokens (the grammar's forced ones among them) were accepted."""
    spec = GrammarSpec.json_schema(SCHEMA)
    plain = SpecDecoder.load(model, drafter="none", backend=backend)
    speculating = SpecDecoder.load(model, drafter="prompt-lookup", backend=backend)
    accepted = 0
    for sampling, seed in ((SamplingParams(), None), (SamplingParams(temperature=0.8), 7)):
        expected, _ = outputs(plain, spec, 1, sampling, seed)
        for ids in expected:
            jsonschema.validate(json.loads(plain.tokenizer.decode(ids, skip_special_tokens=True)), SCHEMA)
        for k in (3, "auto"):
            got, count = outputs(speculating, spec, k, sampling, seed)
            assert got == expected, (sampling, k)
            accepted += count
    assert accepted > 0


@pytest.mark.parametrize("drafter", ["draft-model", "hybrid"])
def test_a_draft_model_under_the_grammars_mask_keeps_the_output(model, draft, drafter):
    """A draft model (the target rounded to 4 bits) drafting under the grammar's mask, alone and as the hybrid's model
    source, greedy and seeded (the invariant sampler and the standard rule): the tokens of decoding without a
    drafter, bit for bit, and its masked drafts accepted where the standard rule's q is a proper distribution."""
    spec = GrammarSpec.json_schema(SCHEMA)
    plain = SpecDecoder.load(model, drafter="none", backend="fused")
    speculating = SpecDecoder.load(model, drafter=drafter, draft_model=draft, backend="fused")
    standard = SamplingParams(temperature=0.8, method="standard")
    for sampling, seed in ((SamplingParams(), None), (SamplingParams(temperature=0.8), 7), (standard, 11)):
        expected, _ = outputs(plain, spec, 1, sampling, seed)
        got, _ = outputs(speculating, spec, 4, sampling, seed)
        if sampling.method != "standard":  # the standard rule's tokens are its own draws (checked in law below)
            assert got == expected, sampling
        for ids in got:
            jsonschema.validate(json.loads(plain.tokenizer.decode(ids, skip_special_tokens=True)), SCHEMA)


def test_a_draft_model_drafts_among_the_tokens_the_grammar_allows(model, draft):
    """Under a grammar a draft model drafts only tokens it admits: the whole draft is admitted, the tokens forced
    after a drafted one join the draft with no step of the draft model, and the grammar is left where it was.
    Without the guide the same model's first token is one the grammar forbids, and the draft is cut to nothing."""
    from exactspec.step import constrained_draft

    decoder = SpecDecoder.load(model, drafter="draft-model", draft_model=draft, backend="fused")
    sentences = [f"{a} {b} on the {c}" for a in ("cat", "dog") for b in ("sat", "ran") for c in ("mat", "rug")]
    grammar = decoder.grammar(GrammarSpec("regex", "(cat|dog) (sat|ran) on the (mat|rug)"))
    prompt = decoder.encode("Once upon a time", chat=False)
    proposer = decoder.engine.proposer
    steps = []
    step = proposer._step
    proposer._step = lambda tokens: steps.append(tokens) or step(tokens)

    def propose(forced, n, guide):
        guided = {} if guide is None else {"guide": guide}
        return proposer.propose(prompt + forced, n, SamplingParams(), None, **guided)

    guided = constrained_draft(grammar, 12, 16, propose, guided=True)
    text = decoder.token_text.text_of(guided.tokens).decode()
    assert grammar.admitted(guided.tokens) == len(guided.tokens)
    assert any(sentence.startswith(text) for sentence in sentences) and len(text) >= len("cat sat on the")
    assert len(steps) + 1 < len(guided.tokens)  # a step a drafted token (the first after the context): some forced
    assert grammar.forced(4) == [] and not grammar.accepting  # the grammar is where it was: at its start
    assert constrained_draft(grammar, 12, 16, propose, guided=False).tokens == []


def test_a_regex_and_a_lark_grammar_constrain_the_text(model):
    decoder = SpecDecoder.load(model, drafter="prompt-lookup", backend="fused")
    dated = decoder.generate("Today is", max_new_tokens=32, chat=False, regex=r"[0-9]{4}-[0-9]{2}-[0-9]{2}")
    assert len(dated.text) == 10 and dated.text[4] == dated.text[7] == "-" and dated.text.replace("-", "").isdigit()
    lark = 'start: "yes" | "no" | "maybe " NUMBER\nNUMBER: /[0-9]{1,3}/'
    answer = decoder.generate("Well?", max_new_tokens=16, chat=False, grammar=GrammarSpec("grammar", lark)).text
    assert answer in ("yes", "no") or answer.startswith("maybe ") and answer[6:].isdigit()
    gbnf = 'root ::= "[" [a-c]+ "]"'
    bracketed = decoder.generate("List:", max_new_tokens=16, chat=False, grammar=GrammarSpec("grammar", gbnf)).text
    assert bracketed[0] == "[" and (bracketed[-1] == "]" or len(decoder.tokenizer.encode(bracketed)) >= 15)


def test_a_pydantic_model_stands_for_its_schema(model):
    from pydantic import BaseModel, Field

    class Point(BaseModel):
        x: int = Field(ge=0, le=9)
        y: int = Field(ge=0, le=9)

    decoder = SpecDecoder.load(model, backend="fused")
    point = Point.model_validate_json(decoder.generate("A point:", max_new_tokens=40, chat=False,
                                                       json_schema=Point).text)
    assert 0 <= point.x <= 9 and 0 <= point.y <= 9


GBNF_LANGUAGES = [  # GBNF grammars, and each one's language as a Python regex
    ('root ::= ("a"+)+ "b"', r"a+b"),  # issue 60: refused as "a"++
    ('root ::= ("a"*)* "b"', r"a*b"),
    ('root ::= ("a"?)+ "b"', r"a*b"),
    ('root ::= ("ab"+)? "c"', r"(ab)*c"),
    ('root ::= ("a"{2})+ "b"', r"(aa)+b"),
    ('root ::= ("x"{1,2}){2,3} "y"', r"x{2,6}y"),
    ('root ::= (("a" | "c")+)+ "b"', r"[ac]+b"),
    ('root ::= ((("a" "c")+)?)* "b"', r"(ac)*b"),
    ('root ::= ([0-9]+ ",")+ "."', r"([0-9]+,)+\."),
    ('root ::= item (", " item)* "."\nitem ::= ("ab"+)+', r"(ab)+(, (ab)+)*\."),
    ('root ::= (\n  "a"+\n)+ "b"', r"a+b"),
    ('root ::= "a"++ "b"', r"a+b"),  # operators stacked: ("a"+)+
    ('root ::= "x"+? "y"', r"x*y"),
]
# llama.cpp's own sampler recurses without end on a repeated group that can match nothing (it crashes), so it is
# asked whether it reads the others only
NULLABLE_REPEATED = {'root ::= ("a"*)* "b"', 'root ::= ("a"?)+ "b"', 'root ::= ((("a" "c")+)?)* "b"'}


@pytest.fixture(scope="module")
def fused(model) -> SpecDecoder:
    return SpecDecoder.load(model, drafter="prompt-lookup", backend="fused")


@pytest.mark.parametrize("gbnf, language", GBNF_LANGUAGES)
def test_a_gbnf_grammars_groups_keep_their_parentheses_and_its_output_is_in_its_language(model, fused, gbnf,
                                                                                         language):
    """Each grammar is GBNF that llama.cpp's parser reads; converted to Lark, every repetition of a group keeps
    the group (``("a"+)+`` was printed ``"a"++``, which Lark refuses: 400 invalid_grammar), and the text generated
    under it, greedy and seeded, is in its language (a prefix of it, where max_new_tokens cut it)."""
    import llama_cpp
    import regex

    from exactspec.backends.llamacpp import GGUFModel

    if gbnf not in NULLABLE_REPEATED:
        vocabulary = GGUFModel(model, vocab_only=True)  # (kept while llama.cpp reads its vocabulary)
        sampler = llama_cpp.llama_sampler_init_grammar(vocabulary.vocab, gbnf.encode(), b"root")
        assert sampler, "llama.cpp's GBNF parser refuses it"
        llama_cpp.llama_sampler_free(sampler)
    for seed in (None, 1, 2):
        sampled = {} if seed is None else {"temperature": 1.0, "seed": seed}
        answer = fused.generate("Say:", max_new_tokens=24, chat=False, grammar=GrammarSpec("grammar", gbnf), **sampled)
        if answer.finish_reason == "stop":
            assert regex.fullmatch(language, answer.text), (seed, answer.text)
        else:
            assert regex.fullmatch(language, answer.text, partial=True), (seed, answer.text)


@pytest.mark.parametrize("spec, field", [
    (GrammarSpec("json_schema", '{"type": "strin"}'), "json schema"),
    (GrammarSpec("json_schema", "[1, 2]"), "JSON Schema is a JSON object"),
    (GrammarSpec("json_schema", "{not json"), "json schema"),
    (GrammarSpec("regex", "a(b"), "regex"),
    (GrammarSpec("grammar", "start: undefined_rule"), "grammar"),
])
def test_what_does_not_compile_is_refused_with_the_compilers_message(model, spec, field):
    decoder = SpecDecoder.load(model, backend="fused")
    with pytest.raises(GrammarError, match=field):
        decoder.grammar(spec)
    with pytest.raises(UsageError, match="a grammar is one of"):
        GrammarSpec("yaml", "x")


def test_a_tree_under_a_grammar_is_refused(model):
    decoder = SpecDecoder.load(model, backend="fused")
    with pytest.raises(UsageError, match="not a tree"):
        decoder.generate("x", max_new_tokens=4, chat=False, tree=(2, 1), regex="[a-z]+")


def test_a_draft_is_cut_at_its_first_forbidden_token_and_forced_tokens_need_no_drafter(model):
    """The grammar's forced text opens the draft without asking the drafter, which continues after it; the draft
    is kept up to the first token the grammar forbids (a point mass), or through it (a drawn draft: it is then
    rejected for sure, and the residual keeps the draft's mass on forbidden tokens where it belongs)."""
    from exactspec.choices import MAX_DRAFT_TOKENS
    from exactspec.proposers.base import Draft
    from exactspec.step import constrained_draft

    decoder = SpecDecoder.load(model, backend="fused")
    encode = decoder.token_text.encode
    grammar = decoder.grammar(GrammarSpec("regex", 'The answer is: (d|e)+'))
    d, x = encode(b"d")[0][0], encode(b"x")[0][0]
    asked = []
    draft = constrained_draft(grammar, 4, 12, lambda forced, n, _: asked.append((forced, n)) or Draft([d, x][:n]))
    forced, rest = asked[0]
    assert forced and b"The answer is: ".startswith(decoder.token_text.text_of(forced))
    assert rest == min(4, 12 - len(forced))  # forced tokens ride outside the drafter's k, within the room
    assert grammar.forced_tokens == len(forced) and draft.forced == len(forced)
    # the drafter's d follows the whole forced text, its x never: d is kept where the forced text was all of it
    assert draft.tokens == forced + ([d] if decoder.token_text.text_of(forced) == b"The answer is: " else [])
    # a room of 2 holds forced tokens only: the drafter is not asked; none at all with no room
    assert constrained_draft(grammar, 4, 2, lambda forced, n, _: asked.append(n) or Draft([d] * n)).tokens == forced[:2]
    assert constrained_draft(grammar, 4, 0, lambda forced, n, _: asked.append(n) or Draft([d] * n)).tokens == []
    assert len(asked) == 1
    grammar.advance(encode(b"The answer is: ")[0])
    assert constrained_draft(grammar, 4, 4, lambda forced, n, _: Draft([d, d, x, d])).tokens == [d, d]
    # a round scores at most MAX_DRAFT_TOKENS draft tokens, forced ones too (a longer pass runs as a prompt's)
    long = decoder.grammar(GrammarSpec("regex", " ".join(["cat dog"] * 60)))
    assert len(constrained_draft(long, 4, 1000, lambda forced, n, _: Draft([])).tokens) == MAX_DRAFT_TOKENS
    probs = torch.zeros(4, decoder.token_text.vocab_size)
    assert constrained_draft(grammar, 4, 4, lambda forced, n, _: Draft([d, d, x, d], probs)).tokens == [d, d, x]


CHI_SAMPLING = SamplingParams(temperature=1.0, top_k=8, method="standard")
SAMPLES = 3000


def constrained_samples(model: str, draft: str, seeds: range) -> tuple[list[tuple[int, ...]], int, int]:
    """The first two tokens of a seeded run under the regex for each seed, and the draft tokens accepted and
    rejected in all (a spawned worker loads its own decoder, on one thread)."""
    decoder = SpecDecoder.load(model, draft_model=draft, drafter="draft-model", backend="fused", threads=1)
    grammar = decoder.grammar(GrammarSpec("regex", "[a-z ]{2,6}"))
    prompt = decoder.encode("the cat sat on the", chat=False)
    samples, accepted, rejected = [], 0, 0
    for seed in seeds:
        grammar.reset()
        result = decoder.engine.generate(prompt, GenerationConfig(max_new_tokens=2, num_draft_tokens=3,
                                                                  sampling=CHI_SAMPLING, seed=seed), grammar=grammar)
        samples.append(tuple(result.token_ids))
        accepted += result.stats.accepted_tokens
        rejected += result.stats.draft_tokens - result.stats.accepted_tokens
    return samples, accepted, rejected


@pytest.mark.slow  # about 40 s on 2 cores in one process; the samples are drawn in two
def test_constrained_standard_sampling_draws_the_masked_renormalised_distribution(model, draft):
    """--sampling standard under a regex, with a draft model (the target in 4 bits) drafting under the regex's mask
    (its q a proper distribution over the tokens the regex allows, not the target's: drafts are accepted and
    rejected) at k = 3, top-k 8 after the mask: the first two tokens of 3,000 seeded runs against their exact
    joint under the masked, renormalised distributions (one token where it completes the text; two processes
    draw half the seeds each). Bins: every outcome expected at least 5 times, and one for the rest (joined to the
    last where expected under 5 times); one chi-square test at alpha = 0.001, so a correct engine fails it with
    probability 0.1% (the seeds are fixed: the outcome repeats)."""
    decoder = SpecDecoder.load(model, draft_model=draft, drafter="draft-model", backend="fused")
    grammar = decoder.grammar(GrammarSpec("regex", "[a-z ]{2,6}"))
    prompt = decoder.encode("the cat sat on the", chat=False)
    runtime = decoder.engine.target
    runtime.rollback(0)
    p1 = logits_to_probs(grammar.masked(runtime.extend(prompt, 1), [])[0].double(), CHI_SAMPLING)
    exact = {}
    for y1 in torch.nonzero(p1 > 0).flatten().tolist():
        grammar.advance([y1])
        p2 = logits_to_probs(grammar.masked(runtime.extend([y1], 1), [])[0].double(), CHI_SAMPLING)
        stopped = grammar.stopped  # the text is as long as the regex allows: the answer ends at its first token
        grammar.reset()
        runtime.rollback(len(prompt))
        if stopped:
            exact[(y1,)] = float(p1[y1])
            continue
        for y2 in torch.nonzero(p2 > 0).flatten().tolist():
            exact[(y1, y2)] = float(p1[y1] * p2[y2])
    runtime.rollback(0)
    bins = [outcome for outcome, p in exact.items() if p * SAMPLES >= 5]
    assert len(bins) > 20
    first, second = in_two_processes(constrained_samples, (model, draft), SAMPLES)
    samples, accepted, rejected = first[0] + second[0], first[1] + second[1], first[2] + second[2]
    counts = Counter(samples)
    observed = [counts.get(b, 0) for b in bins] + [SAMPLES - sum(counts.get(b, 0) for b in bins)]
    expected = [exact[b] * SAMPLES for b in bins] + [SAMPLES * (1 - sum(exact[b] for b in bins))]
    if expected[-1] < 5:  # the rest is too rare for a bin of its own: it joins the last
        observed[-2:], expected[-2:] = [sum(observed[-2:])], [sum(expected[-2:])]
    assert chisquare(np.array(observed), np.array(expected)).pvalue > 1e-3
    assert accepted > 0.02 * SAMPLES and rejected > 0.02 * SAMPLES  # both outcomes are under test


def test_a_draft_that_runs_past_the_grammars_end_is_masked_without_a_fault(model):
    """A draft that completes the text and goes on with an end token (which the grammar admits): each row's mask
    is computed, the row after the completing token allows only the end token, the rows the round cannot reach
    allow everything, and the matcher is left where it was."""
    decoder = SpecDecoder.load(model, backend="fused")
    grammar = decoder.grammar(GrammarSpec("regex", "The answer is: (yes|no)"))
    answer = decoder.token_text.encode(b"The answer is: yes")[0]
    end = sorted(decoder.stop_ids)
    draft = answer + end[:1] + end[:1]
    assert grammar.admitted(draft) > len(answer)  # the end token is admitted after the answer
    allowed = ~grammar.forbidden(draft)
    assert allowed.shape[0] == len(draft) + 1
    assert set(np.nonzero(allowed[len(answer)])[0].tolist()) <= set(end)
    assert allowed[len(answer) + 1:].all()
    assert not grammar.accepting and grammar.admitted(answer) == len(answer)
