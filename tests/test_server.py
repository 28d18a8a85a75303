"""The OpenAI-compatible server end to end over HTTP, on a tiny random model (float64: no rounding near-ties).

Exactness inside a batch, the reliability behaviours (400, 401, 404, 413, 429, a client that leaves, a drafter
that raises, seeds, graceful shutdown) and a load test of 200 requests, 32 at a time.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import random
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from tiny import save_with_tokenizer, tiny_llama

from exactspec.backends import LeanRuntime
from exactspec.engine import Engine, GenerationConfig
from exactspec.errors import UsageError
from exactspec.proposers import NoProposer, PromptLookupProposer
from exactspec.server import BatchSettings, build_scheduler
from exactspec.server.app import OpenAIServer, ServerSettings
from exactspec.server.protocol import ChatCompletionRequest, CompletionRequest
from exactspec.server.scheduler import NotOffered, QueueFull, ShuttingDown

MODEL = "tiny"
EOS = 1
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoTokenizer

    model = tiny_llama(seed=0, init_range=0.5).double()
    path = save_with_tokenizer(model, tmp_path_factory.mktemp("tiny"))
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = CHAT_TEMPLATE
    return model, tokenizer


def start_server(tiny, proposer=None, api_key=None, max_body_bytes=1 << 20, read_timeout=60.0, head_timeout=20.0,
                 body_timeout=120.0, **batch) -> OpenAIServer:
    """A server on a free port; ``proposer`` (a factory) replaces the drafter of ``batch['drafter']``."""
    model, tokenizer = tiny
    settings = BatchSettings(**{"max_batch_size": 32, "max_model_len": 256, **batch})
    scheduler = build_scheduler(LeanRuntime(model), settings, {EOS})
    if proposer is not None:
        scheduler.new_proposer = proposer
    server = OpenAIServer(scheduler, tokenizer, MODEL, ServerSettings(port=0, api_key=api_key,
                                                                      max_body_bytes=max_body_bytes,
                                                                      read_timeout=read_timeout,
                                                                      head_timeout=head_timeout,
                                                                      body_timeout=body_timeout))
    server.start()
    return server


@pytest.fixture(scope="module")
def server(tiny):
    server = start_server(tiny, drafter="prompt-lookup", speculation="always")
    yield server
    server.shutdown(timeout=5)


def post(server, path: str, body, headers: dict | None = None, raw: bytes | None = None) -> tuple[int, dict]:
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    connection.request("POST", path, body=raw if raw is not None else json.dumps(body),
                       headers={"Content-Type": "application/json", **(headers or {})})
    response = connection.getresponse()
    status, payload = response.status, json.loads(response.read())
    connection.close()
    return status, payload


def raw_exchange(server, payload: bytes, wait: float = 1.0) -> bytes:
    """Send bytes on one connection; everything the server answers until it closes (or resets: it closed with
    bytes unread) or goes quiet for ``wait`` seconds."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=wait) as connection:
        connection.sendall(payload)
        received = b""
        try:
            while chunk := connection.recv(65536):
                received += chunk
        except (TimeoutError, ConnectionResetError):
            pass
    return received


def get(server, path: str, headers: dict | None = None) -> tuple[int, str]:
    status, _, text = get_with_type(server, path, headers)
    return status, text


def get_with_type(server, path: str, headers: dict | None = None) -> tuple[int, str, str]:
    """The status, Content-Type and body of a GET."""
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    connection.request("GET", path, headers=headers or {})
    response = connection.getresponse()
    status, content_type, text = response.status, response.getheader("Content-Type"), response.read().decode()
    connection.close()
    return status, content_type, text


def stream(server, path: str, body: dict) -> list:
    """The SSE events of a streamed request, parsed ("[DONE]" kept as the string)."""
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    connection.request("POST", path, body=json.dumps({**body, "stream": True}))
    response = connection.getresponse()
    assert response.status == 200 and response.getheader("Content-Type") == "text/event-stream"
    events = []
    for line in response.read().decode().split("\n\n"):
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    connection.close()
    return events


def ids_of(text: str) -> list[int]:
    return [int(word[1:]) for word in text.split()]


def visible(token_ids: list[int]) -> list[int]:
    """The ids that decode to text: the tiny tokenizer's special tokens (<s>, </s>, <unk>) decode to nothing."""
    return [t for t in token_ids if t > 2]


def prompt_text(ids: list[int]) -> str:
    return " ".join(f"w{i}" for i in ids)


def plain_greedy(tiny, prompt_ids: list[int], max_tokens: int, ignore_eos: bool = True) -> list[int]:
    """The request decoded alone, without speculation."""
    engine = Engine(LeanRuntime(tiny[0]), NoProposer(), eos_token_ids={EOS})
    config = GenerationConfig(max_new_tokens=max_tokens, num_draft_tokens=1, stop_at_eos=not ignore_eos)
    return engine.generate(prompt_ids, config).token_ids


def wait_for(condition, seconds: float = 20.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return False


# --- shapes ------------------------------------------------------------------------------------------------------


def test_completion_has_openai_shape_and_usage(server, tiny):
    status, body = post(server, "/v1/completions", {"model": MODEL, "prompt": "w5 w9 w12 w9 w12 w40",
                                                    "max_tokens": 12, "temperature": 0, "ignore_eos": True})
    assert status == 200
    assert body["object"] == "text_completion" and body["model"] == MODEL and body["id"].startswith("cmpl-")
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length"
    assert ids_of(choice["text"]) == visible(plain_greedy(tiny, [5, 9, 12, 9, 12, 40], 12))
    assert body["usage"]["prompt_tokens"] == 6 and body["usage"]["completion_tokens"] == 12
    assert body["usage"]["total_tokens"] == 18


def test_chat_completion_applies_the_template(server, tiny):
    status, body = post(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "w7 w8"}, {"role": "assistant", "content": [
            {"type": "text", "text": "w9"}]}], "max_tokens": 5, "temperature": 0, "ignore_eos": True})
    assert status == 200 and body["object"] == "chat.completion"
    message = body["choices"][0]["message"]
    assert message["role"] == "assistant"
    assert ids_of(message["content"]) == visible(plain_greedy(tiny, [7, 8, 9], 5))


def test_streamed_chat_sends_role_deltas_finish_usage_and_done(server, tiny):
    events = stream(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "w3 w3 w3"}],
                                                     "max_tokens": 9, "temperature": 0, "ignore_eos": True,
                                                     "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    chunks, usage_chunk = events[:-2], events[-2]
    assert all(chunk["object"] == "chat.completion.chunk" for chunk in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    text = "".join(chunk["choices"][0]["delta"].get("content", "") for chunk in chunks)
    assert ids_of(text) == visible(plain_greedy(tiny, [3, 3, 3], 9))
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 9


def test_stop_string_cuts_the_text_before_it_streamed_or_not(server, tiny):
    prompt = [60, 2, 17, 33, 8, 17, 33, 21, 9]
    words = prompt_text(visible(plain_greedy(tiny, prompt, 20))).split()
    stop = f" {words[5]} {words[6]}"  # the first occurrence of the stop string ends the text
    expected = " ".join(words)[: " ".join(words).find(stop)]
    body = {"prompt": prompt_text(prompt), "max_tokens": 20, "temperature": 0, "ignore_eos": True,
            "stop": ["w999", stop]}
    status, whole = post(server, "/v1/completions", body)
    assert status == 200 and whole["choices"][0] == {**whole["choices"][0], "text": expected, "finish_reason": "stop"}
    events = stream(server, "/v1/completions", body)
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == expected
    assert events[-2]["choices"][0]["finish_reason"] == "stop"


STOPPED_PROMPT = [5, 9, 12, 9, 12, 40, 5, 9]  # repetitive: prompt lookup drafts, and rounds emit several tokens


def stopped_early(tiny, max_tokens: int = 24) -> tuple[dict, str, int]:
    """A greedy request on STOPPED_PROMPT whose stop string (its third word) comes early: the body, the text
    before the stop string, and the tokens through the one that completes it (what usage counts)."""
    tokenizer = tiny[1]
    tokens = plain_greedy(tiny, STOPPED_PROMPT, max_tokens)
    stop = " " + prompt_text(visible(tokens)).split()[2]
    whole = tokenizer.decode(tokens, skip_special_tokens=True)
    through = next(i + 1 for i in range(len(tokens))
                   if stop in tokenizer.decode(tokens[: i + 1], skip_special_tokens=True))
    assert through < max_tokens - 4  # well before the end: the request would go on
    body = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stop": stop}
    return body, whole[: whole.find(stop)], through


@pytest.mark.parametrize("speculation", ["always", "never"])
@pytest.mark.parametrize("chat", [False, True])
def test_a_stream_ended_by_a_stop_string_finishes_each_choice_once(server, tiny, chat, speculation):
    """Issue 33: the finish chunk and the speculation summary came again for each step that ran before the
    request was cancelled. One of each per choice, the text before the stop string, usage through its token."""
    body, expected, through = stopped_early(tiny)
    prompt = prompt_text(STOPPED_PROMPT)
    body = {**body, "n": 2, "speculation": speculation,
            "stream_options": {"include_usage": True, "include_speculation": True},
            **({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt})}
    events = stream(server, "/v1/chat/completions" if chat else "/v1/completions", body)
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 2 * through
    chunks = [(choice, event.get("exactspec", {})) for event in events[:-2] for choice in event["choices"]]
    for index in (0, 1):
        mine = [(choice, extension) for choice, extension in chunks if choice["index"] == index]
        assert [choice["finish_reason"] for choice, _ in mine if choice["finish_reason"]] == ["stop"]
        assert mine[-1][0]["finish_reason"] == "stop"
        summaries = [extension["summary"] for _, extension in mine if "summary" in extension]
        assert len(summaries) == 1 and summaries[0]["completion_tokens"] == through
        text = "".join(choice["delta"].get("content", "") if chat else choice["text"] for choice, _ in mine)
        assert text == expected


def test_a_stop_string_finish_is_metered_as_stop_with_the_tokens_usage_counts(server, tiny):
    """Issue 33: /metrics counted a stop-string finish as cancelled (as a client that left) and every token the
    request generated before its cancel reached the scheduler, more than its usage. Now the request ends with the
    token that completes the stop string: finish reason stop, and the tokens metered are those in usage."""
    body, expected, through = stopped_early(tiny)
    body = {**body, "prompt": prompt_text(STOPPED_PROMPT)}
    scheduler = server.scheduler
    for streamed in (False, True):
        assert wait_for(lambda: scheduler.running == 0 and scheduler.waiting == 0)
        _, before, _ = scrape(server)
        if streamed:
            events = stream(server, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
            usage = events[-2]["usage"]
        else:
            status, answer = post(server, "/v1/completions", body)
            assert status == 200 and answer["choices"][0]["text"] == expected
            usage = answer["usage"]
        assert usage["completion_tokens"] == through
        assert wait_for(lambda before=before: sum(scheduler.metrics.finished.values()) > before_finished(before))
        _, after, _ = scrape(server)

        def grew(name, labels=(), after=after, before=before):
            return after.get((f"exactspec_{name}", labels), 0) - before.get((f"exactspec_{name}", labels), 0)

        assert grew("requests_total", (("finish_reason", "stop"),)) == 1
        assert grew("requests_total", (("finish_reason", "cancelled"),)) == 0
        assert grew("generation_tokens_total") == through


def before_finished(samples: dict) -> float:
    """Requests finished, by any reason, in a scrape."""
    return sum(value for (name, _), value in samples.items() if name == "exactspec_requests_total")


# --- the error table: each scheduler refusal's status, on every route ------------------------------------------------


@pytest.mark.parametrize("error, status, kind, param", [
    (NotOffered("num_draft_tokens", "num_draft_tokens is 9 here"), 400, "invalid_request_error", "num_draft_tokens"),
    (QueueFull("the queue is full"), 429, "rate_limit_error", None),
    (ShuttingDown("the server is shutting down"), 503, "server_error", None),
    (UsageError("a check refused the request"), 400, "invalid_request_error", None),
    (ValueError("the prompt is too long"), 400, "invalid_request_error", None),
    (RuntimeError("a fault of the server's"), 500, "server_error", None),  # not in the table: the server's fault
])
@pytest.mark.parametrize("path, prompt", [("/v1/completions", {"prompt": "w3 w4"}),
                                          ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w3"}]})])
def test_a_scheduler_error_answers_its_status_and_type_and_cancels_the_choice_already_queued(
        server, monkeypatch, error, status, kind, param, path, prompt):
    """The scheduler takes choice 0 of 2 and refuses choice 1: the answer is the error's status and OpenAI type
    (streamed or not: it is refused before any event), its message and field, and choice 0 is cancelled."""
    queued, submit = [], server.scheduler.submit

    def refuse_the_second(request):
        if queued:
            raise error
        queued.append(submit(request))
        return queued[-1]

    monkeypatch.setattr(server.scheduler, "submit", refuse_the_second)
    for streamed in (False, True):
        queued.clear()
        answered, body = post(server, path, {**prompt, "max_tokens": 2, "n": 2, "stream": streamed})
        assert (answered, body["error"]["type"], body["error"]["param"]) == (status, kind, param), body
        assert str(error) in body["error"]["message"] and queued[0].cancelled.is_set()


def test_what_a_server_does_not_offer_is_refused_naming_the_field(server):
    """The scheduler's own NotOffered, through the table: this server runs --speculation always (no measured costs:
    no auto) and drafts at most 4 tokens per round."""
    for field, value in (("speculation", "auto"), ("num_draft_tokens", 5)):
        status, body = post(server, "/v1/completions", {"prompt": "w3", "max_tokens": 2, field: value})
        assert status == 400 and body["error"]["param"] == field and "this server" in body["error"]["message"], body


def test_a_whole_answer_is_its_choices_or_a_failed_choices_error_and_frees_every_slot(tiny):
    """output.whole: every choice's text after the echoed prompt, its finish and the usage; where one choice failed,
    that choice's error (its status), with every handle cancelled either way."""
    from exactspec.server.output import Answer, whole
    from exactspec.server.protocol import ApiError, Response, parse_job
    from exactspec.server.scheduler import Finished, GenerationRequest, Handle, Tokens
    from exactspec.vocabularies import TokenText

    class Connected:
        async def is_disconnected(self) -> bool:
            return False

    model, tokenizer = tiny
    job = parse_job({"prompt": "w3 w4", "max_tokens": 2, "n": 2, "echo": True}, False, MODEL, model.config.vocab_size)

    def answered(*lasts: Finished) -> tuple[list[Handle], dict]:
        handles = [Handle(GenerationRequest([3, 4], 2), "never") for _ in lasts]
        answers = [Answer(job, handle, TokenText(tokenizer, model.config.vocab_size), i) for i, handle in
                   enumerate(handles)]
        for i, (handle, last) in enumerate(zip(handles, lasts)):
            handle.put(Tokens([5 + i, 6 + i], ["plain", "plain"], 0))
            handle.put(last)
        return handles, asyncio.run(whole(answers, Response(False, MODEL), 2, "w3 w4", Connected()))

    handles, body = answered(Finished("length"), Finished("stop"))
    assert [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "w3 w4" + tokenizer.decode([5, 6]), "length"), (1, "w3 w4" + tokenizer.decode([6, 7]), "stop")]
    assert body["object"] == "text_completion" and body["usage"]["completion_tokens"] == 4
    assert all(handle.cancelled.is_set() for handle in handles)
    with pytest.raises(ApiError) as failed:
        answered(Finished("length"), Finished("error", "the grammar refused the prompt", 400))
    assert failed.value.status == 400 and failed.value.message == "the grammar refused the prompt"


def test_models_health_and_metrics(server):
    status, text = get(server, "/v1/models")
    assert status == 200 and json.loads(text)["data"][0]["id"] == MODEL
    assert get(server, "/health") == (200, '{"status": "ok"}')
    # the bias makes every token w3 (id 3), which prompt lookup drafts from the prompt: drafts are accepted whatever
    # ran on this server before (alone, the random model's own tokens were rejected, and the counter stayed at 0)
    post(server, "/v1/completions", {"prompt": "w3 w3 w3 w3", "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                                     "logit_bias": {"3": 100}})
    status, text = get(server, "/metrics")
    assert status == 200
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if not line.startswith("#")}
    for name in ("requests_total{finish_reason=\"length\"}", "prompt_tokens_total", "generation_tokens_total",
                 "drafts_total", "draft_tokens_total", "accepted_tokens_total", "mean_accepted_length",
                 "batch_size", "speculation_enabled", "acceptance_rate_at_position{position=\"1\"}"):
        assert f"exactspec_{name}" in values, name
    assert values["exactspec_draft_tokens_total"] >= values["exactspec_accepted_tokens_total"] > 0
    per_position = sum(v for k, v in values.items() if k.startswith("exactspec_accepted_tokens_at_position_total"))
    assert per_position == values["exactspec_accepted_tokens_total"]


def scrape(server) -> tuple[str, dict, dict]:
    """GET /metrics parsed by prometheus_client: its content type, {sample: value} and {family: type}."""
    from prometheus_client.parser import text_string_to_metric_families

    status, content_type, text = get_with_type(server, "/metrics")
    assert status == 200
    families = list(text_string_to_metric_families(text))
    samples = {(s.name, tuple(s.labels.items())): s.value for family in families for s in family.samples}
    return content_type, samples, {family.name: family.type for family in families}


def test_metrics_parse_as_prometheus_text_and_equal_the_servers_counters(tiny):
    from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4

    server = start_server(tiny, drafter="prompt-lookup", speculation="always")
    try:
        post(server, "/v1/completions", {"prompt": "w3 w3 w3 w3", "max_tokens": 8, "temperature": 0,
                                         "ignore_eos": True, "speculation": "never"})
        stream(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "w5 w9 w5 w9"}],
                                                "max_tokens": 6, "temperature": 0})
        post(server, "/v1/engines", {"prompt": "w3"})  # a 404
        scheduler, m = server.scheduler, server.scheduler.metrics
        assert wait_for(lambda: sum(m.finished.values()) == 2 and scheduler.running == 0)
        content_type, samples, types = scrape(server)
        assert content_type == CONTENT_TYPE_PLAIN_0_0_4

        def one(name, value):
            return {(f"exactspec_{name}", ()): value}

        def by_position(name, values):
            return {(f"exactspec_{name}", (("position", str(i + 1)),)): v for i, v in enumerate(values)}

        expected = {
            **{("exactspec_requests_total", (("finish_reason", r),)): n for r, n in m.finished.items()},
            ("exactspec_requests_rejected_total", (("status", "404"),)): 1,
            ("exactspec_requests_by_speculation_total", (("speculation", "always"),)): 1,
            ("exactspec_requests_by_speculation_total", (("speculation", "never"),)): 1,
            ("exactspec_generation_tokens_by_speculation_total", (("speculation", "never"),)): 8,
            ("exactspec_generation_tokens_by_speculation_total", (("speculation", "always"),)): m.generation_tokens - 8,
            **one("prompt_tokens_total", m.prompt_tokens), **one("generation_tokens_total", m.generation_tokens),
            **one("cached_prompt_tokens_total", m.cached_prompt_tokens),
            **one("drafts_total", m.positions.drafted[0]), **one("draft_tokens_total", sum(m.positions.drafted)),
            **one("accepted_tokens_total", sum(m.positions.accepted)),
            **by_position("draft_tokens_at_position_total", m.positions.drafted),
            **by_position("accepted_tokens_at_position_total", m.positions.accepted),
            **by_position("acceptance_rate_at_position",
                          [a / d for a, d in zip(m.positions.accepted, m.positions.drafted)]),
            **one("acceptance_rate", sum(m.positions.accepted) / sum(m.positions.drafted)),
            **one("mean_accepted_length", m.generation_tokens / m.request_rounds),
            **one("request_rounds_total", m.request_rounds), **one("prefill_seconds_total", m.prefill_seconds),
            **one("step_seconds_total", m.step_seconds), **one("steps_total", m.steps),
            **one("speculative_steps_total", m.speculative_steps), **one("batch_size", m.batch_size),
            **one("speculation_enabled", int(m.speculating)), **one("running_requests", 0),
            **one("waiting_requests", 0), **one("drafter_errors_total", m.drafter_errors),
            **one("constrained_requests_total", m.constrained_requests), **one("forced_tokens_total", m.forced_tokens),
            # prompt lookup is one drafter, not a combined one: no round has a source (tests/test_hybrid_server.py)
            **one("draft_tokens_by_source_total", 0), **one("accepted_tokens_by_source_total", 0),
        }
        assert m.draft_tokens > 0 and samples == expected
        assert {name for name, kind in types.items() if kind == "counter"} == {
            name[: -len("_total")] for name, _ in samples if name.endswith("_total")}
        assert set(types.values()) == {"counter", "gauge"}

        odd = 'a "quoted"\\reason\nover two lines'  # no label is free text today: a finish reason is the likeliest
        m.observe_finish(odd, "auto")
        assert scrape(server)[1][("exactspec_requests_total", (("finish_reason", odd),))] == 1
    finally:
        server.shutdown(timeout=5)


# --- bad input ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("raw, param", [
    (b"{not json", None),
    (b"[1, 2]", None),
    (json.dumps({"prompt": "w3", "max_tokens": "ten"}).encode(), "max_tokens"),
    (json.dumps({"prompt": "w3", "temperature": "hot"}).encode(), "temperature"),
    (json.dumps({"prompt": 3}).encode(), "prompt"),
    (json.dumps({"prompt": "w3", "stream": "yes"}).encode(), "stream"),
    (json.dumps({"prompt": "w3", "max_tokens": 10_000}).encode(), "max_tokens"),
    (json.dumps({"prompt": "w3", "max_tokens": 0}).encode(), "max_tokens"),
    (json.dumps({"prompt": "w3", "temperature": -0.5}).encode(), "temperature"),
    (json.dumps({"prompt": "w3", "top_p": 0}).encode(), "top_p"),
    (json.dumps({"prompt": "w3", "stop": [1]}).encode(), "stop"),
    (json.dumps({"prompt": [3, 999]}).encode(), "prompt"),
])
def test_bad_requests_get_400_with_an_openai_error_body(server, raw, param):
    status, body = post(server, "/v1/completions", None, raw=raw)
    assert status == 400
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["message"]
    assert body["error"]["param"] == param


def test_a_model_the_server_does_not_serve_is_404_model_not_found_and_an_alias_is_answered(tiny):  # noqa: F811
    """As OpenAI and vLLM answer a name they do not serve (400 before: clients that hard-code a name, as
    ``gpt-3.5-turbo-instruct``, read a 404 as "no such model"); ``--served-model-name NAME ALIAS``: both listed by
    /v1/models, a request naming the alias is answered under it."""
    model, tokenizer = tiny
    scheduler = build_scheduler(LeanRuntime(model), BatchSettings(max_batch_size=4, max_model_len=256), {EOS})
    server = OpenAIServer(scheduler, tokenizer, [MODEL, "gpt-3.5-turbo-instruct"], ServerSettings(port=0))
    server.start()
    try:
        status, body = post(server, "/v1/completions", {"prompt": "w3", "model": "gpt-4", "max_tokens": 2})
        assert status == 404 and body["error"]["code"] == "model_not_found" and body["error"]["param"] == "model"
        assert "'gpt-4' does not exist" in body["error"]["message"]
        for name in (MODEL, "gpt-3.5-turbo-instruct"):
            status, body = post(server, "/v1/completions", {"prompt": "w3", "model": name, "max_tokens": 2})
            assert status == 200 and body["model"] == name, body
        status, body = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "w3"}],
                                                              "model": "gpt-4", "max_tokens": 2})
        assert status == 404 and body["error"]["code"] == "model_not_found"
        status, listed = get(server, "/v1/models")
        listed = json.loads(listed)
        assert [entry["id"] for entry in listed["data"]] == [MODEL, "gpt-3.5-turbo-instruct"]
    finally:
        server.shutdown(timeout=5)


def test_a_requests_own_work_runs_off_the_event_loop(tiny):  # noqa: F811
    """A request's checking, tokenising and grammar compiling run on a worker thread: while one takes 5 s (a 1 MiB
    regex took 0.8 s to compile, on the event loop, stalling every stream and /health), /health answers within a
    second and another request is answered before it; the slow one then answers too."""
    server = start_server(tiny, max_batch_size=4)
    prepared = server.prepared

    def slow(raw, chat):
        if b"slow" in raw:
            time.sleep(5.0)
        return prepared(raw, chat)

    server.prepared = slow
    try:
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(post, server, "/v1/completions", {"prompt": "w3", "max_tokens": 2, "user": "slow"})
            time.sleep(0.5)
            started = time.perf_counter()
            status, _ = get(server, "/health")
            assert status == 200 and time.perf_counter() - started < 1.0
            other, _ = post(server, "/v1/completions", {"prompt": "w5", "max_tokens": 2})
            assert other == 200 and not waiting.done() and waiting.result(timeout=60)[0] == 200
    finally:
        server.shutdown(timeout=5)


def test_bad_chat_messages_get_400(server):
    for messages in ([], [{"content": "w3"}], [{"role": "user", "content": 5}]):
        status, body = post(server, "/v1/chat/completions", {"messages": messages})
        assert status == 400 and body["error"]["param"].startswith("messages")


@pytest.mark.parametrize("chat", [False, True])
def test_null_is_the_default_for_every_optional_field(server, chat):
    """Issue 33: ``"sampling": null`` was refused while ``"speculation": null`` was taken. As in OpenAI's API, an
    optional field sent as null is not sent: its default, for OpenAI's fields and exactspec's alike (nested ones too),
    and the OpenAPI schema says each takes null."""
    model = ChatCompletionRequest if chat else CompletionRequest
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"max_tokens": 3, "temperature": 0, "ignore_eos": True,
            **({"messages": [{"role": "user", "content": "w5 w9 w12", "name": None}]} if chat else {"prompt": "w5 w9"})}
    status, expected = post(server, path, body)
    assert status == 200
    optional = [name for name, field in model.model_fields.items() if not field.is_required()]
    assert {"sampling", "speculation", "num_draft_tokens", "top_k", "ignore_eos", "stream_options", "stop", "n",
            "seed", "logprobs"} <= set(optional)
    for name in optional:
        status, answer = post(server, path, {**body, name: None})
        assert status == 200, (name, answer)
        if name not in body:  # the answer without it
            assert answer["choices"] == expected["choices"] and answer["usage"] == expected["usage"], name
    events = stream(server, path, {**body, "stream_options": {"include_usage": None, "include_speculation": None}})
    assert all("usage" not in event and "exactspec" not in event for event in events[:-1])
    schema = json.loads(get(server, "/openapi.json")[1])["components"]["schemas"][model.__name__]
    for name in optional:
        options = schema["properties"][name].get("anyOf", [schema["properties"][name]])
        assert any(option.get("type") == "null" for option in options), name


@pytest.mark.parametrize("path, prompt", [("/v1/completions", {"prompt": "w3"}),
                                          ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w3"}]})])
def test_stream_options_without_stream_is_refused_naming_it(server, path, prompt):
    """Issue 33: taken silently before; OpenAI refuses it. (Null is not sent: taken.)"""
    for extra in ({"stream_options": {"include_usage": True}}, {"stream": False, "stream_options": {}}):
        status, answer = post(server, path, {**prompt, "max_tokens": 2, **extra})
        assert status == 400 and answer["error"]["param"] == "stream_options", answer
        assert answer["error"]["message"] == "stream_options is only allowed when stream is true"
    assert post(server, path, {**prompt, "max_tokens": 2, "stream_options": None})[0] == 200


def test_unknown_path_is_404_a_wrong_method_405_and_an_oversized_body_413(tiny):
    server = start_server(tiny, max_body_bytes=2048)
    try:
        status, body = post(server, "/v1/engines", {"prompt": "w3"})
        assert status == 404 and "error" in body
        status, text = get(server, "/v1/completions")
        assert status == 405 and "POST" in json.loads(text)["error"]["message"]
        status, body = post(server, "/v1/completions", {"prompt": "w3 " * 2000})
        assert status == 413 and "limit" in body["error"]["message"]
    finally:
        server.shutdown(timeout=5)


def test_api_key_is_required_everywhere_but_health(tiny):
    server = start_server(tiny, api_key="sesame")
    try:
        assert get(server, "/health")[0] == 200
        for path in ("/v1/models", "/metrics"):
            assert get(server, path)[0] == 401
            assert get(server, path, {"Authorization": "Bearer sesame"})[0] == 200
        status, body = post(server, "/v1/completions", {"prompt": "w3", "max_tokens": 2},
                            {"Authorization": "Bearer wrong"})
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
        status, _ = post(server, "/v1/completions", {"prompt": "w3", "max_tokens": 2},
                         {"Authorization": "Bearer sesame"})
        assert status == 200
    finally:
        server.shutdown(timeout=5)


def test_a_client_that_stalls_mid_body_gets_408_and_others_are_served(tiny):
    server = start_server(tiny, read_timeout=0.5)
    try:
        stalled = socket.create_connection(("127.0.0.1", server.port))
        stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"pro")
        stalled.settimeout(10)
        answer = stalled.recv(4096)
        assert answer.startswith(b"HTTP/1.1 408") and b"stalled" in answer  # answered 408, then closed
        while answer:
            answer = stalled.recv(4096)
        stalled.close()
        assert post(server, "/v1/completions", {"prompt": "w3", "max_tokens": 2})[0] == 200
    finally:
        server.shutdown(timeout=5)


def test_a_body_trickled_past_its_time_in_all_gets_408(tiny):
    """Issue 33: a body sent a byte at a time, each within the stall timeout, was held open without end. The body's
    time in all is bounded (120 s by default; 1 s here, against a stall timeout of 5 s)."""
    server = start_server(tiny, read_timeout=5.0, body_timeout=1.0)
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as trickled:
            started, answer = time.monotonic(), b""  # before the head is sent: the server's clock starts after it
            trickled.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n")
            trickled.settimeout(0.2)
            while not answer and time.monotonic() - started < 4:
                try:
                    trickled.sendall(b" ")
                    answer = trickled.recv(4096)
                except TimeoutError:
                    pass
            took = time.monotonic() - started
        assert answer.startswith(b"HTTP/1.1 408") and b"did not end within 1 s" in answer, answer
        assert b'"invalid_request_error"' in answer and b"connection: close" in answer.lower()
        assert 1.0 <= took < 3.0, took  # the bound in all, not the 5 s stall timeout
        assert post(server, "/v1/completions", {"prompt": "w3", "max_tokens": 2})[0] == 200
    finally:
        server.shutdown(timeout=5)


def test_server_binds_loopback_by_default(server):
    assert server.address[0] == "127.0.0.1"  # the fixture's settings name no host


# --- reliability -------------------------------------------------------------------------------------------------


class GatedProposer(PromptLookupProposer):
    """Prompt lookup that waits for ``gate`` before each draft: holds the step loop still while a test looks."""

    def __init__(self, gate: threading.Event, delay: float = 0.0) -> None:
        super().__init__()
        self.gate, self.delay = gate, delay

    def propose(self, context, k, params, generator):
        self.gate.wait()
        time.sleep(self.delay)
        return super().propose(context, k, params, generator)


def test_a_full_queue_answers_429_instead_of_growing(tiny):
    gate = threading.Event()
    server = start_server(tiny, proposer=lambda: GatedProposer(gate), max_batch_size=1, max_waiting=1)
    try:
        with ThreadPoolExecutor(2) as pool:
            body = {"prompt": "w3 w4", "max_tokens": 4, "temperature": 0}
            running = pool.submit(post, server, "/v1/completions", body)
            assert wait_for(lambda: server.scheduler.running == 1)
            waiting = pool.submit(post, server, "/v1/completions", body)
            assert wait_for(lambda: server.scheduler.waiting == 1)
            connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
            connection.request("POST", "/v1/completions", json.dumps(body))
            response = connection.getresponse()
            refused = json.loads(response.read())
            assert response.status == 429 and refused["error"]["type"] == "rate_limit_error"
            assert int(response.getheader("Retry-After")) >= 1
            connection.close()
            gate.set()
            assert running.result()[0] == 200 and waiting.result()[0] == 200
    finally:
        gate.set()
        server.shutdown(timeout=5)


def test_a_client_that_disconnects_mid_stream_frees_its_slot(tiny):
    gate = threading.Event()
    gate.set()
    server = start_server(tiny, proposer=lambda: GatedProposer(gate, delay=0.01), speculation="always")
    try:
        connection = socket.create_connection(("127.0.0.1", server.port))
        body = json.dumps({"prompt": "w3 w4 w5", "max_tokens": 200, "ignore_eos": True, "stream": True}).encode()
        connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        received = b""
        while b"data: " not in received:  # streaming has begun
            received += connection.recv(4096)
        connection.close()
        metrics = server.scheduler.metrics
        assert wait_for(lambda: metrics.finished.get("cancelled") == 1)
        assert server.scheduler.running == 0 and server.scheduler.pool.slots == []
        assert metrics.generation_tokens < 200
    finally:
        server.shutdown(timeout=5)


class FailingProposer(PromptLookupProposer):
    """Prompt lookup that raises on its third draft."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def propose(self, context, k, params, generator):
        self.calls += 1
        if self.calls == 3:
            raise RuntimeError("drafter exploded")
        return super().propose(context, k, params, generator)


def test_a_drafter_that_raises_falls_back_to_plain_decoding(tiny):
    server = start_server(tiny, proposer=FailingProposer, speculation="always")
    try:
        prompt = [5, 9, 12, 9, 12, 40]
        status, body = post(server, "/v1/completions", {"prompt": prompt_text(prompt), "max_tokens": 30,
                                                        "temperature": 0, "ignore_eos": True})
        assert status == 200 and body["choices"][0]["finish_reason"] == "length"
        assert ids_of(body["choices"][0]["text"]) == visible(plain_greedy(tiny, prompt, 30))
        assert server.scheduler.metrics.drafter_errors == 1
    finally:
        server.shutdown(timeout=5)


def test_a_seeded_request_gives_the_same_tokens_alone_in_a_burst_and_without_speculation(server, tiny):
    """The invariant sampler (the default): a seeded request at temperature 1 answers the same text on a server that
    always speculates and on one that never does, alone and among 15 other requests. Under the standard rule the
    draws follow the drafts, so there a request is reproducible on one server alone, and without speculation
    whatever else is in the batch."""
    body = {"prompt": "w3 w4 w5 w3 w4", "max_tokens": 24, "temperature": 1.0, "seed": 7, "ignore_eos": True}
    plain = start_server(tiny, speculation="never")

    def text(on, request=body):
        status, answer = post(on, "/v1/completions", request)
        assert status == 200, answer
        return answer["choices"][0]["text"]

    def in_burst(on, request=body):
        others = [{**request, "prompt": f"w{3 + i} w{9 + i} w3 w{9 + i}", "seed": 100 + i} for i in range(15)]
        with ThreadPoolExecutor(16) as pool:
            crowd = [pool.submit(post, on, "/v1/completions", other) for other in others[:7]]
            watched = pool.submit(text, on, request)
            crowd += [pool.submit(post, on, "/v1/completions", other) for other in others[7:]]
            assert all(f.result()[0] == 200 for f in crowd)
            return watched.result()

    try:
        alone = text(plain)
        assert text(server) == alone and in_burst(server) == alone and in_burst(plain) == alone
        standard = {**body, "sampling": "standard"}
        assert text(server, standard) == text(server, standard)
        assert in_burst(plain, standard) == text(plain, standard)
    finally:
        plain.shutdown(timeout=5)


def test_under_the_standard_rule_an_auto_servers_text_follows_its_k_and_a_fixed_mode_is_reproducible(tiny):
    """docs/serving.md's stated limit: under ``"sampling": "standard"`` a seeded request's text follows its drafts,
    so on an ``auto`` server, whose planner picks each round's k from measured pass times and the acceptance of
    all requests, the same request sent alone at different times may answer differently. Shown with the k fixed
    two ways (as the planner may pick): the standard texts part, the invariant sampler's do not; a request that
    fixes its own speculation is reproducible with a drafter whose drafts follow the request alone. (Not with the
    hybrid, the default: its source and draft length each round come from a cost model that learns from measured
    times and, in a server, from every earlier request, so its standard texts follow those too.)"""
    server = start_server(tiny, drafter="prompt-lookup", max_batch_size=4)  # speculation auto, the default
    body = {"prompt": "w3 w4 w5 w3 w4 w5 w3 w4", "max_tokens": 24, "temperature": 1.0, "seed": 7, "ignore_eos": True,
            "speculation": "always"}

    def text(**extra):
        status, answer = post(server, "/v1/completions", {**body, **extra})
        assert status == 200, answer
        return answer["choices"][0]["text"]

    try:
        assert server.scheduler.planner.mode == "auto"
        assert text(sampling="standard", num_draft_tokens=1) != text(sampling="standard", num_draft_tokens=4)
        assert text(num_draft_tokens=1) == text(num_draft_tokens=4) == text(speculation="never")
        for mode in ("always", "never"):
            assert text(sampling="standard", speculation=mode) == text(sampling="standard", speculation=mode)
    finally:
        server.shutdown(timeout=5)


def test_graceful_shutdown_finishes_requests_in_flight_and_refuses_new_ones(tiny):
    gate = threading.Event()
    gate.set()
    server = start_server(tiny, proposer=lambda: GatedProposer(gate, delay=0.005), speculation="always")
    body = {"prompt": "w3 w4 w5", "max_tokens": 60, "ignore_eos": True, "stream_options": {"include_usage": True}}
    with ThreadPoolExecutor(4) as pool:
        in_flight = [pool.submit(stream, server, "/v1/completions", body) for _ in range(3)]
        assert wait_for(lambda: server.scheduler.running == 3)
        closing = pool.submit(server.shutdown, 30)
        assert wait_for(lambda: not server.scheduler.accepting)
        status, refused = post(server, "/v1/completions", {**body, "stream": True})
        assert status == 503 and "shutting down" in refused["error"]["message"]
        for future in in_flight:
            events = future.result()
            assert events[-1] == "[DONE]" and events[-3]["choices"][0]["finish_reason"] == "length"
            assert events[-2]["usage"]["completion_tokens"] == 60
        closing.result()


def test_shutdown_past_its_timeout_ends_requests_cleanly_with_abort(tiny):
    gate = threading.Event()
    gate.set()
    server = start_server(tiny, proposer=lambda: GatedProposer(gate, delay=0.02), speculation="always")
    with ThreadPoolExecutor(2) as pool:
        in_flight = pool.submit(stream, server, "/v1/completions", {"prompt": "w3", "max_tokens": 200,
                                                                    "ignore_eos": True})
        assert wait_for(lambda: server.scheduler.metrics.generation_tokens > 0)
        server.shutdown(timeout=0.1)
        events = in_flight.result()
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "abort"


# --- load and exactness --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("speculation", ["auto", "always"])
def test_200_requests_32_at_a_time_all_complete_and_match_plain_decoding(tiny, speculation):
    """Every response at temperature 0, decoded in a changing batch with speculation, is token for token the
    same request decoded alone without it; every request ends with its token count or a stop."""
    server = start_server(tiny, speculation=speculation, max_batch_size=16, max_waiting=64)
    rng = random.Random(0)
    requests = []
    for i in range(200):
        prompt = [rng.randrange(2, 64) for _ in range(rng.randrange(1, 12))]
        if i % 3 == 0:
            prompt = prompt * 3  # repetitive: prompt lookup drafts, and drafts get accepted
        requests.append({"prompt": prompt_text(prompt), "max_tokens": rng.randrange(1, 40), "temperature": 0,
                         "ignore_eos": i % 2 == 0, "stream": i % 4 == 1})

    def send(body):
        if body["stream"]:
            events = stream(server, "/v1/completions", body)
            text = "".join(e["choices"][0]["text"] for e in events[:-1])
            return text, events[-2]["choices"][0]["finish_reason"]
        status, answer = post(server, "/v1/completions", body)
        assert status == 200, answer
        return answer["choices"][0]["text"], answer["choices"][0]["finish_reason"]

    try:
        with ThreadPoolExecutor(32) as pool:
            answers = list(pool.map(send, requests))
    finally:
        server.shutdown(timeout=5)
    for body, (text, reason) in zip(requests, answers):
        expected = plain_greedy(tiny, ids_of(body["prompt"]), body["max_tokens"], body["ignore_eos"])
        assert ids_of(text) == visible(expected), body
        assert reason == ("stop" if expected[-1] == EOS and not body["ignore_eos"] else "length")
        assert reason == "stop" or len(expected) == body["max_tokens"]
    metrics = server.scheduler.metrics
    assert sum(metrics.finished.values()) == 200 and metrics.draft_tokens > 0
    assert metrics.drafter_errors == 0
