"""Refusals that real clients met (issue 60), on a tiny random model over the default model's vocabulary and chat
template, tokenized by llama.cpp as the default model is: a chat of many short messages refused at a cost linear in
its body."""

from __future__ import annotations

import http.client
import json
import time

import pytest
from tiny_gguf import write_tiny_gguf

from exactspec.loading import load_target
from exactspec.server import BatchSettings, build_scheduler
from exactspec.server.app import OpenAIServer, ServerSettings

NAMES = ("tiny", "org/tiny:q4_1", "gpt-3.5-turbo")  # its own name, then aliases (--served-model-name)
CONTEXT = 512


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = write_tiny_gguf(tmp_path_factory.mktemp("refusals") / "tiny.gguf")
    loaded = load_target(str(path), drafters=("prompt-lookup",), backend="fused")
    settings = BatchSettings(drafter="prompt-lookup", max_batch_size=2, max_model_len=CONTEXT)
    server = OpenAIServer(build_scheduler(loaded.runtime, settings, loaded.stop_ids), loaded.target.tokenizer,
                          NAMES, ServerSettings(port=0))
    server.start()
    yield server
    server.shutdown(timeout=5)


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

