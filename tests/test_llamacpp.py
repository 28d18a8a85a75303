"""The llama.cpp backend on a tiny random GGUF written by the tests (tests/tiny_gguf.py): its logits against
llama-cpp-python's own eval, rollback and prefix reuse, many sequences in one pass, greedy identity for each
drafter, exact sampling by chi-square, and every refusal."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from tiny_gguf import write_tiny_gguf
from two_processes import in_two_processes

llama_cpp = pytest.importorskip("llama_cpp")

from exactspec.api import SpecDecoder  # noqa: E402
from exactspec.backends.base import (  # noqa: E402
    PoolFull,
    Row,
    rows_are_pass_invariant,  # noqa: E402
)
from exactspec.backends.llamacpp import GGUFModel, LlamaCppLM, LlamaCppPool  # noqa: E402
from exactspec.cli import main  # noqa: E402
from exactspec.engine import Engine, GenerationConfig  # noqa: E402
from exactspec.errors import UsageError  # noqa: E402
from exactspec.models import load_model  # noqa: E402
from exactspec.proposers import make_proposer  # noqa: E402
from exactspec.sampling import SamplingParams, logits_to_probs  # noqa: E402

# Two passes over the same tokens that differ only in how llama.cpp groups its work (one row or several, or
# where the cache's cells lie after a rollback) differ by float rounding only in F32 weights (llama.cpp multiplies
# one row and several by different kernels): the tiny model's F16 KV cache bounds that by about four
# half-precision roundings of the logits (|logit| < 12: 12 * 4 * 2**-11 = 0.023). With quantised weights (Q8_0
# here, Q4_1 in the default model) and flash attention, a row's logits do not depend on the pass at all: the
# identity tests below run on the Q8_0 copy and ask for equality.
PASS_TOLERANCE = 0.025
PROMPT = [1, 504, 3458, 314, 260, 5246, 30, 378, 29, 504, 3458, 314, 260]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("llamacpp") / "tiny.gguf", context=512, seed=0)


@pytest.fixture(scope="module")
def tiny_draft(tiny) -> Path:
    """The same weights in Q8_0: a draft model close to the target but not equal to it, so that drafts are
    accepted and rejected."""
    return write_tiny_gguf(tiny.parent / "tiny-q8.gguf", context=512, seed=0, tensor_type="Q8_0")


@pytest.fixture(scope="module")
def lm(tiny) -> LlamaCppLM:
    return LlamaCppLM.load(tiny, threads=2)


@pytest.fixture(scope="module")
def quantised(tiny_draft) -> LlamaCppLM:
    """The Q8_0 copy as the target: its rows do not depend on the pass, so speculation must not change a token."""
    return LlamaCppLM.load(tiny_draft, threads=2)


def test_logits_equal_llama_cpp_pythons_own_eval(tiny, lm):
    reference = llama_cpp.Llama(model_path=str(tiny), n_ctx=512, logits_all=True, verbose=False, n_threads=2,
                                flash_attn=True)  # as exactspec's contexts
    reference.eval(PROMPT)
    expected = torch.from_numpy(np.array(reference.scores[: len(PROMPT)]))  # [n, vocab]
    lm.rollback(0)
    ours = lm.extend(PROMPT, len(PROMPT))  # [n, vocab]
    assert ours.shape == (len(PROMPT), lm.vocab_size)
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-5)  # the same kernels on the same batch


def test_rollback_then_extend_equals_a_fresh_pass(lm):
    lm.rollback(0)
    fresh = lm.extend(PROMPT[:6] + [7, 8, 9], 3)
    lm.rollback(0)
    lm.extend(PROMPT, 1)
    lm.rollback(6)  # forget what followed the first six tokens
    assert lm.tokens == PROMPT[:6]
    again = lm.extend([7, 8, 9], 3)
    assert (again - fresh).abs().max() < PASS_TOLERANCE
    assert torch.equal(again.argmax(-1), fresh.argmax(-1))


def test_sync_reuses_the_cached_prefix(lm):
    from exactspec.backends import sync

    lm.rollback(0)
    lm.extend(PROMPT, 1)
    calls = []
    original = lm.context.decode
    lm.context.decode = lambda entries: calls.append(len(entries)) or original(entries)
    try:
        sync(lm, PROMPT + [5, 6], num_logits=1)
    finally:
        lm.context.decode = original
    assert calls == [2]  # only the two new tokens ran
    assert lm.tokens == PROMPT + [5, 6]


def test_many_sequences_in_one_pass_equal_each_alone(tiny_draft, quantised):
    """Bit for bit: a row's logits depend on neither the other sequences in the pass nor the pass's size."""
    lm = quantised
    pool = LlamaCppPool(GGUFModel(tiny_draft), max_slots=3, max_length=128, threads=2)
    prompts = [PROMPT, PROMPT[3:], [1, 42, 43, 44]]
    slots = [pool.open() for _ in prompts]
    together = pool.forward([Row(slot, p, 2) for slot, p in zip(slots, prompts)])
    for prompt, logits in zip(prompts, together):
        lm.rollback(0)
        alone = lm.extend(prompt, 2)
        assert torch.equal(logits, alone)
    # a slot cut back (rejected draft tokens) and extended again sees only its own accepted tokens
    slots[0].length = 5
    after_cut = pool.forward([Row(slots[0], [77, 78], 1)])[0]
    lm.rollback(0)
    assert torch.equal(after_cut, lm.extend(PROMPT[:5] + [77, 78], 1))
    steps = pool.forward([Row(slot, [90 + i], 1) for i, slot in enumerate(slots)])  # one decode row each
    for i, logits in enumerate(steps):
        lm.rollback(0)
        context = (PROMPT[:5] + [77, 78]) if i == 0 else prompts[i]
        assert torch.equal(logits, lm.extend(context + [90 + i], 1))
    # closing frees the sequence for a new slot; a full pool refuses another
    pool.close(slots[1])
    reopened = pool.open()
    assert reopened.length == 0 and len(pool.slots) == 3
    with pytest.raises(PoolFull):
        pool.open()


def test_bad_input_is_refused_before_llama_cpp_sees_it(lm):
    lm.rollback(0)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        lm.extend([lm.vocab_size], 1)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        lm.extend([-1], 1)
    with pytest.raises(ValueError, match="exceed the context"):
        lm.extend([5] * (lm.max_length + 1), 1)
    assert lm.tokens == []
    from exactspec.backends.llamacpp.runtime import Entry

    with pytest.raises(ValueError, match="position"):
        lm.context.decode([Entry(5, lm.max_length, 0, True)])
    with pytest.raises(ValueError, match="sequence"):
        lm.context.decode([Entry(5, 0, lm.context.n_sequences, True)])
    assert lm.extend([1, 5], 1).shape == (1, lm.vocab_size)  # and it still works


SEEDED = SamplingParams(temperature=0.7, top_p=0.95)  # the invariant sampler, by default


@pytest.mark.parametrize("sampling", [SamplingParams(), SEEDED], ids=["greedy", "seeded-0.7"])
@pytest.mark.parametrize("drafter,k", [("prompt-lookup", 4), ("prompt-lookup", "auto"), ("retrieval", 3),
                                       ("draft-model", 3), ("draft-model", "auto")])
def test_speculation_gives_plain_decodings_tokens(tiny, quantised, drafter, k, sampling):
    """Greedy, and seeded sampling at temperature 0.7 with the invariant sampler: every drafter gives the tokens of
    plain decoding, bit for bit."""
    lm = quantised
    plain_engine = Engine(lm, make_proposer("none", lm))
    draft = LlamaCppLM.load(tiny, threads=2) if drafter == "draft-model" else None  # F32: near the Q8_0 target
    engine = Engine(lm, make_proposer(drafter, lm, draft))
    prompts = [PROMPT, PROMPT * 3, [1, 9, 10, 11, 9, 10, 11, 9, 10]]
    accepted = rejected = 0
    for seed, prompt in enumerate(prompts):
        config = GenerationConfig(max_new_tokens=40, sampling=sampling, seed=seed, stop_at_eos=False)
        plain = plain_engine.generate(prompt, config).token_ids
        result = engine.generate(prompt, replace(config, num_draft_tokens=k))
        assert result.token_ids == plain
        accepted += result.stats.accepted_tokens
        rejected += result.stats.draft_tokens - result.stats.accepted_tokens
    if drafter == "draft-model":
        assert accepted > 0  # the near-copy draft is accepted: the identity above covers accepted drafts
    if drafter != "draft-model":  # (the near-copy, under the same noise, nearly always picks the target's token)
        assert rejected > 0  # copies are rejected too: the identity covers rejected drafts


def first_tokens_of_seeds(tiny, tiny_draft, sampling: SamplingParams, count: int, seeds: range
                          ) -> list[tuple[int, ...]]:
    lm = LlamaCppLM.load(tiny, threads=1)
    engine = Engine(lm, make_proposer("draft-model", lm, LlamaCppLM.load(tiny_draft, threads=1)))
    return [tuple(engine.generate(PROMPT, GenerationConfig(max_new_tokens=count, num_draft_tokens=2,
                                                           sampling=sampling, seed=seed, stop_at_eos=False)
                                  ).token_ids[:count])
            for seed in seeds]


def first_tokens(tiny, tiny_draft, sampling: SamplingParams, count: int, samples: int) -> list[tuple[int, ...]]:
    """The first ``count`` tokens for seeds 0 to samples - 1, drawn in two spawned processes."""
    first, second = in_two_processes(first_tokens_of_seeds, (tiny, tiny_draft, sampling, count), samples)
    return first + second


def exact_first_two(lm: LlamaCppLM, sampling: SamplingParams) -> dict[tuple[int, int], float]:
    """P(y1, y2) of plain sampling from llama.cpp's logits: p(y1) after the prompt, p(y2 | y1) after each y1
    that has probability."""
    lm.rollback(0)
    p1 = logits_to_probs(lm.extend(PROMPT, 1)[0].double(), sampling)  # [vocab]
    joint = {}
    for y1 in torch.nonzero(p1).flatten().tolist():
        lm.rollback(0)
        p2 = logits_to_probs(lm.extend(PROMPT + [y1], 1)[0].double(), sampling)
        for y2 in torch.nonzero(p2).flatten().tolist():
            joint[(y1, y2)] = float(p1[y1] * p2[y2])
    return joint


def binned(samples: list[tuple[int, ...]], exact: dict[tuple, float]) -> tuple[np.ndarray, np.ndarray]:
    """Observed and expected counts over outcomes expected at least 5 times, plus one bin for the rest (when the
    rest has any mass: an outcome outside the support then shows as a count where none is expected)."""
    n = len(samples)
    bins = [outcome for outcome, p in exact.items() if p * n >= 5]
    counts = Counter(samples)
    observed = [counts.get(b, 0) for b in bins]
    expected = [exact[b] * n for b in bins]
    rest_observed, rest_expected = n - sum(observed), n - sum(expected)
    if rest_expected > 1e-6:
        observed, expected = observed + [rest_observed], expected + [rest_expected]
    else:
        assert rest_observed == 0, f"{rest_observed} samples fell outside the support"
        expected[-1] += rest_expected  # rounding: the expected counts sum to n
    return np.array(observed, float), np.array(expected, float)


@pytest.mark.parametrize("method", ["invariant", "standard"])
def test_speculative_sampling_at_temperature_1_follows_llama_cpps_distribution(tiny, tiny_draft, lm, method):
    """The first token of draft-model speculation (k = 2, temperature 1, the whole vocabulary) against the exact
    distribution from llama.cpp's logits, for each sampling method: 6,000 samples, bins expected at least 5 times
    plus the rest, one chi-square test at alpha = 0.001 each (a correct engine fails one with probability 0.2%;
    the seeds are fixed)."""
    sampling = SamplingParams(temperature=1.0, method=method)
    lm.rollback(0)
    p1 = logits_to_probs(lm.extend(PROMPT, 1)[0].double(), sampling)
    exact = {(token,): float(p) for token, p in enumerate(p1.tolist()) if p > 0}
    observed, expected = binned(first_tokens(tiny, tiny_draft, sampling, 1, 6000), exact)
    assert len(observed) > 20
    assert chisquare(observed, expected).pvalue > 1e-3


@pytest.mark.slow  # over 10 s on 2 cores
def test_speculative_sampling_with_top_k_and_top_p_follows_llama_cpps_joint(tiny, tiny_draft, lm):
    """The first two tokens (draft-model, k = 2, temperature 1, top-k 6, top-p 0.9) against their exact joint
    from llama.cpp's logits: 4,000 samples, one chi-square test at alpha = 0.001 (false alarm 0.1%). Over its 34
    outcomes it catches, with probability 0.99, a sampler at a chi-square distance of 0.017 from the exact joint,
    so any that moves a total variation of 0.07 of the mass (6,000 samples caught 0.012, 0.05)."""
    sampling = SamplingParams(temperature=1.0, top_k=6, top_p=0.9)
    observed, expected = binned(first_tokens(tiny, tiny_draft, sampling, 2, 4000), exact_first_two(lm, sampling))
    assert len(observed) > 30
    assert chisquare(observed, expected).pvalue > 1e-3


def test_the_api_and_the_default_backend_run_a_gguf_on_the_runtime_measured_fastest(tiny):
    """--backend auto measures llama.cpp and the fused runtime once (the fused runtime reads this F32 file alone, so
    the lean runtime, which needs its transformers conversion, is no candidate), keeps the fastest, and runs it;
    llama.cpp, named, runs the GGUF without a transformers model."""
    from exactspec import runtime_choice as choice

    auto = SpecDecoder.load(str(tiny), drafter="prompt-lookup", threads=2)
    (entry,) = [value for key, value in choice.CACHE.entries().items() if str(tiny.resolve()) in key]
    measured = {m["backend"]: m["decode_ms"] + m["score_ms"] for m in entry["measurements"]}
    assert set(measured) == {"llama.cpp", "fused"}
    assert auto.target.backend_name == entry["backend"] == min(measured, key=measured.get)
    decoder = SpecDecoder.load(str(tiny), drafter="prompt-lookup", backend="llama.cpp", threads=2)
    assert decoder.target.backend_name == "llama.cpp" and decoder.target.model is None
    completion = decoder.generate("Write a haiku about the sea", max_new_tokens=12)
    assert len(completion.token_ids) == 12 or completion.token_ids[-1] in decoder.engine.eos_token_ids
    torch_decoder = SpecDecoder.load(str(tiny), drafter="none", backend="torch")
    assert torch_decoder.target.backend_name == "lean"  # torch: the lean runtime's old name, kept
    # one vocabulary: the GGUF's own tokenizer encodes as transformers' tokenizer of the same file
    text = "Hello world, <|im_start|>user\nnaïve café"
    assert decoder.tokenizer.encode(text) == list(torch_decoder.tokenizer.encode(text))
    assert decoder.encode("hi") == torch_decoder.encode("hi")  # the chat template too


def test_hidden_states_are_the_normed_states_the_lm_head_reads(tiny, tiny_draft):
    """llama.cpp's embeddings are the torch runtime's hidden states (final norm applied), for a prompt pass, single
    positions after it and after a rollback. Keeping them makes every row an output, which changes the last layer's
    grouping of rows: the logits then move by pass rounding only."""
    from exactspec.backends import make_backend

    torch_lm = make_backend(load_model(str(tiny), dtype="float32").model, "float32")
    torch_lm.keep_hidden_states()
    lm = LlamaCppLM.load(tiny, threads=2)
    plain = LlamaCppLM.load(tiny, threads=2)
    lm.keep_hidden_states()

    def passes(model) -> torch.Tensor:  # the logits of a prompt pass, a rollback, and single positions
        seen = [model.extend(PROMPT, 2)]
        model.rollback(len(PROMPT) - 3)
        seen.append(model.extend(PROMPT[-3:], 1))
        seen += [model.extend([token], 1) for token in (9, 10)]
        return torch.cat(seen)

    with_states, without, on_torch = passes(lm), passes(plain), passes(torch_lm)
    assert lm.hidden_states.shape == (len(PROMPT) + 2, torch_lm.hidden_states.shape[1])
    # llama.cpp's flash attention sums the F16 values in F16: about a half-precision rounding of each state
    torch.testing.assert_close(lm.hidden_states, torch_lm.hidden_states, atol=3e-3, rtol=1e-3)
    torch.testing.assert_close(with_states, without, atol=PASS_TOLERANCE, rtol=0)
    torch.testing.assert_close(with_states, on_torch, atol=PASS_TOLERANCE, rtol=0)


def random_feature_drafter(method: str, tiny: Path):
    """An untrained eagle head or mtp heads for the tiny GGUF's target (random weights, seed 0)."""
    from exactspec.drafters.layers import LayerShape
    from exactspec.drafters.networks import DrafterConfig, EagleHead, MTPHeads, TargetParts

    model = load_model(str(tiny), dtype="float32").model
    torch.manual_seed(0)
    config = DrafterConfig(method=method, shape=LayerShape.of(model.config), vocab_size=model.config.vocab_size)
    network = (EagleHead if method == "eagle" else MTPHeads)(config, TargetParts.of(model))
    with torch.no_grad():
        for parameter in network.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.02)
    return network


@pytest.mark.parametrize("drafter", ["eagle", "mtp"])
def test_feature_drafters_read_llama_cpps_hidden_states_and_keep_greedy_output(tiny, tiny_draft, quantised,
                                                                               drafter):
    network = random_feature_drafter(drafter, tiny)
    target = LlamaCppLM.load(tiny_draft, threads=2)  # every row an output, for its hidden states
    engine = Engine(target, make_proposer(drafter, target, network))
    plain_engine = Engine(quantised, make_proposer("none", quantised))
    drafted = 0
    for prompt in (PROMPT, [1, 9, 10, 11, 9, 10, 11, 9, 10]):
        plain = plain_engine.generate(prompt, GenerationConfig(max_new_tokens=24, stop_at_eos=False)).token_ids
        result = engine.generate(prompt, GenerationConfig(max_new_tokens=24, num_draft_tokens=3, stop_at_eos=False))
        assert result.token_ids == plain
        drafted += result.stats.draft_tokens
    assert drafted > 0  # the drafter read the states and drafted


def test_drafters_llama_cpp_cannot_serve_are_refused_in_one_line(tiny, capsys):
    drafter = "early-exit"
    assert main(["generate", "hi", "--model", str(tiny), "--drafter", drafter, "--max-new-tokens", "2",
                 "--backend", "llama.cpp"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--backend lean" in err and drafter in err


def test_trees_are_refused_on_llama_cpp(tiny, capsys):
    assert main(["generate", "hi", "--model", str(tiny), "--tree", "2,1", "--max-new-tokens", "2",
                 "--backend", "llama.cpp"]) == 2
    assert "--backend lean" in capsys.readouterr().err


def test_bad_model_files_are_refused_in_one_line(tmp_path, tiny, capsys):
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(tiny.read_bytes()[: 1 << 20])
    not_gguf = tmp_path / "text.gguf"
    not_gguf.write_text("hello")
    directory = tmp_path / "hf"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"model_type": "llama"}))
    cases = [
        (["--model", str(truncated)], "(truncated?)"),  # found by exactspec's own reader, before llama.cpp
        (["--model", str(not_gguf)], "not a GGUF file"),
        (["--model", str(directory), "--backend", "llama.cpp"], "is not one"),
        (["--model", str(tiny), "--backend", "llama.cpp", "--dtype", "float32"], "--backend lean"),
    ]
    for flags, message in cases:
        assert main(["generate", "hi", "--max-new-tokens", "2", *flags]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err, err


def test_quantize_makes_a_float_gguf_pass_invariant(tiny, tmp_path, capsys):
    """The tiny F32 GGUF's rows depend on the pass (its load says so); ``exactspec quantize`` writes a Q8_0 copy whose
    rows do not, on which speculation gives plain greedy output."""
    assert not rows_are_pass_invariant(LlamaCppLM.load(tiny))
    out = tmp_path / "copy.gguf"
    assert main(["quantize", str(tiny), "--out", str(out)]) == 0
    assert "bit for bit" in capsys.readouterr().out
    copy = LlamaCppLM.load(out, threads=2)
    assert rows_are_pass_invariant(copy) and copy.model.weight_type == "Q8_0"
    config = GenerationConfig(max_new_tokens=24, stop_at_eos=False)
    prompt = [1, 9, 10, 11, 9, 10, 11, 9, 10]
    plain = Engine(copy, make_proposer("none", copy)).generate(prompt, config).token_ids
    assert Engine(copy, make_proposer("prompt-lookup", copy)).generate(prompt, config).token_ids == plain


def test_quantize_refuses_what_it_cannot_convert_in_one_line(tiny, tmp_path, capsys):
    text = tmp_path / "notes.gguf"
    text.write_text("not weights")
    cases = [([str(text)], f"not a GGUF file: {text}"),
             ([str(tmp_path / "missing.gguf")], "model file not found"),
             ([str(tiny), "--out", str(tmp_path / "no" / "such" / "dir.gguf")], "does not exist"),
             ([str(tiny), "--out", str(tiny)], "onto itself"),
             ([str(tiny), "--type", "q3_k"], "argument --type: invalid choice")]
    for args, message in cases:
        assert main(["quantize", *args]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err


def test_the_cli_generates_on_llama_cpp(tiny, capsys):
    assert main(["generate", "Write a haiku", "--model", str(tiny), "--backend", "llama.cpp", "--threads", "1",
                 "--max-new-tokens", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert 1 <= out["stats"]["new_tokens"] <= 8


def test_the_scheduler_batches_on_llama_cpp_exactly_per_request(quantised):
    """Requests decoded together in one llama.cpp pass per step give each its own greedy output, token for
    token."""
    lm = quantised
    from exactspec.server import BatchSettings, build_scheduler
    from exactspec.server.scheduler import GenerationRequest

    scheduler = build_scheduler(lm, BatchSettings(speculation="always", max_batch_size=3, max_model_len=128),
                                set())
    scheduler.start()
    prompts = [PROMPT, PROMPT * 2, [1, 9, 10, 11, 9, 10, 11], [1, 300, 301]]
    try:
        handles = [scheduler.submit(GenerationRequest(p, max_tokens=16, stop_at_eos=False)) for p in prompts]
        outputs = []
        for handle in handles:
            tokens, finished, _ = handle.collect()
            assert finished.reason == "length"
            outputs.append(tokens)
    finally:
        scheduler.shutdown(5)
    plain_engine = Engine(lm, make_proposer("none", lm))
    for prompt, tokens in zip(prompts, outputs):
        plain = plain_engine.generate(prompt, GenerationConfig(max_new_tokens=16, stop_at_eos=False)).token_ids
        assert tokens == plain


def decode_on_scheduler(lm, speculation: str, requests: list) -> list[list[int]]:
    """Each request's tokens, the requests decoded together (up to 16 at once) by a scheduler on ``lm``."""
    from exactspec.server import BatchSettings, build_scheduler

    scheduler = build_scheduler(lm, BatchSettings(speculation=speculation, num_draft_tokens=3, max_batch_size=16,
                                                  max_model_len=128), set())
    scheduler.start()
    try:
        handles = [scheduler.submit(request) for request in requests]
        return [handle.collect()[0] for handle in handles]
    finally:
        scheduler.shutdown(5)


@pytest.mark.parametrize("method", ["invariant", "standard"])
def test_a_seeded_request_samples_the_same_tokens_alone_and_in_a_burst(quantised, method):
    """At temperature 0.8, a seeded request's tokens do not depend on the 15 others decoded beside it: each row of
    the pass is computed as it is alone, and the request's draws are its own. With the invariant sampler they do
    not depend on speculation either: never, always and auto (whose draft lengths follow the load) give plain
    decoding's tokens. The standard rule's draws depend on the drafts, so there each mode is compared with itself
    at a fixed k."""
    from exactspec.server.scheduler import GenerationRequest

    def request(prompt, seed):
        return GenerationRequest(prompt, max_tokens=24, sampling=SamplingParams(temperature=0.8, method=method),
                                 seed=seed, stop_at_eos=False)

    watched = request(PROMPT * 2, seed=5)
    others = [request([1, 9 + i, 10, 11, 9 + i, 10, 11], seed=100 + i) for i in range(15)]
    plain_alone = decode_on_scheduler(quantised, "never", [watched])[0]
    for speculation in ["never", "always", "auto"] if method == "invariant" else ["never", "always"]:
        alone = plain_alone if method == "invariant" else decode_on_scheduler(quantised, speculation, [watched])[0]
        in_burst = decode_on_scheduler(quantised, speculation, others[:7] + [watched] + others[7:])[7]
        assert in_burst == alone, speculation


def test_a_gguf_template_renders_tools_and_dates_as_transformers_does(tiny):
    """Tool definitions keep their keys' order and their characters (Jinja's own tojson sorted the keys and wrote
    ``'`` as ``\\u0027``), ``indent`` is honoured, and ``strftime_now`` gives today's date (Llama 3's templates showed
    "26 Jul 2024" without it)."""
    import datetime
    import json

    tokenizer = load_model(str(tiny), backend="llama.cpp").tokenizer
    tokenizer.__dict__.pop("_template", None)
    tokenizer.chat_template = ("{{ tools[0] | tojson }}|{{ tools[0] | tojson(indent=2) }}|"
                               "{{ strftime_now('%d %b %Y') }}{% for m in messages %}"
                               "{% if loop.index > 1 %}{% break %}{% endif %}|{{ m.content }}{% endfor %}")
    tool = {"name": "it's", "b": 1, "a": "é"}
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "user", "content": "no"}],
                                         tokenize=False, tools=[tool])
    today = datetime.datetime.now().strftime("%d %b %Y")
    assert text == f"{json.dumps(tool, ensure_ascii=False)}|{json.dumps(tool, ensure_ascii=False, indent=2)}|{today}|hi"


def test_the_tokenizer_needs_no_transformers(tiny):
    loaded = load_model(str(tiny), backend="llama.cpp")
    assert loaded.model is None and loaded.tokenizer.eos_token_id is not None
    ids = loaded.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert loaded.tokenizer.decode(ids, skip_special_tokens=False).endswith("assistant\n")
    with pytest.raises(UsageError, match="llama.cpp runs a .gguf"):
        load_model(str(tiny.parent), backend="llama.cpp")
    # in a fresh process (this one imported transformers long ago): loading, templating, decoding import none of it
    import subprocess
    import sys

    script = (f"import sys\nfrom exactspec.models import load_model\nloaded = load_model({str(tiny)!r}, "
              "backend='llama.cpp')\nids = loaded.tokenizer.apply_chat_template([{'role': 'user', 'content': 'hi'}])\n"
              "loaded.tokenizer.decode(ids)\nprint('transformers' in sys.modules)\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "False", result.stdout + result.stderr


def test_figure_1_draws_llama_cpps_pass_costs_beside_the_torch_runtimes(tiny, tmp_path, capsys):
    from exactspec.bench.figures import POSITIONS, figure_1_runtimes, pass_latency

    target = load_model(str(tiny), dtype="float32")
    runtimes = dict(figure_1_runtimes(target.model, target.gguf, threads=2))
    assert {"llama.cpp, GGUF as stored", "fused runtime", "float16 weights"} <= set(runtimes)
    latency = pass_latency(runtimes["llama.cpp, GGUF as stored"](), PROMPT, POSITIONS, repeats=1)
    assert len(latency) == len(POSITIONS) and all(s > 0 for s in latency)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"turns": ["Write a haiku about the sea"]}\n')
    assert main(["figures", "--out", str(tmp_path / "figs"), "--model", str(tiny), "--prompts", str(prompts),
                 "--limit", "1", "--max-new-tokens", "4", "--repeats", "1", "--max-batch", "2",
                 "--threads", "2"]) == 0, capsys.readouterr().err
    assert (tmp_path / "figs" / "many_drafts_one_weight_streaming.png").read_bytes()[:4] == b"\x89PNG"


def test_figure_1_alone_runs_from_the_gguf_as_stored(tiny, tmp_path, capsys, monkeypatch):
    from exactspec.bench import figures

    runtimes = dict(figures.stored_runtimes(str(tiny), threads=2))
    assert set(runtimes) == {"llama.cpp (GGUF as stored)", "fused (as stored, integer products)",
                             "fused (as stored, float products)"}

    def no_conversion(*args, **kwargs):
        raise AssertionError("figure 1 of a file the fused runtime reads converted it")

    monkeypatch.setattr("exactspec.models.transformers_directory", no_conversion)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"turns": ["Write a haiku about the sea"]}\n')
    args = ["figures", "--out", str(tmp_path / "figs"), "--model", str(tiny), "--prompts", str(prompts),
            "--limit", "1", "--repeats", "1", "--threads", "2"]
    assert main(args + ["--only", "1"]) == 0, capsys.readouterr().err
    assert [p.name for p in (tmp_path / "figs").iterdir()] == ["many_drafts_one_weight_streaming.png"]
    capsys.readouterr()
    assert main(args + ["--only", "1,5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--only takes figures among 1, 2, 3, 4" in err[0]


def test_a_gguf_draft_model_runs_beside_a_fused_target_from_its_file(tiny, tiny_draft, monkeypatch):
    from exactspec.loading import load_target

    def no_conversion(*args, **kwargs):
        raise AssertionError("the draft GGUF was converted to a transformers model")

    monkeypatch.setattr("exactspec.models.transformers_directory", no_conversion)
    loaded = load_target(str(tiny), backend="fused", draft_model=str(tiny_draft))
    assert loaded.target.backend == "fused" and loaded.draft.backend == "fused"
    assert loaded.draft.runtime.name == "fused"



# --- long texts: tokenized in pieces, as llama.cpp tokenizes them whole -----------------------------------------------


def tokenized_whole(model: GGUFModel, text: str, add_special: bool) -> list[int]:
    """The ids of one llama.cpp call over the whole text (special tokens parsed): what ``encode`` must give."""
    import ctypes

    data = text.encode()
    ids = (ctypes.c_int32 * (len(data) + 8))()
    n = llama_cpp.llama_tokenize(model.vocab, data, len(data), ids, len(data) + 8, add_special, True)
    return list(ids[:n])


@pytest.fixture(scope="module")
def vocabularies(tmp_path_factory) -> dict[str, GGUFModel]:
    """The default model's byte-level BPE (ChatML specials, no BOS added) and a SentencePiece vocabulary (a space
    prefix, BOS added, ``<s>``, ``</s>`` and ``<unk>`` for specials): their files' vocabularies alone."""
    from tiny_vocabularies import sentencepiece_fields

    from exactspec.models import default_model_path

    spm = write_tiny_gguf(tmp_path_factory.mktemp("spm") / "spm.gguf", tokenizer=sentencepiece_fields()[0])
    return {"bpe": GGUFModel(default_model_path(), vocab_only=True), "spm": GGUFModel(spm, vocab_only=True)}


@pytest.fixture
def llama_calls(monkeypatch) -> list[bytes]:
    """The texts handed to llama.cpp's tokenizer, call by call."""
    calls, tokenize = [], llama_cpp.llama_tokenize

    def recorded(vocab, data, length, *rest):
        calls.append(data[:length])
        return tokenize(vocab, data, length, *rest)

    monkeypatch.setattr(llama_cpp, "llama_tokenize", recorded)
    return calls


ATOMS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<repo_name>", "<reponame>", "<s>", "</s>", "<unk>",
         "<|im", "_end|>", "<", ">", "</", " ", "  ", "\n", "\t", " \n", "hi", "Hello", " world", "é", "🦄", "ab c",
         "the", "[INST]", "12", ".")


@pytest.mark.parametrize("name", ["bpe", "spm"])
def test_a_long_text_tokenized_in_pieces_gets_the_ids_of_one_call(vocabularies, name):
    """Texts of special tokens, near misses, whitespace and words, long enough to be cut in several pieces (with and
    without BOS): each gets the ids llama.cpp gives it in one call."""
    import random

    from exactspec.backends.llamacpp import GGUFTokenizer
    from exactspec.backends.llamacpp.tokenizer import CALL_BYTES

    model = vocabularies[name]
    tokenizer = GGUFTokenizer(model)
    rng = random.Random(0)
    for trial in range(60):
        text = "".join(rng.choice(ATOMS) for _ in range(rng.randint(CALL_BYTES // 4, 3 * CALL_BYTES)))
        add_special = bool(trial % 2)
        assert tokenizer.encode(text, add_special_tokens=add_special) == tokenized_whole(model, text, add_special), \
            (trial, text[:80])


def test_a_long_chat_is_tokenized_in_calls_of_bounded_size(vocabularies, llama_calls):
    """llama.cpp's split at special tokens costs the square of their count in one call (a chat of 16,000 messages:
    6.9 s to refuse, 30,000: 19 s), so a long chat goes to it in pieces of a bounded size, cut where its own split
    falls: the same ids, at a cost linear in the text."""
    from exactspec.backends.llamacpp import GGUFTokenizer
    from exactspec.backends.llamacpp.tokenizer import CALL_BYTES

    model = vocabularies["bpe"]
    tokenizer = GGUFTokenizer(model)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}] * 4000, tokenize=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert max(map(len, llama_calls)) <= CALL_BYTES + 64 and b"".join(llama_calls) == text.encode()
    assert ids == tokenized_whole(model, text, False)


def test_a_chat_far_over_the_context_is_tokenized_only_as_far_as_the_context(vocabularies, llama_calls):
    """With transformers' ``truncation`` and ``max_length``, the first ``max_length`` ids, and the text past them is
    never tokenized: refusing a prompt far over the context costs what the context does."""
    from exactspec.backends.llamacpp import GGUFTokenizer
    from exactspec.backends.llamacpp.tokenizer import CALL_BYTES

    model = vocabularies["bpe"]
    tokenizer = GGUFTokenizer(model)
    messages = [{"role": "user", "content": "hi"}] * 30000
    ids = tokenizer.apply_chat_template(messages, truncation=True, max_length=512)
    assert sum(map(len, llama_calls)) <= 2 * CALL_BYTES
    shorter = tokenizer.apply_chat_template(messages[:300], tokenize=False)
    assert ids == tokenized_whole(model, shorter, False)[:512]
    plain = "hello world " * 2000
    assert tokenizer.encode(plain, truncation=True, max_length=100) == tokenized_whole(model, plain, True)[:100]
