"""A draft model with another tokenizer than the target's drafts exactly (issue 36).

Tiny random GGUFs with genuinely different vocabularies: a SentencePiece one (byte fallback, a space prefix, <s> and
</s>, an [INST] template), a shuffled sub-vocabulary of it (some merges gone, other ids), and the default model's
byte-level BPE (ChatML). Greedy and seeded (invariant) output is plain decoding's, bit for bit, on every backend and
with both ways of proposing; standard sampling draws from the target's distribution (a chi-square test).
"""

from __future__ import annotations

import functools
import logging
from collections import Counter

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from tiny_gguf import write_tiny_gguf
from tiny_vocabularies import sentencepiece_fields, sub_vocabulary
from two_processes import in_two_processes

from exactspec.api import SpecDecoder
from exactspec.engine import GenerationConfig
from exactspec.errors import UsageError
from exactspec.models import load_tokenizer
from exactspec.sampling import SamplingParams, logits_to_probs
from exactspec.vocabularies import ChatFraming, ContextBridge, TokenText

PROMPTS = ("hello world, the python", "write a function\nthat returns héllo", "the prime number is 中")


@functools.cache
def models(directory: str) -> dict[str, str]:
    """Three tiny models on one seed: the SentencePiece vocabulary, its sub-vocabulary, the default model's."""
    fields, tokens = sentencepiece_fields(order_seed=5)
    sub, rows = sub_vocabulary(tokens, drop=0.4, seed=7)
    return {"spm": str(write_tiny_gguf(f"{directory}/spm.gguf", tokenizer=fields)),
            "sub": str(write_tiny_gguf(f"{directory}/sub.gguf", tokenizer=sub, token_rows=(rows, len(tokens)))),
            "bpe": str(write_tiny_gguf(f"{directory}/bpe.gguf"))}


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    return models(str(tmp_path_factory.mktemp("vocabularies")))


def token_text(path: str) -> TokenText:
    return TokenText(*load_tokenizer(path))


@pytest.mark.parametrize("name", ["spm", "sub", "bpe"])
def test_bytes_come_back_from_their_tokens(paths, name):
    """Any text, bytes that are not UTF-8 included, encodes to tokens whose bytes are that text, as far as the
    vocabulary can write it: byte fallback and byte-level BPE write every byte; a character cut at the end waits
    for the bytes that finish it unless the text is final."""
    text = token_text(paths[name])
    for data in (b"hello world", b" the\n\nprime", "héllo 中 🙂".encode(), b"ing", b"a\xffb", b"\xc3a"):
        ids, consumed = text.encode(data)
        assert text.text_of(ids) == data[:consumed]
        assert consumed == len(data) or data[consumed] not in text.byte_token, (data, consumed)
    ids, consumed = text.encode("ok é".encode()[:-1], final=False)
    assert consumed == 3 and text.text_of(ids) == b"ok "


def test_transformers_tokens_are_the_same_bytes_as_llama_cpps(paths):
    """A GGUF's tokenizer converted by transformers (the lean runtime's) gives every token the bytes llama.cpp's
    gives it: the byte-level BPE through GPT-2's alphabet, SentencePiece's pieces, bytes and specials."""
    from exactspec.models import transformers_directory

    for name in ("bpe", "spm"):
        from pathlib import Path

        from transformers import AutoTokenizer

        converted = AutoTokenizer.from_pretrained(transformers_directory(Path(paths[name])), local_files_only=True)
        ours, theirs = token_text(paths[name]), TokenText(converted, len(converted))
        assert theirs.pieces[: len(ours.pieces)] == ours.pieces[: len(theirs.pieces)], name
        assert ours.control <= theirs.control, name  # transformers counts <unk> among its specials too


def test_the_draft_sees_the_conversation_in_its_own_template_and_keeps_its_agreeing_tokens(paths):
    """The target's [INST] prompt reaches the ChatML draft as ChatML with the same message; after it, the draft's
    cached tokens are kept as far as their bytes agree with the target's text, and the rest is re-encoded."""
    target_tokenizer, _ = load_tokenizer(paths["spm"])
    draft_tokenizer, _ = load_tokenizer(paths["bpe"])
    target, draft = TokenText(*load_tokenizer(paths["spm"])), TokenText(*load_tokenizer(paths["bpe"]))
    bridge = ContextBridge(target, draft, ChatFraming.of(target_tokenizer), ChatFraming.of(draft_tokenizer))
    prompt = target_tokenizer.apply_chat_template([{"role": "user", "content": "write hello"}])
    ids, pending = bridge.draft_context(prompt, [])
    assert pending == b""
    assert draft.text_of(ids) == draft_tokenizer.apply_chat_template(
        [{"role": "user", "content": "write hello"}], tokenize=False).encode()
    answer = target_tokenizer.encode("the world", add_special_tokens=False)
    extended, pending = bridge.draft_context(prompt + answer, ids)
    assert extended[: len(ids)] == ids and draft.text_of(extended[len(ids):]) == b" the world" and pending == b""
    # a draft token the target did not write is dropped; a character the target cut in two is pending
    cut = target_tokenizer.encode("the worlé", add_special_tokens=False)[:-1]
    again, pending = bridge.draft_context(prompt + cut, extended)
    assert again[: len(ids)] == ids and pending == b"\xc3"


def outputs(decoder: SpecDecoder, k: int | str, sampling: SamplingParams, seed: int | None, tree=None
            ) -> tuple[list, int]:
    config = GenerationConfig(max_new_tokens=32, num_draft_tokens=k, sampling=sampling, seed=seed, stop_at_eos=False,
                              tree=tree)
    results = [decoder.generate_ids(decoder.encode(p, chat=False), config) for p in PROMPTS]
    return [r.token_ids for r in results], sum(r.stats.accepted_tokens for r in results)


@pytest.mark.parametrize("backend", ["fused", "llama.cpp", "lean"])
@pytest.mark.parametrize("pair", [("spm", "sub"), ("sub", "spm"), ("bpe", "spm")])
def test_greedy_and_seeded_output_is_plain_decodings_across_vocabularies(paths, backend, pair):
    """Both ways of proposing (text, intersection), at a fixed k and with k auto, greedy and seeded under the
    invariant sampler: the target's plain tokens, bit for bit; and, where the draft computes the target's function
    on the tokens they share (the SentencePiece pair), drafts were accepted, so both outcomes ran. A random model of
    49152 tokens accepts nothing from an unrelated one: that pair checks identity and the bytes' bookkeeping only."""
    if backend == "lean" and pair[0] == "bpe":
        pytest.skip("the lean runtime converts through transformers; one pair there covers its tokenizers")
    target, draft = paths[pair[0]], paths[pair[1]]
    plain = SpecDecoder.load(target, backend=backend)
    accepted = 0
    for method in ("text", "intersection", "auto"):
        speculating = SpecDecoder.load(target, draft_model=draft, backend=backend, cross_vocabulary=method)
        for sampling, seed in ((SamplingParams(), None), (SamplingParams(temperature=0.8), 3)):
            expected, _ = outputs(plain, 1, sampling, seed)
            for k in (3, "auto"):
                got, count = outputs(speculating, k, sampling, seed)
                assert got == expected, (method, sampling, k)
                accepted += count
            if backend != "llama.cpp":  # trees draft by intersection, on the runtimes that score them
                assert outputs(speculating, 3, sampling, seed, tree=(2, 1))[0] == expected, (method, sampling)
    assert accepted > 0 or pair[0] == "bpe"


def test_a_pair_sharing_few_frequent_tokens_is_told_so_in_one_line_and_still_runs(paths, caplog):
    """The default model's BPE as the target and the small SentencePiece vocabulary as the draft: it holds a few
    hundred of the target's frequent tokens, under half. One line says so, and it still drafts."""
    with caplog.at_level(logging.WARNING):
        decoder = SpecDecoder.load(paths["bpe"], draft_model=paths["spm"], backend="fused")
    lines = [r.getMessage() for r in caplog.records if "frequent tokens" in r.getMessage()]
    assert len(lines) == 1 and "%" in lines[0]
    assert len(decoder.generate("hello", max_new_tokens=4, num_draft_tokens=2).token_ids) == 4


def test_a_bad_method_and_an_unreadable_draft_are_refused_in_one_line(paths, tmp_path):
    with pytest.raises(UsageError, match="cross-vocabulary must be one of"):
        SpecDecoder.load(paths["spm"], draft_model=paths["sub"], backend="fused", cross_vocabulary="bytes")
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\0" * 20)
    with pytest.raises(UsageError, match="broken.gguf"):
        SpecDecoder.load(paths["spm"], draft_model=str(broken), backend="fused")


@pytest.mark.parametrize("method", ["text", "intersection"])
def test_the_server_drafts_across_vocabularies_each_request_in_a_slot_of_its_own(paths, method):
    """Twelve requests, three at a time, through a server whose two draft slots must be given back as requests
    end: every answer is plain decoding's, drafts were accepted, and no drafter ever failed (a slot kept by an
    ended request would leave a later one none)."""
    from concurrent.futures import ThreadPoolExecutor

    from exactspec.loading import draft_source, load_target
    from exactspec.server import BatchSettings, build_scheduler
    from exactspec.server.scheduler import GenerationRequest

    loaded = load_target(paths["spm"], backend="fused", draft_model=paths["sub"], drafters=("draft-model",))
    draft = draft_source("draft-model", loaded.target, loaded.runtime, loaded.draft, None, cross_vocabulary=method)
    settings = BatchSettings(drafter="draft-model", speculation="always", max_batch_size=3, max_model_len=128)
    scheduler = build_scheduler(loaded.runtime, settings, set(), None, draft)
    plain = SpecDecoder.load(paths["spm"], backend="fused")
    prompts = [plain.encode(p, chat=False) for p in PROMPTS] * 4
    expected, _ = outputs(plain, 1, SamplingParams(), None)
    scheduler.start()
    try:
        with ThreadPoolExecutor(3) as pool:
            got = list(pool.map(lambda ids: scheduler.submit(GenerationRequest(
                ids, max_tokens=32, sampling=SamplingParams(), stop_at_eos=False)).collect()[0], prompts))
    finally:
        scheduler.shutdown(timeout=5)
    assert got == expected * 4
    assert scheduler.metrics.accepted_tokens > 0 and scheduler.metrics.drafter_errors == 0


# 8,000 runs: over the ~170 outcomes expected at least 5 times (and the rest), a chi-square test at alpha = 0.001
# catches with probability 0.99 a sampler at a chi-square distance sum((q-p)^2/p) of 0.016 from the exact joint, so
# any that moves a total variation of 0.065 of the mass (20,000 runs caught 0.009, 0.05, in two and a half times the
# time)
SAMPLES = 8_000
CHI_SAMPLING = SamplingParams(temperature=0.7, method="standard")


def exact_first_two(decoder: SpecDecoder, prompt: list[int]) -> dict[tuple[int, int], float]:
    """P(y1, y2) of plain sampling from the target, every first token enumerated."""
    runtime = decoder.engine.target
    runtime.rollback(0)
    p1 = logits_to_probs(runtime.extend(prompt, 1)[0].double(), CHI_SAMPLING)
    joint = {}
    for y1 in torch.nonzero(p1 > 0).flatten().tolist():
        p2 = logits_to_probs(runtime.extend([y1], 1)[0].double(), CHI_SAMPLING)
        runtime.rollback(len(prompt))
        for y2 in torch.nonzero(p2 > 0).flatten().tolist():
            joint[(y1, y2)] = float(p1[y1] * p2[y2])
    runtime.rollback(0)
    return joint


def standard_samples(paths: dict[str, str], method: str, seeds: range) -> tuple[list[tuple[int, ...]], int]:
    """The first two tokens of a seeded run for each seed, and the draft tokens accepted in all (a spawned worker
    loads its own decoder, on one thread)."""
    decoder = SpecDecoder.load(paths["spm"], draft_model=paths["sub"], backend="fused", cross_vocabulary=method,
                               threads=1)
    prompt = decoder.encode("to be", chat=False)
    samples, accepted = [], 0
    for seed in seeds:
        result = decoder.engine.generate(prompt, GenerationConfig(max_new_tokens=2, num_draft_tokens=3,
                                                                  sampling=CHI_SAMPLING, seed=seed, stop_at_eos=False))
        samples.append(tuple(result.token_ids))
        accepted += result.stats.accepted_tokens
    return samples, accepted


@pytest.mark.slow  # over 10 s a method on 2 cores
@pytest.mark.parametrize("method", ["text", "intersection"])  # auto samples by text
def test_standard_sampling_across_vocabularies_draws_the_targets_distribution(paths, method):
    """--sampling standard with a draft model of another vocabulary (k = 3; text proposes point masses, intersection
    a proper q over the shared tokens; auto proposes by text when sampling): the first two tokens of
    8,000 seeded runs (two processes, half the seeds each) against their exact joint. Bins: every outcome expected
    at least 5 times, and one for the rest; one chi-square test per method at alpha = 0.001, so a correct engine
    fails each with probability 0.1% (the seeds are fixed: the outcome repeats; SAMPLES says what it detects)."""
    decoder = SpecDecoder.load(paths["spm"], draft_model=paths["sub"], backend="fused", cross_vocabulary=method)
    prompt = decoder.encode("to be", chat=False)  # the same pieces in both vocabularies: the draft's distribution
    exact = exact_first_two(decoder, prompt)  # over the shared tokens is the target's, so drafts are accepted
    bins = [outcome for outcome, p in exact.items() if p * SAMPLES >= 5]
    expected = np.array([exact[b] for b in bins] + [1 - sum(exact[b] for b in bins)]) * SAMPLES
    assert len(bins) > 150
    (first, accepted_first), (second, accepted_second) = in_two_processes(standard_samples, (paths, method), SAMPLES)
    samples, accepted = first + second, accepted_first + accepted_second
    counts = Counter(samples)
    observed = np.array([counts.get(b, 0) for b in bins] + [SAMPLES - sum(counts.get(b, 0) for b in bins)])
    assert chisquare(observed, expected).pvalue > 1e-3
    assert accepted > 0.02 * SAMPLES  # drafts were accepted as well as rejected: both outcomes are under test


@pytest.mark.slow  # about 45 s on 2 cores
def test_a_server_drafting_across_vocabularies_passes_the_audit(paths, tmp_path):
    """``exactspec serve --drafter draft-model --draft-model`` another vocabulary's model: each request drafts in a
    pool slot of its own. ``exactspec audit`` against the exact distribution (the first two tokens, 800 samples, the
    standard rule, alpha = 0.001: a correct server fails it with probability 0.1%) passes, greedy output is
    identical, and drafts were accepted. The invariant sampler's draws do not depend on the drafts (a seeded
    request's tokens are plain decoding's: test_greedy_and_seeded_output_is_plain_decodings_across_vocabularies,
    and the server runs the library's round), so its audit here would add no power. On the lean runtime, whose
    float32 rows are the reference's: the fused runtime's weights are its own int8 and float16, which an audit
    against float32 rightly tells apart whether it drafts or not."""
    import json

    from exactspec.cli import main
    from exactspec.server.batching import BatchSettings
    from exactspec.server.serving import ServerOptions, load_server
    from exactspec.server.settings import ServerSettings

    options = ServerOptions(model=paths["spm"], backend="lean", draft_model=paths["sub"],
                            settings=ServerSettings(port=0),
                            batch=BatchSettings(drafter="draft-model", speculation="always", max_batch_size=8,
                                                max_model_len=256))
    server = load_server(options)
    server.start()
    try:
        for extra in (["--temperature", "0"], ["--tokens", "2", "--sampling", "standard"]):
            out = tmp_path / f"{len(extra)}{extra[-1]}.json"
            code = main(["audit", "--a", server.url, "--reference", "local", "--reference-model", paths["spm"],
                         "--prompt", "the prime", "--samples", "800", "--no-progress", "--out", str(out), *extra])
            assert code == 0, (extra, json.loads(out.read_text()))
        assert server.scheduler.metrics.accepted_tokens > 0
    finally:
        server.shutdown(timeout=5)
