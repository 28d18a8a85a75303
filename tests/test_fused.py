"""exactspec's fused CPU runtime (the C kernels in fused/ through fused/runtime.py): the lean runtime's figures, each
row as it is alone, and speculation on it gives plain decoding's tokens with every drafter."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from test_batch_runtime import logits_beside_others
from tiny import float32_error, perturbed_copy, save_with_tokenizer, tiny_llama

from exactspec.backends import LeanRuntime
from exactspec.backends.fused import FusedRuntime, quantized8, unavailable
from exactspec.backends.linear import PassPrecisions
from exactspec.backends.native import repacked
from exactspec.drafters.networks import DrafterConfig, EagleHead, ExitAdapter, LayerShape, MTPHeads, TargetParts
from exactspec.engine import Engine, GenerationConfig
from exactspec.proposers import DraftModelProposer, NoProposer, PromptLookupProposer, RetrievalProposer
from exactspec.proposers.eagle import EagleProposer
from exactspec.proposers.early_exit import EarlyExitProposer
from exactspec.proposers.mtp import MTPProposer
from exactspec.sampling import SamplingParams

PROMPTS = [[5, 9, 12, 9, 12, 40], [3, 3, 3, 3], [60, 2, 17, 33, 8, 17, 33, 21, 9], [7]]


def test_the_extension_was_built_and_runs_here():
    """CI's machines have a C compiler and AVX2: a build that failed there must fail the suite, not skip it."""
    assert unavailable() is None


def test_a_library_whose_structures_differ_from_exactspecs_declarations_is_refused(monkeypatch):
    """The C kernels report its structures' sizes; a library built from other sources (ctypes declarations copied by
    hand, gone stale) is named, structure by structure, instead of reading memory it does not hold."""
    from exactspec.backends import native

    library = native.library()
    assert native._differing_structs(library) == []
    rows = native.STRUCT_SIZES["Rows"]
    monkeypatch.setitem(native.STRUCT_SIZES, "Rows", rows + 8)
    assert native._differing_structs(library) == [f"Rows {rows}/{rows + 8}"]


def on_a_q4_1_grid(weight: torch.Tensor) -> torch.Tensor:
    """A matrix's values moved to the 16 levels of a Q4_1 block per 32 inputs (scale and minimum in float16), as a
    de-quantised GGUF holds them."""
    if weight.dim() != 2 or weight.shape[1] % 32:
        return weight
    blocks = weight.view(weight.shape[0], -1, 32)
    low, high = blocks.amin(-1, keepdim=True).half().float(), blocks.amax(-1, keepdim=True)
    step = ((high - low) / 15).half().float().clamp_min(1e-4)
    return ((blocks - low) / step).round().clamp(0, 15).mul(step).add(low).view_as(weight)


def copy_with(model, change):
    copy = tiny_llama(seed=0, init_range=0.5)
    copy.load_state_dict({name: change(value) for name, value in model.state_dict().items()})
    return copy


@pytest.fixture(scope="module", params=["float16", "int8"])
def weights(request):
    return request.param


@pytest.fixture(scope="module")
def model(weights):
    """For float16, a random model (its weights are not on any grid: auto holds them in float16); for int8, the same
    model moved to a Q4_1 grid, as the default model's are (auto holds them in int8, exactly)."""
    random = tiny_llama(seed=0, init_range=0.5)
    return random if weights == "float16" else copy_with(random, on_a_q4_1_grid)


def exact_reference(model, weights):
    """The model as the fused runtime multiplies by it: its weights rounded to float16, or (on the grid) as they are."""
    return copy_with(model, lambda value: value.half().float()) if weights == "float16" else model


def test_auto_holds_grid_weights_in_int8_and_others_in_float16(model, weights):
    assert FusedRuntime(model).weights == weights


def test_logits_are_the_lean_runtimes_over_the_same_weights(model, weights):
    """With float products, against the lean runtime in float32 over the weights as the fused runtime holds them
    (float16-rounded, or on their grid), only the order of float32 sums differs: two float32 evaluations, within 4x
    transformers' own float32 error of each other (tiny.float32_error, over the prefill) in a prefill, steps, a chain
    of several positions after a rollback, a tree, and past a block of 256 cached keys."""
    reference = exact_reference(model, weights)
    sequence = list(range(3, 63)) * 5
    outputs = []
    for runtime in (FusedRuntime(reference, weights, products="float"), LeanRuntime(reference, "float32")):
        logits = [runtime.extend(sequence[:250], 250)]
        logits += [runtime.extend([token], 1) for token in sequence[250:260]]
        runtime.rollback(252)
        logits.append(runtime.extend([7, 8, 9], 3))
        logits.append(runtime.extend_tree([1, 2, 3, 4], [0, 0, 1, 1]))
        outputs.append(torch.cat(logits))
    assert outputs[0].abs().max() > 1
    assert (outputs[0] - outputs[1]).abs().max() <= 4 * float32_error(reference, sequence[:260])


def test_a_rows_logits_are_the_same_bit_for_bit_alone_in_a_pass_in_a_tree_and_beside_other_sequences(model, weights):
    runtime = FusedRuntime(model, weights)
    sequence = list(range(3, 63)) * 5  # past the first 256 keys
    runtime.extend(sequence[:250], 0)
    alone = torch.cat([runtime.extend([token], 1) for token in sequence[250:260]])  # [10, vocab]
    for width in (2, 5, 10):  # passes of several positions
        runtime.rollback(250)
        together = torch.cat([runtime.extend(sequence[250 + i : 250 + i + width], width) for i in range(0, 10, width)])
        assert torch.equal(together, alone), width
    runtime.rollback(250)  # a tree whose first branch is the sequence: its nodes compute that chain's logits
    tree = runtime.extend_tree(sequence[250:253] + [9, 9], [0, 0, 1, 0, 3])
    assert torch.equal(tree[:3], alone[:3])
    assert torch.equal(logits_beside_others(runtime, sequence[:250], sequence[250:260]), alone)


def test_rollback_and_a_reused_prefix_compute_what_a_fresh_runtime_does(model, weights):
    runtime, fresh = FusedRuntime(model, weights), FusedRuntime(model, weights)
    runtime.extend([1, 2, 3, 4, 5], 0)
    runtime.extend([6, 7, 8], 3)
    runtime.rollback(6)
    assert torch.equal(runtime.extend([9, 10], 2), fresh.extend([1, 2, 3, 4, 5, 6, 9, 10], 8)[-2:])
    assert runtime.tokens == [1, 2, 3, 4, 5, 6, 9, 10]
    shallow = runtime.extend_shallow([11, 12], 1)  # self-speculation's first layers, then the rest
    assert torch.equal(shallow, fresh.layer_states([11, 12])[1])
    fresh.rollback(8)
    assert torch.equal(runtime.extend([11, 12], 2), fresh.extend([11, 12], 2))


@pytest.mark.parametrize("kind", ["fused", "lean"])
def test_an_engine_keeps_a_cached_prefix_only_where_its_bits_are_a_prefills(kind):
    """A request after another on one engine keeps what the cache holds only where a prefill of the new prompt
    alone writes the same bits. The next token's logits after each prompt equal a fresh runtime's, bit for bit: a
    chat's next turn (whose last answer's positions rounds wrote), a short prompt after a long one, the same prompt
    again. ``sync`` keeps the longest shared prefix whatever wrote it (the control): on the lean runtime, where a
    prompt's pass and a round's give a position other bits (a bulk precision of its own), it parts from a fresh
    prefill somewhere; on the fused runtime, whose prompts run the C kernels' pass as rounds do, it never does."""
    from exactspec.backends.base import prefill, sync

    model = tiny_llama(seed=0, init_range=0.5)

    def runtime():
        if kind == "fused":
            return FusedRuntime(model, "float16")
        return LeanRuntime(model, PassPrecisions(decode="float16", score="float16", bulk="float32"))

    used, fresh = runtime(), runtime()
    first = [(7 * i) % 60 + 2 for i in range(used.prompt_positions + 14)]  # long enough to run as a prompt
    answer = Engine(used, NoProposer()).generate(first, GenerationConfig(max_new_tokens=6)).token_ids
    turn = first + answer + [5, 6, 7]
    differed = 0
    for prompt in (turn, first[:20], first, turn):
        for keep in (prefill, sync):
            if keep is sync:  # the control: the earlier request's positions, kept whatever wrote them
                used.rollback(0)
                Engine(used, NoProposer()).generate(first, GenerationConfig(max_new_tokens=6))
            keep(used, prompt[:-1], *([0] if keep is sync else []))
            fresh.rollback(0)
            fresh.extend(prompt[:-1], 0)
            same = torch.equal(used.extend(prompt[-1:], 1), fresh.extend(prompt[-1:], 1))
            assert same or keep is sync, (len(prompt), used.prefilled)
            differed += not same
    # lean: sync's reuse did part from a fresh prefill somewhere (the check above can fail); fused: it never does
    assert differed if kind == "lean" else not differed


def test_int8_keeps_grid_weights_exactly_and_says_when_it_cannot():
    """A Q4_1 block (16 levels), a Q8_0 block (a symmetric grid of 255) and a constant block are kept to float
    rounding; random values are not, and are said not to be."""
    q4_1 = torch.randint(0, 16, (8, 32)).float() * 0.0123 - 0.07
    q8_0 = torch.randint(-127, 128, (8, 32)).float() * 0.004
    grid = torch.cat([q4_1, q8_0, torch.full((8, 32), 0.25)], dim=1)
    packed, exact = quantized8(grid)
    assert exact and packed.numel() == 3 * 320
    blocks = packed.view(3, 320)  # one block of 8 rows, three groups of 32 inputs
    q = blocks[:, :256].view(3, 8, 8, 4).permute(2, 0, 1, 3).reshape(8, 96).float()  # [row, input]: quads
    scale = blocks[:, 256:288].contiguous().view(torch.float32).T.repeat_interleave(32, dim=1)  # [row, input]
    offset = blocks[:, 288:].contiguous().view(torch.float32).T.repeat_interleave(32, dim=1)
    torch.testing.assert_close(q * scale + offset, grid, rtol=0, atol=1e-6)
    assert not quantized8(torch.randn(8, 32))[1]


def test_weights_repack_into_blocks_of_eight_rows_read_as_one_stream():
    weight = torch.arange(10 * 16, dtype=torch.float32).view(10, 16)  # 10 rows: the second block is padded
    packed = repacked(weight).view(2, 2, 8, 8)  # [block, chunk of 8 inputs, row in block, input in chunk]
    assert torch.equal(packed[0, 1, 3], weight[3, 8:16].half())
    assert torch.equal(packed[1, 0, 1], weight[9, :8].half())
    assert not packed[1, :, 2:].any()


def untrained(method: str, model, **fields):
    parts = TargetParts.of(model)
    config = DrafterConfig(method=method, shape=LayerShape.of(model.config), vocab_size=64, **fields)
    torch.manual_seed(0)
    return {"mtp": MTPHeads, "eagle": EagleHead, "early-exit": ExitAdapter}[method](config, parts).eval()


@pytest.mark.parametrize("k", [1, 3, 8, "auto"])
def test_greedy_speculation_on_it_is_its_plain_greedy_with_every_drafter(model, weights, k):
    target = FusedRuntime(model, weights)
    draft = perturbed_copy(model, noise=0.03, seed=1)
    engines = {
        "prompt-lookup": Engine(target, PromptLookupProposer()),
        "retrieval": Engine(target, RetrievalProposer(min_order=1)),
        "draft-model": Engine(target, DraftModelProposer(LeanRuntime(draft), target.vocab_size)),
        "mtp": Engine(target, MTPProposer(untrained("mtp", model, heads=3))),
        "eagle": Engine(target, EagleProposer(untrained("eagle", model))),
        "early-exit": Engine(target, EarlyExitProposer(untrained("early-exit", model, exit_layer=1), target)),
    }
    config = GenerationConfig(max_new_tokens=24, num_draft_tokens=k, stop_at_eos=False)
    accepted = 0
    for prompt in PROMPTS:
        expected = Engine(target, NoProposer()).generate(prompt, config).token_ids
        for name, engine in engines.items():
            result = engine.generate(prompt, config)
            assert result.token_ids == expected, (name, prompt)
            accepted += result.stats.accepted_tokens
        tree = Engine(target, PromptLookupProposer()).generate(prompt, replace(config, tree=(3, 2, 1)))
        assert tree.token_ids == expected
    assert accepted > 0


def test_seeded_speculation_on_it_samples_its_plain_sampling_tokens(model, weights):
    target = FusedRuntime(model, weights)
    draft = perturbed_copy(model, noise=0.03, seed=1)
    plain = Engine(target, NoProposer())
    engines = [Engine(target, PromptLookupProposer()),
               Engine(target, DraftModelProposer(LeanRuntime(draft), target.vocab_size))]
    for seed, prompt in enumerate(PROMPTS):
        config = GenerationConfig(max_new_tokens=24, sampling=SamplingParams(temperature=0.7, top_p=0.95), seed=seed,
                                  num_draft_tokens=3, stop_at_eos=False)
        expected = plain.generate(prompt, config).token_ids
        for engine in engines:
            assert engine.generate(prompt, config).token_ids == expected


def test_a_model_it_does_not_cover_is_named_with_the_reason():
    odd = tiny_llama(seed=0, hidden=48)  # heads of 12: not a multiple of 8
    assert "multiples of 8" in unavailable(odd)
    with pytest.raises(RuntimeError, match="multiples of 8"):
        FusedRuntime(odd)


def test_the_server_batches_on_it_and_each_answer_is_its_plain_decoding(tmp_path):
    """Continuous batching on the fused runtime: 12 greedy requests, 6 at a time, speculating with prompt lookup
    beside one another's rows; each answer is that prompt's plain decoding alone on the same runtime."""
    from concurrent.futures import ThreadPoolExecutor

    from test_server import EOS, ids_of, post, prompt_text, visible
    from transformers import AutoTokenizer

    from exactspec.server import BatchSettings, build_scheduler
    from exactspec.server.app import OpenAIServer, ServerSettings

    model = tiny_llama(seed=0, init_range=0.5)
    tokenizer = AutoTokenizer.from_pretrained(save_with_tokenizer(model, tmp_path / "tiny"))
    settings = BatchSettings(max_batch_size=6, max_model_len=256, drafter="prompt-lookup", speculation="always")
    server = OpenAIServer(build_scheduler(FusedRuntime(model), settings, {EOS}), tokenizer, "tiny",
                          ServerSettings(port=0))
    server.start()
    prompts = [PROMPTS[i % len(PROMPTS)] + [10 + i] for i in range(12)]
    try:
        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(lambda ids: post(server, "/v1/completions", {
                "prompt": prompt_text(ids), "max_tokens": 16, "temperature": 0, "ignore_eos": True}), prompts))
    finally:
        server.shutdown(timeout=5)
    alone = Engine(FusedRuntime(model), NoProposer(), eos_token_ids={EOS})
    for ids, (status, body) in zip(prompts, answers):
        assert status == 200, body
        expected = alone.generate(ids, GenerationConfig(max_new_tokens=16, stop_at_eos=False)).token_ids
        assert ids_of(body["choices"][0]["text"]) == visible(expected), ids


def test_a_prompt_gives_each_position_plain_decodings_bits_and_what_follows_reads_its_cache(model, weights):
    """A chain longer than any round (a prompt) runs through the C kernels too, PASS_ROWS rows a pass (its products in
    the GEMM tiles where the CPU has them): each position's logits are those plain decoding computes one position a
    pass, bit for bit, and the positions after it read the cache it wrote, in a pass of one or of several alike."""
    from exactspec.backends.fused import PROMPT_POSITIONS
    from exactspec.backends.fused.runtime import PASS_ROWS
    from exactspec.choices import MAX_DRAFT_TOKENS

    assert PROMPT_POSITIONS > MAX_DRAFT_TOKENS + 1
    prompt = [(7 * i) % 60 + 3 for i in range(max(PROMPT_POSITIONS, 2 * PASS_ROWS + 5))]  # several chunks
    fused, stepped = FusedRuntime(model, weights), FusedRuntime(model, weights)
    assert torch.equal(fused.extend(prompt, len(prompt)), torch.cat([stepped.extend([token], 1) for token in prompt]))
    steps = torch.cat([fused.extend([token], 1) for token in (4, 5, 6)])
    fused.rollback(len(prompt))
    assert torch.equal(fused.extend([4, 5, 6], 3), steps)


def test_a_decoding_step_gives_the_same_bits_on_any_number_of_the_teams_threads(model, weights):
    """The team's size follows the passes' times (native.TeamSize: one thread where another process keeps a core
    busy): a step's logits are the same bits on one thread as on all of them, in prefill and steps."""
    runtimes = [FusedRuntime(model, weights) for _ in range(2)]
    if runtimes[1].team.most < 2:
        pytest.skip("one core: a team of one thread only")
    for runtime, size in zip(runtimes, (1, runtimes[1].team.most)):  # every step on one thread, on all of them
        runtime.team.choose = lambda size=size: size
    sequence = list(range(3, 40))
    outputs = [torch.cat([runtime.extend(sequence[:20], 20)] + [runtime.extend([token], 1) for token in sequence[20:]])
               for runtime in runtimes]
    assert torch.equal(outputs[0], outputs[1])
