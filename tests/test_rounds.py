"""One round for the library and the server (exactspec/rounds.py): a request gives the same tokens, log-probabilities
and finish through the library's engine and through the server's scheduler, with a drafter, logit bias, penalties
and stop strings; and the Python API takes ``stop`` and ``logprobs`` as the server does. On the tiny random model of
test_server.py, in float32 (where the runtime computes each row as it is alone: the same bits in any pass)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from test_server import EOS, prompt_text, tiny  # noqa: F401
from tiny import require_pass_invariant

from exactspec import SpecDecoder
from exactspec.backends import LeanRuntime
from exactspec.engine import Engine, GenerationConfig
from exactspec.models import load_model
from exactspec.proposers import make_proposer
from exactspec.sampling import LogitsAdjustment, SamplingParams
from exactspec.server import BatchSettings, build_scheduler
from exactspec.server.scheduler import GenerationRequest
from exactspec.stops import StopText

PROMPT = [5, 9, 12, 9, 12, 40, 5, 9, 12, 9]
ADJUSTMENT = LogitsAdjustment(bias={9: 1.5, 12: -0.5}, presence_penalty=0.4, frequency_penalty=0.3)


def library_run(model, tokenizer, sampling: SamplingParams, seed: int, stop: tuple[str, ...], max_new_tokens: int):
    """The request through the library's engine, drafting 4 tokens a round with prompt lookup."""
    runtime = LeanRuntime(model)
    engine = Engine(runtime, make_proposer("prompt-lookup", runtime), eos_token_ids={EOS})
    config = GenerationConfig(max_new_tokens=max_new_tokens, num_draft_tokens=4, sampling=sampling, seed=seed,
                              stop_at_eos=False, logprobs=3, adjustment=ADJUSTMENT)
    return engine.generate(PROMPT, config, stop=StopText(tokenizer, stop) if stop else None)


def served_runs(model, tokenizer, sampling: SamplingParams, seeds: list[int], stop: tuple[str, ...],
                max_new_tokens: int) -> list[tuple[list[int], list, str, int]]:
    """The same requests, all at once, through the server's scheduler: per request its tokens, log-probabilities,
    finish reason and the draft tokens scored for it."""
    scheduler = build_scheduler(LeanRuntime(model), BatchSettings(drafter="prompt-lookup", speculation="always",
                                                                  max_batch_size=8, max_model_len=128), {EOS})
    scheduler.start()
    try:
        handles = [scheduler.submit(GenerationRequest(
            prompt_ids=PROMPT, max_tokens=max_new_tokens, sampling=sampling, seed=seed, stop_at_eos=False,
            adjustment=ADJUSTMENT, logprobs=3, stop=(lambda: StopText(tokenizer, stop)) if stop else None))
            for seed in seeds]
        runs = []
        for handle in handles:
            tokens, logprobs, drafted = [], [], 0
            while not hasattr(event := handle.events.get(timeout=60), "reason"):
                tokens += event.token_ids
                logprobs += event.logprobs
                drafted += event.draft_tokens
            runs.append((tokens, logprobs, event.reason, drafted))
        return runs
    finally:
        scheduler.shutdown(timeout=5)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_library_and_the_server_run_one_round(tiny, temperature):  # noqa: F811
    """Seeded requests with bias, penalties, logprobs and a stop string (the text of a token the plain answer
    holds), alone in the library and together in a batch: the same tokens, the same log-probabilities bit for
    bit, the same finish. Those that meet the stop string end at it ("stop"), the others at the limit."""
    model, tokenizer = copy.deepcopy(tiny[0]).float(), tiny[1]
    require_pass_invariant(LeanRuntime(model))
    sampling = SamplingParams(temperature=temperature)
    seeds = [0, 1, 2, 3]
    plain = [library_run(model, tokenizer, sampling, seed, (), 16) for seed in seeds]
    stop = (tokenizer.decode([plain[0].token_ids[5]]).strip(),)  # met by the first request, perhaps by others
    library = [library_run(model, tokenizer, sampling, seed, stop, 16) for seed in seeds]
    served = served_runs(model, tokenizer, sampling, seeds, stop, 16)
    assert sum(drafted for *_, drafted in served) > 0  # the server speculated
    assert library[0].finish_reason == "stop" and len(library[0].token_ids) <= 6
    for alone, plain_run, (tokens, logprobs, reason, _) in zip(library, plain, served):
        assert tokens == alone.token_ids == plain_run.token_ids[: len(tokens)]
        assert logprobs == alone.logprobs == plain_run.logprobs[: len(tokens)]
        met = stop[0] in tokenizer.decode(tokens)
        assert reason == alone.finish_reason == ("stop" if met else "length")


def test_the_python_api_takes_stop_and_logprobs(tiny, tmp_path):  # noqa: F811
    """SpecDecoder.generate with ``stop`` cuts the text before the stop string and says why it finished; with
    ``logprobs`` each token's log-probability is the target's own (log-softmax of plain decoding's logits) and the
    top ones are the largest there."""
    from tiny import save_with_tokenizer

    model, tokenizer = tiny
    decoder = SpecDecoder(load_model(save_with_tokenizer(model, tmp_path / "tiny")), drafter="prompt-lookup")
    prompt = prompt_text(PROMPT)
    whole = decoder.generate(prompt, max_new_tokens=12, num_draft_tokens=4, chat=False, logprobs=2)
    assert whole.finish_reason in ("length", "stop") and len(whole.logprobs) == len(whole.token_ids)
    ids = decoder.encode(prompt, chat=False)
    runtime = decoder.engine.target  # plain decoding's logits, all in one pass here
    runtime.rollback(0)
    expected = torch.log_softmax(runtime.extend(ids + whole.token_ids[:-1], len(whole.token_ids)).double(), -1)
    for i, (token, (logprob, top)) in enumerate(zip(whole.token_ids, whole.logprobs)):
        assert math.isclose(logprob, float(expected[i, token]), abs_tol=1e-6)
        assert [t for t, _ in top] == expected[i].topk(2).indices.tolist()
    words = whole.text.split()
    cut = decoder.generate(prompt, max_new_tokens=12, num_draft_tokens=4, chat=False, stop=[words[2]])
    assert cut.finish_reason == "stop" and words[2] not in cut.text
    assert whole.text.startswith(cut.text) and len(cut.token_ids) < len(whole.token_ids)
    with pytest.raises(Exception, match="stop takes up to 4"):
        decoder.generate(prompt, max_new_tokens=4, stop=["a", "b", "c", "d", "e"])
    with pytest.raises(Exception, match="logprobs must be between 0 and 20"):
        decoder.generate(prompt, max_new_tokens=4, logprobs=21)


def untrained_source(drafter: str, model):
    """A drafter's network as ``exactspec train`` makes it, before training (random heads draft badly; the answer
    must not change)."""
    from exactspec.drafters.layers import LayerShape
    from exactspec.drafters.networks import DrafterConfig, EagleHead, ExitAdapter, MTPHeads, TargetParts

    torch.manual_seed(0)
    shape, parts = LayerShape.of(model.config), TargetParts.of(model)
    if drafter == "eagle":
        return EagleHead(DrafterConfig(method="eagle", shape=shape, vocab_size=64), parts)
    if drafter == "mtp":
        return MTPHeads(DrafterConfig(method="mtp", shape=shape, vocab_size=64, heads=3), parts)
    if drafter == "early-exit":
        return ExitAdapter(DrafterConfig(method="early-exit", shape=shape, vocab_size=64, exit_layer=1), parts)
    return None


@pytest.mark.parametrize("drafter, tree", [("eagle", None), ("mtp", None), ("early-exit", None), ("ngram", None),
                                           ("prompt-lookup", (2, 2)), ("eagle", "auto")])
def test_the_server_serves_every_drafter_and_trees(tiny, drafter, tree):  # noqa: F811
    """``serve --drafter eagle`` (mtp, early-exit, ngram) and ``--tree``: the server's scheduler as ``serve`` builds
    it: batched where the pool gives what the drafter reads (the target's features: eagle, mtp), over the runtime's
    own cache one request at a time where it reads the target's first layers (early-exit) or drafts trees; three
    greedy requests at once: each answer is plain decoding's, and drafts were scored."""
    from exactspec.backends.base import SequencePool

    model = copy.deepcopy(tiny[0]).float()
    runtime = require_pass_invariant(LeanRuntime(model))
    settings = BatchSettings(drafter=drafter, speculation="always", num_draft_tokens=3, max_batch_size=4,
                             max_model_len=128, tree=tree)
    scheduler = build_scheduler(runtime, settings, {EOS}, draft=untrained_source(drafter, model))
    assert isinstance(scheduler.pool, SequencePool) == (drafter == "early-exit" or tree is not None)
    prompts = [PROMPT, PROMPT[3:] + PROMPT, [7, 3, 7, 3, 7]]
    plain_runtime = LeanRuntime(model)
    plain = [Engine(plain_runtime, make_proposer("none", plain_runtime)).generate(
        prompt, GenerationConfig(max_new_tokens=12, num_draft_tokens=1, stop_at_eos=False)).token_ids
        for prompt in prompts]
    scheduler.start()
    try:
        handles = [scheduler.submit(GenerationRequest(prompt_ids=prompt, max_tokens=12, stop_at_eos=False))
                   for prompt in prompts]
        answers = [handle.collect() for handle in handles]
    finally:
        scheduler.shutdown(timeout=5)
    assert [tokens for tokens, _, _ in answers] == plain
    assert all(finished.reason == "length" for _, finished, _ in answers)
    assert sum(drafted for *_, drafted in answers) > 0


def test_a_tree_or_a_feature_drafter_on_a_runtime_that_cannot_is_refused_in_one_line(tiny):  # noqa: F811
    """llama.cpp's runtime scores no trees and hands out no hidden states: the server says so before serving."""
    from exactspec.backends.base import CausalLM
    from exactspec.errors import UsageError

    class Plain(CausalLM):  # a runtime that declares nothing beyond CausalLM
        vocab_size, max_length, device = 64, 128, torch.device("cpu")

    for settings, says in ((BatchSettings(drafter="prompt-lookup", tree="auto"), "--tree needs a TreeScorer"),
                           (BatchSettings(drafter="eagle"), "--drafter eagle needs a FeatureSource")):
        with pytest.raises(UsageError, match=says):
            build_scheduler(Plain(), settings, {EOS}, draft=untrained_source(settings.drafter, tiny[0]))


def test_a_pool_keeps_each_slots_features_as_the_runtime_keeps_its_own(tiny):  # noqa: F811
    """What eagle and mtp read when they batch: a slot's hidden states at its cached positions are the ones the
    runtime keeps for the same tokens alone, bit for bit, through rounds cut back to their accepted tokens and
    after another slot closes and this one moves into its place."""
    from exactspec.backends.base import Row

    model = copy.deepcopy(tiny[0]).float()
    alone = require_pass_invariant(LeanRuntime(model))
    alone.keep_hidden_states()
    pool = LeanRuntime(model).pool(3, 64)
    pool.keep_features()
    first, second = pool.open(), pool.open()
    pool.forward([Row(first, [3, 4, 5, 6], 1), Row(second, PROMPT, 1)])
    pool.forward([Row(first, [7, 8, 9], 3), Row(second, [11, 12], 2)])
    second.length -= 1  # a round's last draft token rejected
    pool.forward([Row(second, [13, 14, 15], 1)])
    pool.close(first)  # the second slot moves into the first's place
    alone.extend(PROMPT + [11, 13, 14, 15], 1)
    assert second.index == 0 and torch.equal(pool.features(second), alone.hidden_states)


@pytest.mark.parametrize("drafter", ["eagle", "early-exit"])
def test_serve_loads_a_trained_drafter_from_its_path(tiny, tmp_path, drafter):  # noqa: F811
    """What ``exactspec serve --drafter eagle --drafter-path DIR`` loads (``load_server``: the target, the drafter
    from its directory, the scheduler built for it): its greedy answers are plain decoding's."""
    from dataclasses import replace

    from tiny import save_with_tokenizer

    from exactspec.drafters import checkpoint
    from exactspec.models import weight_probe
    from exactspec.server.serving import ServerOptions, load_server

    model = copy.deepcopy(tiny[0]).float()
    path = save_with_tokenizer(model, tmp_path / "target")
    head = untrained_source(drafter, model)
    head.config = replace(head.config, target={"name": "tiny", "probe": weight_probe(model)})
    checkpoint.save(head, tmp_path / drafter)
    options = ServerOptions(model=str(path), backend="lean", dtype="float32", drafter_path=str(tmp_path / drafter),
                            batch=BatchSettings(drafter=drafter, speculation="always", max_batch_size=4,
                                                max_model_len=128))
    server = load_server(options, listen=False)
    server.start()
    try:
        handles = [server.scheduler.submit(GenerationRequest(prompt_ids=prompt, max_tokens=10, stop_at_eos=False))
                   for prompt in (PROMPT, PROMPT[2:])]
        answers = [handle.collect() for handle in handles]
    finally:
        server.shutdown(timeout=5)
    plain_runtime = LeanRuntime(model)
    for prompt, (tokens, finished, _) in zip((PROMPT, PROMPT[2:]), answers):
        plain = Engine(plain_runtime, make_proposer("none", plain_runtime)).generate(
            prompt, GenerationConfig(max_new_tokens=10, num_draft_tokens=1, stop_at_eos=False)).token_ids
        assert tokens == plain and finished.reason == "length"
    assert sum(drafted for *_, drafted in answers) > 0
