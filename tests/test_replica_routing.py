"""Prefix routing for ``exactspec serve --replicas N`` without Ray: a prompt's prefix keys, the affinity table that
sends a conversation's next turn where its last went, and the ingress's relay of an HTTP request to a replica's app
and back (tests/test_replicas.py runs them on Ray)."""

from __future__ import annotations

import asyncio
import json

from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from exactspec.bench.replicas import Turn, summarise
from exactspec.server.forwarding import Forwarder, asgi_messages
from exactspec.server.routing import (
    BLOCK_CHARACTERS,
    BLOCK_TOKENS,
    CHAT_PATH,
    COMPLETIONS_PATH,
    MAX_BLOCKS,
    PrefixAffinity,
    prefix_keys,
)
from exactspec.server.settings import ServerSettings

SYSTEM = {"role": "system", "content": "You are terse."}


def chat(*messages: dict) -> bytes:
    return json.dumps({"messages": list(messages), "max_tokens": 4}).encode()


def turn(i: int) -> list[dict]:
    """A conversation's messages up to its i-th user turn (answers in between)."""
    messages = [SYSTEM]
    for k in range(i):
        messages += [{"role": "user", "content": f"question {k}"}, {"role": "assistant", "content": f"answer {k}"}]
    return messages + [{"role": "user", "content": f"question {i}"}]


# --- the keys ---------------------------------------------------------------------------------------------------------


def test_a_chats_next_turn_opens_with_the_keys_of_the_last():
    first, second = prefix_keys(CHAT_PATH, chat(*turn(0))), prefix_keys(CHAT_PATH, chat(*turn(1)))
    assert len(first) == 2 and len(second) == 4  # a key a message
    assert second[:2] == first
    other = prefix_keys(CHAT_PATH, chat({"role": "system", "content": "You are verbose."}, *turn(1)[1:]))
    assert not set(other) & set(second)  # a key names all before it: another system prompt shares none
    assert prefix_keys(CHAT_PATH, json.dumps({"messages": turn(0), "temperature": 1}).encode()) == first


def test_a_text_or_token_prompt_is_read_in_whole_blocks():
    text = "".join(f"w{i} " for i in range(100))
    keys = prefix_keys(COMPLETIONS_PATH, json.dumps({"prompt": text}).encode())
    assert len(keys) == len(text) // BLOCK_CHARACTERS
    longer = prefix_keys(COMPLETIONS_PATH, json.dumps({"prompt": text + "and more"}).encode())
    assert longer[:len(keys)] == keys
    assert prefix_keys(COMPLETIONS_PATH, json.dumps({"prompt": text[:BLOCK_CHARACTERS - 1]}).encode()) == ()
    tokens = prefix_keys(COMPLETIONS_PATH, json.dumps({"prompt": list(range(5 * BLOCK_TOKENS + 3))}).encode())
    assert len(tokens) == 5
    huge = prefix_keys(COMPLETIONS_PATH, json.dumps({"prompt": "x" * BLOCK_CHARACTERS * (MAX_BLOCKS + 9)}).encode())
    assert len(huge) == MAX_BLOCKS


def test_a_body_without_a_readable_prompt_has_no_keys():
    for path, body in ((CHAT_PATH, b"{not json"), (CHAT_PATH, b"\xff\xfe"), (CHAT_PATH, b"[1, 2]"),
                       (CHAT_PATH, b'{"messages": "hi"}'), (COMPLETIONS_PATH, b'{"prompt": [1, "a"]}'),
                       (COMPLETIONS_PATH, b'{"prompt": null}'), (COMPLETIONS_PATH, b""), ("/v1/models", b"")):
        assert prefix_keys(path, body) == (), (path, body)


# --- the affinity -----------------------------------------------------------------------------------------------------


def test_the_next_turn_goes_where_the_last_went_and_new_conversations_spread():
    affinity = PrefixAffinity()
    loads = {"a": 0, "b": 0, "c": 0}
    firsts = []
    for conversation in range(3):  # three conversations opened one after another on idle replicas
        keys = prefix_keys(CHAT_PATH, chat({"role": "user", "content": f"conversation {conversation}"}))
        replica = affinity.preference(keys, loads)[0]
        affinity.routed(keys, replica)
        firsts.append((keys, replica))
    assert sorted(replica for _, replica in firsts) == ["a", "b", "c"]
    for keys, replica in firsts:
        follow_up = keys + ("answer", "next question")  # the next turn's keys open with the last turn's
        assert affinity.preference(follow_up, {"a": 1, "b": 1, "c": 1})[0] == replica


def test_a_holder_busier_than_the_least_loaded_by_more_than_the_margin_is_passed_over():
    affinity = PrefixAffinity(max_imbalance=2)
    affinity.routed(("k1", "k2"), "a")
    assert affinity.preference(("k1", "k2", "k3"), {"a": 2, "b": 0}) == ["a", "b"]
    assert affinity.preference(("k1", "k2", "k3"), {"a": 3, "b": 0}) == ["b", "a"]  # the least loaded first
    assert affinity.preference(("k1",), {"b": 0, "c": 0})[0] in ("b", "c")  # a replica gone is passed over


def test_the_longest_routed_prefix_wins_and_the_least_recent_keys_are_forgotten():
    affinity = PrefixAffinity(capacity=3)
    affinity.routed(("s",), "a")
    affinity.routed(("s", "t"), "b")  # the same opening, taken further, on b
    assert affinity.holder(("s", "t", "u"), {"a": 0, "b": 0}) == "b"
    assert affinity.holder(("s", "x"), {"a": 0, "b": 0}) == "b"  # s was last routed to b
    affinity.routed(("p", "q"), "a")  # four keys held: the least recently routed (s) goes
    assert affinity.holder(("s",), {"a": 0, "b": 0}) is None
    assert affinity.holder(("s", "t"), {"a": 0, "b": 0}) == "b"


# --- the relay --------------------------------------------------------------------------------------------------------


async def echo(request):
    body = await request.body()
    return JSONResponse({"bytes": len(body), "path": request.url.path}, headers={"X-Replica": "r1"})


async def pieces(request):
    async def chunks():
        for i in range(3):
            yield f"data: {i}\n\n"
            await asyncio.sleep(0)

    return StreamingResponse(chunks(), media_type="text/event-stream")


async def broken(request):
    raise RuntimeError("a bug")


REPLICA_APP = Starlette(routes=[Route("/echo", echo, methods=["POST", "GET"]), Route("/stream", pieces),
                               Route("/broken", broken)])


def exchange(app, path: str, body: bytes = b"", method: str = "POST", chunks: int = 1) -> list[dict]:
    """The messages an ASGI app sends for one request whose body comes in ``chunks`` pieces."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"",
             "headers": [(b"host", b"x"), (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2), "state": {"not": "forwarded"}}
    size = -(-len(body) // chunks) or 1
    incoming = [{"type": "http.request", "body": body[i:i + size], "more_body": i + size < len(body)}
                for i in range(0, max(len(body), 1), size)]
    sent = []

    async def receive():
        if incoming:
            return incoming.pop(0)
        await asyncio.get_running_loop().create_future()

    async def send(message):
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    return sent


def relay(seen: list | None = None) -> Forwarder:
    """The ingress's app over a replica app in the same process; ``seen`` collects what each request carried."""

    def open_stream(scope, body, keys):
        if seen is not None:
            seen.append((scope, body, keys))
        return asgi_messages(REPLICA_APP, scope, body)

    return Forwarder(open_stream, ServerSettings(max_body_bytes=1024))


def test_a_request_is_relayed_whole_with_its_keys_and_its_answer_comes_back_as_sent():
    seen = []
    body = chat(*turn(1))
    sent = exchange(relay(seen), "/echo", body, chunks=3)
    assert sent[0]["status"] == 200 and (b"x-replica", b"r1") in sent[0]["headers"]
    assert json.loads(sent[1]["body"]) == {"bytes": len(body), "path": "/echo"}
    scope, forwarded, keys = seen[0]
    assert forwarded == body and keys == () and "state" not in scope  # /echo is no prompt path: no keys
    exchange(relay(seen), CHAT_PATH, body)
    assert seen[1][2] == prefix_keys(CHAT_PATH, body)


def test_a_stream_stays_a_stream():
    sent = exchange(relay(), "/stream", method="GET")
    assert [m["type"] for m in sent] == ["http.response.start"] + ["http.response.body"] * 4
    assert b"".join(m.get("body", b"") for m in sent) == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"


def test_limits_and_failures_answer_openai_errors_never_a_traceback():
    too_big = exchange(relay(), "/echo", b"x" * 2000)
    assert too_big[0]["status"] == 413 and json.loads(too_big[1]["body"])["error"]["message"]
    assert exchange(relay(), "/broken", method="GET")[0]["status"] == 500  # the replica app's own error page

    def unreachable(scope, body, keys):
        raise RuntimeError("replica died")

    gone = exchange(Forwarder(unreachable, ServerSettings()), "/echo", b"{}")
    assert gone[0]["status"] == 503 and (b"retry-after", b"1") in gone[0]["headers"]
    assert "replica died" in json.loads(gone[1]["body"])["error"]["message"]


def test_with_an_api_key_a_request_without_it_is_refused_before_its_body_is_read():
    """The ingress checks the key as the server does (401 with an OpenAI error body), before it reads a byte of the
    body: a client without the key cannot make it hold a body of up to --max-body-bytes."""
    seen = []

    def open_stream(scope, body, keys):
        seen.append(body)
        return asgi_messages(REPLICA_APP, scope, body)

    refused = exchange(Forwarder(open_stream, ServerSettings(api_key="sesame")), "/echo", b"x" * 100, chunks=100)
    assert refused[0]["status"] == 401 and json.loads(refused[1]["body"])["error"]["code"] == "invalid_api_key"
    assert seen == []
    assert exchange(Forwarder(open_stream, ServerSettings(api_key="sesame")), "/health", method="GET")[0]["status"] \
        != 401


def test_a_caller_that_stops_reading_cancels_the_replicas_run():
    finished = []

    async def endless(scope, receive, send):
        try:
            await send({"type": "http.response.start", "status": 200, "headers": []})
            while True:
                await send({"type": "http.response.body", "body": b".", "more_body": True})
                await asyncio.sleep(0.001)
        finally:
            finished.append(True)

    async def read_two():
        stream = asgi_messages(endless, {"type": "http"}, b"")
        assert (await anext(stream))["type"] == "http.response.start"
        await anext(stream)
        await stream.aclose()
        await asyncio.sleep(0.01)

    asyncio.run(read_two())
    assert finished == [True]


def test_the_bench_counts_cached_over_the_last_turns_prompt_and_answer():
    def played(conversation, number, prompt, completion, cached, ttft, instance):
        return Turn(conversation, number, prompt, completion, cached, ttft, 2 * ttft, instance, "text")

    turns = [played(0, 0, 100, 10, 0, 1.0, "a"), played(0, 1, 130, 10, 99, 0.2, "a"),
             played(1, 0, 50, 16, 0, 0.8, "b"), played(1, 1, 60, 10, 20, 0.6, "a")]
    summary = summarise("prefix", turns, 10.0)
    assert (summary.cached_tokens, summary.reusable_tokens) == (119, 110 + 60)  # the least of prompt, last + answer
    assert summary.same_replica == 0.5 and summary.ttft_first_median == 0.9
    assert summary.ttft_later_median == 0.4 and abs(summary.ttft_later_p90 - 0.56) < 1e-9
