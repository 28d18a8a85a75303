"""The server through the official ``openai`` client, and every probe of a hostile client as a regression test:
a seed that wedged the scheduler, a temperature that gave NaN, request smuggling, 500s for client errors,
parameters silently ignored. On the tiny random model of test_server.py (float64)."""

from __future__ import annotations

import json
import math
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import hypothesis
import numpy as np
import openai
import pytest
import torch
from scipy.stats import chisquare
from test_server import (  # noqa: F401
    EOS,
    MODEL,
    get,
    ids_of,
    plain_greedy,
    post,
    prompt_text,
    raw_exchange,
    start_server,
    tiny,
    visible,
    wait_for,
)

from exactspec.backends import LeanRuntime
from exactspec.sampling import LogitsAdjustment, SamplingParams, logits_to_probs
from exactspec.server.scheduler import GenerationRequest

PROMPT = [5, 9, 12, 9, 12, 40, 5, 9]


@pytest.fixture(scope="module")
def server(tiny):
    server = start_server(tiny, drafter="prompt-lookup", speculation="always", api_key="sesame")
    yield server
    server.shutdown(timeout=5)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="sesame", max_retries=0, timeout=60)


AUTH = {"Authorization": "Bearer sesame"}


# --- the official client ----------------------------------------------------------------------------------------------


def test_the_openai_client_completes_chats_and_streams(client, tiny):
    completion = client.completions.create(model=MODEL, prompt=prompt_text(PROMPT), max_tokens=10, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert ids_of(completion.choices[0].text) == visible(plain_greedy(tiny, PROMPT, 10))
    assert completion.usage.completion_tokens == 10
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w7 w8 w9"}],
                                          max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    assert chat.choices[0].message.role == "assistant"
    assert ids_of(chat.choices[0].message.content) == visible(plain_greedy(tiny, [7, 8, 9], 6))
    pieces = [chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "w7 w8 w9"}], max_tokens=6, temperature=0, stream=True,
        extra_body={"ignore_eos": True}) if chunk.choices]
    assert "".join(pieces) == chat.choices[0].message.content
    assert [m.id for m in client.models.list()] == [MODEL]


def test_n_gives_n_independent_samples_reproducibly(client):
    def sample(seed):
        return client.completions.create(model=MODEL, prompt=prompt_text(PROMPT), max_tokens=8, n=4, seed=seed,
                                         temperature=1.0, extra_body={"ignore_eos": True})

    first = sample(7)
    assert [c.index for c in first.choices] == [0, 1, 2, 3]
    texts = [c.text for c in first.choices]
    assert len(set(texts)) > 1  # 4 draws of 8 tokens from a random model at temperature 1: equal by chance ~never
    assert [c.text for c in sample(7).choices] == texts
    assert first.usage.completion_tokens == 32
    # choice 0 is the request's own seed: n = 1 with that seed answers the same
    single = client.completions.create(model=MODEL, prompt=prompt_text(PROMPT), max_tokens=8, seed=7,
                                       temperature=1.0, extra_body={"ignore_eos": True})
    assert single.choices[0].text == texts[0]
    streamed = client.completions.create(model=MODEL, prompt=prompt_text(PROMPT), max_tokens=8, n=4, seed=7,
                                         temperature=1.0, stream=True, extra_body={"ignore_eos": True})
    joined = ["", "", "", ""]
    for chunk in streamed:
        for choice in chunk.choices:
            joined[choice.index] += choice.text
    assert joined == texts


def test_logprobs_are_the_targets_own_at_each_emitted_token(client, tiny):
    completion = client.completions.create(model=MODEL, prompt=prompt_text(PROMPT), max_tokens=6, temperature=0,
                                           logprobs=3, extra_body={"ignore_eos": True})
    logprobs = completion.choices[0].logprobs
    tokens = plain_greedy(tiny, PROMPT, 6)
    runtime = LeanRuntime(tiny[0])
    expected = torch.log_softmax(runtime.extend(PROMPT + tokens[:-1], 6).double(), dim=-1)  # [6, vocab]
    for i, token in enumerate(tokens):
        assert math.isclose(logprobs.token_logprobs[i], float(expected[i, token]), abs_tol=1e-6)
        top = expected[i].topk(3)
        assert sorted(logprobs.top_logprobs[i].values(), reverse=True) == pytest.approx(top.values.tolist(), abs=1e-6)
    assert logprobs.text_offset[0] == 0 and len(logprobs.tokens) == 6
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w7 w8 w9"}],
                                          max_tokens=4, temperature=0, logprobs=True, top_logprobs=2,
                                          extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(entry.top_logprobs) == 2 for entry in content)
    assert all(entry.logprob <= 0 for entry in content)
    streamed = [entry for chunk in client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "w7 w8 w9"}], max_tokens=4, temperature=0, logprobs=True,
        top_logprobs=2, stream=True, extra_body={"ignore_eos": True})
        if chunk.choices and chunk.choices[0].logprobs for entry in chunk.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]


def test_logit_bias_bans_the_greedy_token_and_echo_repeats_the_prompt(client, tiny):
    greedy = plain_greedy(tiny, PROMPT, 1)[0]
    banned = client.completions.create(model=MODEL, prompt=prompt_text(PROMPT), max_tokens=1, temperature=0,
                                       logit_bias={str(greedy): -100}, extra_body={"ignore_eos": True})
    assert ids_of(banned.choices[0].text) and ids_of(banned.choices[0].text)[0] != greedy
    echoed, plain = (client.completions.create(model=MODEL, prompt=prompt_text(PROMPT), max_tokens=3, temperature=0,
                                               echo=echo, extra_body={"ignore_eos": True}) for echo in (True, False))
    assert echoed.choices[0].text == prompt_text(PROMPT) + plain.choices[0].text


@pytest.mark.parametrize("params, param", [
    ({"best_of": 2}, "best_of"),
    ({"suffix": "w3"}, "suffix"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"}, "tools"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format"),
    ({"guided_regex": "a(b"}, "guided_regex"),
    ({"guided_regex": "a", "guided_grammar": "start: \"a\""}, "guided_grammar"),
    ({"min_p": 0.1}, "min_p"),
    ({"logit_bias": {"99999": 1}}, "logit_bias"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"seed": 2**64}, "seed"),
    ({"sampling": "gumbel"}, "sampling"),
])
def test_parameters_not_implemented_or_out_of_range_are_refused_by_name(client, params, param):
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt="w3", max_tokens=2, extra_body=params)
    assert refused.value.body["param"] == param


def test_chat_parameters_not_implemented_or_malformed_are_refused(client):
    for params, param in (({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),  # auto
                          ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": []}}},
                           "response_format.json_schema.schema"),
                          ({"response_format": {"type": "json_schema"}}, "response_format.json_schema")):
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w3"}], **params)
        assert refused.value.body["param"] == param


# --- one request never harms another ----------------------------------------------------------------------------------


def test_a_bad_seed_is_refused_and_a_burst_after_it_is_all_answered(server):
    for seed in (2**64, -(2**63) - 1):
        status, body = post(server, "/v1/completions", {"prompt": "w3", "seed": seed}, AUTH)
        assert status == 400 and body["error"]["param"] == "seed"
    with ThreadPoolExecutor(64) as pool:
        answers = list(pool.map(lambda i: post(server, "/v1/completions", {
            "prompt": prompt_text([3 + i % 40, 4]), "max_tokens": 4, "seed": i}, AUTH), range(64)))
    assert [status for status, _ in answers] == [200] * 64
    assert get(server, "/health")[0] == 200


def test_a_vanishing_temperature_is_the_greedy_limit_for_it_and_harms_no_neighbour(server, tiny):
    body = {"prompt": prompt_text(PROMPT), "max_tokens": 8, "ignore_eos": True}
    with ThreadPoolExecutor(6) as pool:
        tiny_t = [pool.submit(post, server, "/v1/completions", {**body, "temperature": t}, AUTH)
                  for t in (1e-300, 5e-324)]
        neighbours = [pool.submit(post, server, "/v1/completions", {**body, "temperature": 0}, AUTH) for _ in range(4)]
    expected = visible(plain_greedy(tiny, PROMPT, 8))
    for future in tiny_t + neighbours:
        status, answer = future.result()
        assert status == 200 and ids_of(answer["choices"][0]["text"]) == expected


def test_a_request_whose_pass_fails_ends_alone_with_a_500(tiny):
    """A fault inside one request's share of the batched pass (injected: its rows hold a poison token) ends that
    request with a 500 and frees its slot; the requests beside it finish with their own greedy outputs."""
    server = start_server(tiny, drafter="none", speculation="never")
    pool = server.scheduler.pool
    forward = pool.forward

    def poisoned(rows):
        if any(57 in row.token_ids for row in rows):
            raise RuntimeError("injected fault")
        return forward(rows)

    pool.forward = poisoned
    try:
        with ThreadPoolExecutor(5) as workers:
            good = [workers.submit(post, server, "/v1/completions", {"prompt": prompt_text([4 + i, 9]),
                                                                     "max_tokens": 12, "temperature": 0,
                                                                     "ignore_eos": True}) for i in range(4)]
            bad = workers.submit(post, server, "/v1/completions", {"prompt": "w57 w3", "max_tokens": 12})
        status, body = bad.result()
        assert status == 500 and "injected fault" in body["error"]["message"]
        for i, future in enumerate(good):
            status, body = future.result()
            assert status == 200 and ids_of(body["choices"][0]["text"]) == visible(plain_greedy(tiny, [4 + i, 9], 12))
        assert wait_for(lambda: server.scheduler.running == 0) and pool.slots == []
        assert server.scheduler.metrics.finished.get("error") == 1
        assert 'exactspec_requests_rejected_total{status="500"}' in get(server, "/metrics")[1]
    finally:
        pool.forward = forward
        server.shutdown(timeout=5)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_health_is_503_when_the_scheduler_thread_has_died(tiny):
    server = start_server(tiny)
    try:
        def die():
            raise SystemExit  # not an Exception: the loop's own handler lets it through

        server.scheduler._admit = die
        server.scheduler.submit(GenerationRequest(prompt_ids=[3, 4], max_tokens=2))
        assert wait_for(lambda: get(server, "/health")[0] == 503)
        assert "died" in get(server, "/health")[1]
    finally:
        server.shutdown(timeout=1)


# --- the HTTP layer ---------------------------------------------------------------------------------------------------


def test_a_refused_requests_body_is_never_read_as_a_request(server):
    smuggled = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sesame\r\n\r\n"
    for head, kept_alive in ((b"POST /v1/completions HTTP/1.1\r\n", False),  # 401 before routing: closes
                             (b"POST /nowhere HTTP/1.1\r\nAuthorization: Bearer sesame\r\n", True),  # 404
                             (b"POST /health HTTP/1.1\r\n", True)):  # 405
        request = head + b"Host: x\r\nContent-Length: %d\r\n\r\n" % len(smuggled) + smuggled
        answer = raw_exchange(server, request + b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        # the refusal, then (where the connection is kept) /health: never the smuggled GET
        assert answer.count(b"HTTP/1.1 ") == 1 + kept_alive, answer
        assert b'"object": "list"' not in answer and (b'"status": "ok"' in answer) == kept_alive


@pytest.mark.parametrize("headers", [
    b"Content-Length: 13\r\nContent-Length: 14\r\n",
    b"Content-Length: 13\r\nTransfer-Encoding: chunked\r\n",
    b"Transfer-Encoding: gzip, chunked\r\nTransfer-Encoding: chunked\r\n",
])
def test_conflicting_message_lengths_are_refused(server, headers):
    answer = raw_exchange(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sesame\r\n"
                          + headers + b"\r\n" + b'{"prompt":"w"}0\r\n\r\n')
    assert answer.startswith(b"HTTP/1.1 400") and answer.count(b"HTTP/1.1 ") == 1, answer


def test_client_errors_are_4xx_never_500(server):
    deep = b"[" * 100_000 + b"]" * 100_000
    status, body = post(server, "/v1/completions", None, AUTH, raw=b'{"prompt": ' + deep + b"}")
    assert status == 400 and "nests" in body["error"]["message"]
    status, body = post(server, "/v1/completions", None, AUTH, raw=b'{"prompt": "w3 \\ud800"}')
    assert status == 400 and body["error"]["param"] == "prompt"
    status, body = post(server, "/v1/chat/completions", None, AUTH,
                        raw=b'{"messages": [{"role": "user", "content": "\\udfff"}]}')
    assert status == 400 and body["error"]["param"] == "messages.0.content"
    for number in (b"1e999", b"Infinity", b"NaN", b"-Infinity"):
        status, body = post(server, "/v1/completions", None, AUTH, raw=b'{"prompt": "w3", "temperature": %s}' % number)
        assert status == 400 and body["error"]["param"] == "temperature"


def test_other_methods_get_405_with_an_openai_body_and_bearer_is_any_case(server):
    for method in ("PUT", "DELETE", "PATCH"):
        answer = raw_exchange(server, f"{method} /v1/completions HTTP/1.1\r\nHost: x\r\n{AUTH_LINE}"
                              "Content-Length: 0\r\n\r\n".encode())
        assert answer.startswith(b"HTTP/1.1 405") and b'"invalid_request_error"' in answer, answer
    assert get(server, "/v1/models", {"Authorization": "bearer sesame"})[0] == 200
    assert get(server, "/v1/models", {"Authorization": "BEARER  sesame"})[0] == 200
    assert get(server, "/v1/models", {"Authorization": "Basic sesame"})[0] == 401


AUTH_LINE = "Authorization: Bearer sesame\r\n"


def test_openapi_describes_the_request_bodies(server):
    assert get(server, "/openapi.json")[0] == 401  # with a key set, every path but /health asks for it
    status, text = get(server, "/openapi.json", {"Authorization": "Bearer sesame"})
    document = json.loads(text)
    assert status == 200
    schemas = document["components"]["schemas"]
    assert {"CompletionRequest", "ChatCompletionRequest"} <= set(schemas)
    assert schemas["CompletionRequest"]["additionalProperties"] is False
    body = document["paths"]["/v1/chat/completions"]["post"]["requestBody"]
    assert body["content"]["application/json"]["schema"]["$ref"].endswith("/ChatCompletionRequest")


# --- exactness of the adjusted distribution ---------------------------------------------------------------------------


def test_penalised_and_biased_sampling_follows_the_adjusted_target_exactly(tiny):
    """The first two tokens of requests with logit_bias and presence and frequency penalties, speculating with
    prompt lookup on a repetitive prompt (drafts accepted and rejected), against the exact joint distribution
    computed from the adjusted logits: 4,000 samples, one chi-square test at alpha = 0.001 (a correct engine
    fails it with probability 0.1%; the seeds are fixed)."""
    from exactspec.server import BatchSettings, build_scheduler

    model, _ = tiny
    adjustment = LogitsAdjustment(bias={9: 2.0, 12: -1.5, 40: -100.0}, presence_penalty=1.2, frequency_penalty=0.7)
    sampling = SamplingParams(temperature=1.0)
    runtime = LeanRuntime(model)
    scheduler = build_scheduler(runtime, BatchSettings(drafter="prompt-lookup", speculation="always",
                                                       max_batch_size=32, max_model_len=64, max_waiting=4096),
                                {EOS})
    scheduler.start()
    try:
        handles = [scheduler.submit(GenerationRequest(prompt_ids=PROMPT, max_tokens=2, sampling=sampling, seed=seed,
                                                      stop_at_eos=False, adjustment=adjustment))
                   for seed in range(4000)]
        samples, drafted = [], 0
        for handle in handles:
            tokens, _, scored = handle.collect()
            samples.append(tuple(tokens[:2]))
            drafted += scored
    finally:
        scheduler.shutdown(timeout=5)
    assert drafted > 0

    def adjusted_probs(context: list[int], generated: list[int]) -> torch.Tensor:
        """Written out by hand, not through LogitsAdjustment: the bias, then for each token generated once the
        frequency penalty 0.7 and the presence penalty 1.2."""
        runtime.rollback(0)
        logits = runtime.extend(context, 1)[0].double().clone()
        logits[9] += 2.0
        logits[12] -= 1.5
        logits[40] -= 100.0
        for token in set(generated):
            logits[token] -= 0.7 * generated.count(token) + 1.2
        return logits_to_probs(logits, sampling)

    p1 = adjusted_probs(PROMPT, [])
    exact = {}
    for y1 in torch.nonzero(p1 > 1e-9).flatten().tolist():
        p2 = adjusted_probs(PROMPT + [y1], [y1])
        for y2 in torch.nonzero(p2 > 1e-9).flatten().tolist():
            exact[(y1, y2)] = float(p1[y1] * p2[y2])
    n = len(samples)
    bins = [outcome for outcome, p in exact.items() if p * n >= 5]
    counts = Counter(samples)
    observed = [counts.get(b, 0) for b in bins] + [n - sum(counts.get(b, 0) for b in bins)]
    expected = [exact[b] * n for b in bins] + [n - sum(exact[b] * n for b in bins)]
    assert chisquare(np.array(observed, float), np.array(expected, float)).pvalue > 1e-3
    assert all(40 not in s for s in samples)  # banned outright


# --- fuzzing from /openapi.json ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fuzzed_server(tiny):
    server = start_server(tiny, drafter="prompt-lookup", speculation="always", max_model_len=64)
    yield server
    server.shutdown(timeout=5)


@pytest.fixture(scope="module")
def api_schema(fuzzed_server):
    schemathesis = pytest.importorskip("schemathesis")
    return schemathesis.openapi.from_url(fuzzed_server.url + "/openapi.json")


FUZZED = Counter()


@pytest.mark.parametrize("mode", ["positive", "negative"])
@pytest.mark.filterwarnings("ignore")
def test_fuzzed_requests_never_get_a_5xx_and_never_hang(mode, api_schema, fuzzed_server):
    """schemathesis draws bodies from the OpenAPI document (valid ones, and invalid ones by mutation), up to 40
    per endpoint and mode, derandomised: none may get a 5xx or take over 30 s, and the server still answers.

    Its strategies are driven by hypothesis here, not by schemathesis's pytest plugin (``from_fixture``), which
    renames pytest's nodes through a private attribute that pytest 9.2 no longer has."""
    from schemathesis import GenerationMode

    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert operations
    for operation in operations:
        try:
            fuzz(operation, GenerationMode(mode), fuzzed_server)
        except hypothesis.errors.Unsatisfiable:  # nothing to mutate: an endpoint without parameters or body
            assert mode == "negative" and not operation.body and not operation.query, operation.label
            FUZZED[(operation.label, "nothing to mutate")] += 1


def fuzz(operation, mode, server) -> None:
    """Up to 40 requests to one endpoint drawn by schemathesis, each checked for a 5xx and the server's health."""

    @hypothesis.settings(max_examples=40, deadline=None, suppress_health_check=list(hypothesis.HealthCheck),
                         derandomize=True, database=None)
    @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
    def call(case):
        response = case.call(timeout=30)
        FUZZED[(operation.label, response.status_code // 100)] += 1
        assert response.status_code < 500, (operation.label, case.body, response.text)
        assert get(server, "/health")[0] == 200

    call()


def test_the_fuzzing_reached_the_generation_endpoints():
    """The fuzzing above ran (it runs first, in file order): valid bodies got answers, invalid ones 4xx."""
    if not FUZZED:
        pytest.skip("checks the fuzzing run before it in this session")
    for endpoint in ("POST /v1/completions", "POST /v1/chat/completions"):
        assert FUZZED[(endpoint, 2)] > 0 and FUZZED[(endpoint, 4)] > 0, FUZZED
