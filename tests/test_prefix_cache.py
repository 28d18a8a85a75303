"""The server's prefix cache (issue 36): finished requests' prompts' keys and values, restored for later prompts
that open with the same tokens, change no token: each answer is its prompt's plain decoding alone, greedy and
seeded, on both runtimes whose rows are computed as they are alone."""

from __future__ import annotations

import random

import pytest
import torch
from tiny import save_with_tokenizer, tiny_llama

from exactspec.backends import LeanRuntime
from exactspec.backends.fused import FusedRuntime
from exactspec.engine import Engine, GenerationConfig
from exactspec.errors import UsageError
from exactspec.proposers import NoProposer
from exactspec.sampling import SamplingParams
from exactspec.server import BatchSettings, build_scheduler
from exactspec.server.prefixes import MIN_REUSED, PrefixCache, prefix_cache
from exactspec.server.scheduler import GenerationRequest

EOS = 1
RUNTIMES = {"fused": FusedRuntime, "lean": LeanRuntime}


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0, init_range=0.5)


def words(seed: int, count: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 64) for _ in range(count)]


def workload() -> list[list[int]]:
    """One instruction (60 tokens) over inputs of 70 to 110 tokens, the first input asked again, and one prompt
    that opens like another but parts from it halfway."""
    instruction = words(0, 60)
    inputs = [instruction + words(1 + i, 70 + 10 * i) for i in range(5)]
    parting = inputs[2][:90] + words(99, 80)
    return inputs + [inputs[0], parting]


def served(runtime, prompts: list[list[int]], sampling: SamplingParams, seed: int | None,
           mib: int = 64) -> tuple[list[list[int]], list[int], object]:
    """The first prompt alone, then the rest three at a time: each answer and its restored prompt tokens."""
    settings = BatchSettings(drafter="prompt-lookup", speculation="always", max_batch_size=3, max_model_len=256,
                             prefix_cache_mib=mib)
    scheduler = build_scheduler(runtime, settings, {EOS})
    scheduler.start()
    answers, cached = [], []
    try:
        for start, end in ((0, 1), (1, 4), (4, len(prompts))):
            handles = [scheduler.submit(GenerationRequest(ids, max_tokens=16, sampling=sampling, seed=seed,
                                                          stop_at_eos=False)) for ids in prompts[start:end]]
            answers += [handle.collect(timeout=120)[0] for handle in handles]
            cached += [handle.cached_tokens for handle in handles]
    finally:
        scheduler.shutdown(timeout=5)
    return answers, cached, scheduler


@pytest.mark.parametrize("runtime", list(RUNTIMES))
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_restored_prompts_change_no_token(model, runtime, temperature):
    """Each answer equals its prompt's plain decoding alone on an empty cache, while most prompts restored a
    prefix a finished one kept: the instruction, a re-asked prompt whole, and the half of a prompt another opens
    with."""
    make = RUNTIMES[runtime]
    prompts = workload()
    sampling = SamplingParams(temperature=temperature)
    answers, cached, scheduler = served(make(model), prompts, sampling, seed=5)
    assert cached[0] == 0 and all(n >= MIN_REUSED for n in cached[1:]), cached
    assert cached[5] == len(prompts[5]) - 1  # re-asked: all but the last token, which the first step scores
    assert scheduler.metrics.cached_prompt_tokens == sum(cached)
    plain = Engine(make(model), NoProposer(), eos_token_ids={EOS})
    for prompt, answer in zip(prompts, answers):
        plain.clear_cache()
        config = GenerationConfig(max_new_tokens=16, stop_at_eos=False, sampling=sampling, seed=5)
        assert answer == plain.generate(prompt, config).token_ids


def test_off_it_restores_nothing(model):
    answers, cached, scheduler = served(LeanRuntime(model), workload(), SamplingParams(), None, mib=0)
    assert scheduler.prefixes is None and not any(cached) and scheduler.metrics.cached_prompt_tokens == 0


def test_a_negative_size_is_refused():
    with pytest.raises(UsageError, match="prefix-cache-mib must be >= 0"):
        BatchSettings(prefix_cache_mib=-1)


def test_a_pool_whose_rows_depend_on_the_pass_keeps_no_prefix(model):
    """Where a row's bits depend on the rows beside it, a restored prefix could change a token: no cache."""
    runtime = LeanRuntime(model, "float64")  # the libraries' kernels, not exactspec's row kernels
    assert not runtime.pass_invariant
    assert prefix_cache(runtime.pool(2, 256), 1) is None
    assert prefix_cache(LeanRuntime(model).pool(2, 256), 1) is not None


def test_the_cache_is_sized_in_tokens_too_and_warns_where_it_holds_no_whole_prompt(model, caplog):
    """``--prefix-cache-mib 8`` on the default model at float32 held no 330-token prompt, and nothing said so: the
    tokens a size holds are said at start (a token's bytes: what a copy of one position takes), with a warning where
    that is under one prompt of the context's length, naming the size that would be; ``--prefix-cache-tokens``
    sizes it in tokens."""
    pool = LeanRuntime(model).pool(2, 256)
    slot = filled(pool, words(10, 41))
    copied = pool.copy_out(slot, 40)
    assert pool.position_bytes * 40 == copied.numel() * copied.element_size()
    with caplog.at_level("WARNING", logger="exactspec.notice"):
        assert prefix_cache(pool, 0, 1000, context=256).capacity_bytes == 1000 * pool.position_bytes
        assert not caplog.records
        small = prefix_cache(pool, 0, 100, context=256)
    assert small.capacity_bytes == 100 * pool.position_bytes
    assert [r.getMessage() for r in caplog.records] == [
        f"the prefix cache holds 100 tokens of prompts ({100 * pool.position_bytes / 2**20:.0f} MiB, "
        f"{pool.position_bytes} bytes a token): under one prompt of the context's 256 tokens, which needs "
        f"{-(-256 * pool.position_bytes // 2**20)} MiB (--prefix-cache-mib) or --prefix-cache-tokens 256"]
    with pytest.raises(UsageError, match="prefix-cache-tokens must be >= 0"):
        BatchSettings(prefix_cache_tokens=-1)


def test_a_size_beyond_the_machines_memory_is_refused_in_one_line_naming_the_largest_that_fits(model):
    """``--prefix-cache-tokens 1000000000000`` started, and said the cache held 43,945,312,500 MiB. The largest size
    the machine's memory holds is taken, in tokens and in MiB, and one more is refused, naming it."""
    from exactspec.cores import usable_memory

    pool = LeanRuntime(model).pool(2, 256)
    per_token, memory = pool.position_bytes, usable_memory()
    largest = memory // per_token
    assert prefix_cache(pool, 0, largest).capacity_bytes == largest * per_token
    for tokens in (largest + 1, 10 ** 12):
        with pytest.raises(UsageError) as refused:
            prefix_cache(pool, 0, tokens)
        message = str(refused.value)
        assert f"a prefix cache of {tokens:,} tokens ({per_token} bytes a token) needs" in message, message
        assert f"which this machine cannot reserve: lower --prefix-cache-tokens to {largest} or less" in message
        assert "\n" not in message
    assert prefix_cache(pool, memory >> 20).capacity_bytes == (memory >> 20) << 20
    with pytest.raises(UsageError, match=f"lower --prefix-cache-mib to {memory >> 20} or less"):
        prefix_cache(pool, (memory >> 20) + 1)


def filled(pool, prompt: list[int]):
    """A slot holding the prompt's cached positions (all but its last token)."""
    slot = pool.open()
    pool.forward([_row(slot, prompt[:-1])])
    return slot


def _row(slot, tokens):
    from exactspec.backends.base import Row

    return Row(slot, tokens, 0)


def test_what_is_kept_is_bounded_superseded_and_restored_bit_for_bit(model):
    """A prompt that holds a kept one and more replaces it; one that a kept one holds adds nothing; past its
    bytes the least recently used is forgotten; a restored slot holds the bits the kept one did."""
    pool = LeanRuntime(model).pool(2, 256)
    prompts = [words(10, 100), words(11, 100)]
    first = filled(pool, prompts[0])
    size = pool.copy_out(first, 99).numel() * 4  # float32
    cache = PrefixCache(pool, capacity_bytes=2 * size + size // 2)
    cache.keep(first, prompts[0][:60])
    cache.keep(first, prompts[0])  # holds the first and more: replaces it
    cache.keep(first, prompts[0][:80])  # held already
    assert cache.bytes == size and len(cache._kept) == 1
    kept = pool.copy_out(first, 99)
    pool.close(first)
    second = filled(pool, prompts[1])
    cache.keep(second, prompts[1])
    pool.close(second)
    assert cache.bytes == 2 * size
    slot = pool.open()
    assert cache.restore(slot, prompts[0] + [5]) == 99 == slot.length  # what it shares
    assert torch.equal(pool.copy_out(slot, slot.length), kept[:, :, : slot.length])
    pool.close(slot)
    third = filled(pool, words(12, 100))
    cache.keep(third, words(12, 100))  # over the bytes: the least recently used (the second) goes
    pool.close(third)
    assert cache.bytes == 2 * size
    assert cache.restore(pool.open(), prompts[1] + [5]) == 0


@pytest.mark.slow
def test_the_server_reports_the_cached_tokens_and_answers_alike(model, tmp_path):
    """Through HTTP: the same prompt twice gives the same text, the second with OpenAI's
    ``usage.prompt_tokens_details.cached_tokens`` counting what it restored, and /metrics the total."""
    from test_server import post, prompt_text
    from transformers import AutoTokenizer

    from exactspec.server.app import OpenAIServer, ServerSettings

    tokenizer = AutoTokenizer.from_pretrained(save_with_tokenizer(model, tmp_path / "tiny"))
    settings = BatchSettings(max_batch_size=2, max_model_len=256, drafter="prompt-lookup")
    server = OpenAIServer(build_scheduler(FusedRuntime(model), settings, {EOS}), tokenizer, "tiny",
                          ServerSettings(port=0))
    server.start()
    try:
        body = {"prompt": prompt_text(words(3, 120)), "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        first, second = post(server, "/v1/completions", body), post(server, "/v1/completions", body)
        metrics = server.scheduler.metrics.cached_prompt_tokens
    finally:
        server.shutdown(timeout=5)
    assert first[0] == second[0] == 200
    assert first[1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = second[1]["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0 and metrics == cached
    assert first[1]["choices"][0]["text"] == second[1]["choices"][0]["text"]


@pytest.mark.parametrize("runtime", list(RUNTIMES))
@pytest.mark.parametrize("rest", [1, 5, 80])
def test_a_prompt_prefilled_after_a_restored_prefix_scores_as_one_prefilled_whole(model, runtime, rest):
    """The logits after a prompt prefilled in one pass equal, bit for bit, those after its first tokens restored
    from another slot's copy and the rest prefilled as the whole prompt's prefill would run: what makes a restored
    prefix exact. On the fused runtime a prompt's rows run the C kernels' pass as a round's do, so a slot whose rest of
    five ran as a round holds those bits too."""
    from exactspec.backends.base import Row

    pool = RUNTIMES[runtime](model).pool(3, 256)
    prompt = words(7, 160)
    whole = filled(pool, prompt)
    expected = pool.forward([Row(whole, prompt[-1:], 1)])[0]
    restored = len(prompt) - 1 - rest
    kept = pool.copy_out(whole, restored)
    slots = [pool.open(), pool.open()]
    for slot in slots:
        pool.copy_in(slot, kept, restored)
    pool.forward([Row(slots[0], prompt[restored:-1], 0, restored)])
    assert torch.equal(pool.forward([Row(slots[0], prompt[-1:], 1)])[0], expected)
    if runtime == "fused" and rest == 5:  # a row of several, run as a round
        pool.forward([Row(slots[1], prompt[restored:-1], 0)])
        assert torch.equal(pool.forward([Row(slots[1], prompt[-1:], 1)])[0], expected)


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_entries_are_kept_in_the_caches_own_precision(model, precision):
    """A kept prompt holds its positions in the precision the runtime caches keys and values in (its activations':
    float32 on a CPU, whatever the weights' precision), bits unchanged, each position's size as ``position_bytes``
    says: no copy wider than the cache, and none narrower, which would not restore the bits a prefill writes."""
    runtime = LeanRuntime(model, precision)
    pool = runtime.pool(1, 256)
    prompt = words(20, 80)
    slot = filled(pool, prompt)
    cache = PrefixCache(pool, capacity_bytes=1 << 30)
    cache.keep(slot, prompt)
    (_, kept), = cache._kept.values()
    assert kept.dtype == runtime.dtype == pool._keys[0].dtype
    assert cache.bytes == (len(prompt) - 1) * pool.position_bytes == kept.numel() * kept.element_size()
    assert torch.equal(kept, pool.copy_out(slot, len(prompt) - 1))
