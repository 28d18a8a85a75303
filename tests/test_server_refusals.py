"""Refusals and lookups that real clients met (issue 60), on a tiny random model over the default model's vocabulary
and chat template, tokenized by llama.cpp as the default model is: a chat of many short messages refused at a cost
linear in its body, and ``GET /v1/models/{name}`` (the SDK's ``models.retrieve``) for names that hold ``/`` and
``:``."""

from __future__ import annotations

import http.client
import json
import time

import openai
import pytest
from test_structured_server import serve_gguf
from tiny_gguf import write_tiny_gguf

NAMES = ("tiny", "org/tiny:q4_1", "gpt-3.5-turbo")  # its own name, then aliases (--served-model-name)
CONTEXT = 512


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = write_tiny_gguf(tmp_path_factory.mktemp("refusals") / "tiny.gguf")
    server = serve_gguf(str(path), NAMES, max_batch_size=2, max_model_len=CONTEXT)
    yield server
    server.shutdown(timeout=5)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def exchange(server, method: str, path: str, body: bytes | None = None) -> tuple[int, dict, float]:
    """The status, the JSON body and the seconds from the request's first byte to the answer's last."""
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    start = time.perf_counter()
    connection.request(method, path, body=body, headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    answer = json.loads(response.read())
    seconds = time.perf_counter() - start
    connection.close()
    return response.status, answer, seconds


def refused_in(server, path: str, body: dict) -> float:
    """The best of three refusals' seconds, each a 400 ``context_length_exceeded``."""
    raw = json.dumps(body, separators=(",", ":")).encode()
    times = []
    for _ in range(3):
        status, answer, seconds = exchange(server, "POST", path, raw)
        assert status == 400 and answer["error"]["code"] == "context_length_exceeded", answer
        assert answer["error"]["param"] == ("messages" if "messages" in body else "prompt")
        times.append(seconds)
    return min(times)


def test_a_chat_of_many_short_messages_is_refused_at_a_cost_linear_in_its_body(server):
    """A chat of 30,000 messages of "hi" (930 KB) is refused no slower than a small multiple of a text prompt of
    1 MB, measured here alike: the refusal costs what the body's bytes do, not the square of its messages (19 s
    against 0.5 s before, as llama.cpp split the whole chat at its 60,000 special tokens in one call)."""
    text = refused_in(server, "/v1/completions", {"prompt": "hello world " * 85000, "max_tokens": 4})
    chat = refused_in(server, "/v1/chat/completions",
                      {"messages": [{"role": "user", "content": "hi"}] * 30000, "max_tokens": 4})
    assert chat <= 3 * text + 0.1, (chat, text)


def test_a_refusal_over_the_context_names_the_context(server):
    body = {"messages": [{"role": "user", "content": "hi"}] * 200, "max_tokens": 4}
    status, answer, _ = exchange(server, "POST", "/v1/chat/completions", json.dumps(body).encode())
    assert status == 400 and answer["error"]["type"] == "invalid_request_error"
    assert f"this model's context is {CONTEXT} tokens" in answer["error"]["message"], answer
    short = {"messages": [{"role": "user", "content": "hi"}] * 20, "max_tokens": CONTEXT}
    status, answer, _ = exchange(server, "POST", "/v1/chat/completions", json.dumps(short).encode())
    assert status == 400 and answer["error"]["param"] == "max_tokens", answer
    assert answer["error"]["code"] == "context_length_exceeded"


def test_the_sdk_retrieves_each_served_model_and_an_unknown_one_is_404_model_not_found(server, client):
    for name in NAMES:
        model = client.models.retrieve(name)
        assert (model.id, model.object, model.owned_by) == (name, "model", "exactspec")
    listed = {model.id: model.model_dump() for model in client.models.list()}
    assert [client.models.retrieve(name).model_dump() for name in NAMES] == [listed[name] for name in NAMES]
    for unknown in ("gpt-4", "org/tiny", "tiny:q4_1", "org/tiny:q4_1/extra"):
        with pytest.raises(openai.NotFoundError) as refused:
            client.models.retrieve(unknown)
        error = refused.value.body
        assert error["code"] == "model_not_found" and error["param"] == "model" and repr(unknown) in error["message"]


@pytest.mark.parametrize("path, name", [("/v1/models/tiny", "tiny"), ("/v1/models/org/tiny:q4_1", "org/tiny:q4_1"),
                                        ("/v1/models/org%2Ftiny%3Aq4_1", "org/tiny:q4_1"),
                                        ("/v1/models/gpt-3.5-turbo", "gpt-3.5-turbo")])
def test_a_served_name_is_found_over_raw_http_as_sent_or_percent_encoded(server, path, name):
    status, answer, _ = exchange(server, "GET", path)
    assert status == 200 and answer["id"] == name and answer["object"] == "model", answer
    assert answer["max_model_len"] == CONTEXT


@pytest.mark.parametrize("path", ["/v1/models/nope", "/v1/models/tiny/", "/v1/models/TINY", "/v1/models/%20tiny"])
def test_an_unknown_name_over_raw_http_is_404_model_not_found(server, path):
    status, answer, _ = exchange(server, "GET", path)
    assert status == 404 and answer["error"]["code"] == "model_not_found", answer
    assert answer["error"]["type"] == "invalid_request_error"


def test_models_with_a_trailing_slash_stays_an_unknown_path_and_other_methods_are_405(server):
    status, answer, _ = exchange(server, "GET", "/v1/models/")
    assert status == 404 and answer["error"]["message"] == "no such endpoint: /v1/models/", answer
    status, answer, _ = exchange(server, "POST", "/v1/models/tiny", b"{}")
    assert status == 405 and answer["error"]["type"] == "invalid_request_error", answer
