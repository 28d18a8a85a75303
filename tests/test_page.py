"""The live page's server side (issue 27), on a tiny random model: the page's files, the opt-in speculation
extension of the OpenAI stream, and the per-request speculation switch. The page in a real browser:
tests/test_page_browser.py."""

from __future__ import annotations

import http.client
import json
import re

import openai
import pytest
from test_server import MODEL, get, get_with_type, post, start_server, tiny  # noqa: F401  (tiny: the model fixture)

from exactspec.view import KIND_STYLES

REPETITIVE = "w3 w4 w5 w3 w4 w5 w3 w4 w5 w3 w4"  # prompt lookup drafts, and some drafts are accepted
KINDS = set(KIND_STYLES)


@pytest.fixture(scope="module")
def server(tiny):  # noqa: F811
    server = start_server(tiny, drafter="prompt-lookup", speculation="auto", num_draft_tokens=4)
    yield server
    server.shutdown(timeout=5)


def raw_stream(server, body: dict, path: str = "/v1/completions") -> bytes:
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    connection.request("POST", path, body=json.dumps({**body, "stream": True}),
                       headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200
    received = response.read()
    connection.close()
    return received


def chunks(received: bytes) -> list[dict]:
    events = [event[len(b"data: "):] for event in received.split(b"\n\n") if event.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    return [json.loads(event) for event in events[:-1]]


def request(speculation: str | None = None, include: bool = False, **extra) -> dict:
    body = {"prompt": REPETITIVE, "max_tokens": 24, "temperature": 0.8, "seed": 11, "ignore_eos": True,
            "stream_options": {"include_usage": True, **({"include_speculation": True} if include else {})}, **extra}
    if speculation is not None:
        body["speculation"] = speculation
    return body


# --- the page's files ----------------------------------------------------------------------------------------------


def test_the_page_and_its_files_are_served_with_a_policy_that_allows_nothing_from_elsewhere(server):
    status, content_type, html = get_with_type(server, "/")
    assert status == 200 and content_type.startswith("text/html")
    referenced = re.findall(r'(?:src|href)="([^"]+)"', html)
    assert set(referenced) == {"data:,", "page/page.css", "page/page.js"}  # no address outside the server
    for path, kind in (("/page/page.css", "text/css"), ("/page/page.js", "text/javascript")):
        status, content_type, text = get_with_type(server, path)
        assert status == 200 and content_type.startswith(kind) and text
    assert "http://" not in text and "https://" not in text  # the script fetches only relative paths
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    connection.request("GET", "/")
    policy = connection.getresponse().getheader("Content-Security-Policy")
    assert "default-src 'none'" in policy and "connect-src 'self'" in policy and "script-src 'self'" in policy
    assert get(server, "/page/../app.py")[0] == 404 and get(server, "/page/secret.txt")[0] == 404


def test_with_a_key_the_page_opens_and_everything_it_reads_asks_for_the_key(tiny):  # noqa: F811
    keyed = start_server(tiny, api_key="sesame")
    try:
        for path in ("/", "/page/page.js", "/page/page.css"):
            assert get(keyed, path)[0] == 200
        assert get(keyed, "/v1/speculation")[0] == 401
        status, text = get(keyed, "/v1/speculation", {"Authorization": "Bearer sesame"})
        assert status == 200 and json.loads(text)["model"] == MODEL
    finally:
        keyed.shutdown(timeout=5)


def test_the_page_is_told_what_the_server_offers(server):
    status, text = get(server, "/v1/speculation")
    offered = json.loads(text)
    assert status == 200 and offered["drafters"] == ["prompt-lookup"] and offered["speculation"] == "auto"
    assert offered["modes"] == ["auto", "always", "never"] and offered["num_draft_tokens"] == 4
    assert offered["kinds"] == {kind: {"colour": colour, "legend": legend}
                                for kind, (_, colour, legend) in KIND_STYLES.items()}


# --- the stream's extension ------------------------------------------------------------------------------------------


def without_ids(chunk: dict) -> dict:
    return {key: value for key, value in chunk.items() if key not in ("id", "created")}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_without_the_option_the_chunks_are_those_with_it_less_the_extension_byte_for_byte(server, path):
    """The same seeded request with and without include_speculation: drop the ``exactspec`` key and the chunks
    that carry no text (only rounds) from the one with it, and what is left is, byte for byte, the one without it
    (but for the answer's id and time)."""
    body = request("always")
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": body.pop("prompt")}]
    plain = raw_stream(server, body, path)
    extended = chunks(raw_stream(server, {**body, "stream_options": {"include_usage": True,
                                                                       "include_speculation": True}}, path))
    assert b'"exactspec"' not in plain
    kept = []
    for chunk in extended:
        extension = chunk.pop("exactspec", None)
        choice = chunk["choices"][0] if chunk["choices"] else {}
        only_rounds = extension is not None and choice["finish_reason"] is None and \
            not (choice.get("text") or choice.get("delta", {}).get("content"))
        if not only_rounds:
            kept.append(chunk)
    plain_chunks = chunks(plain)
    assert [without_ids(c) for c in kept] == [without_ids(c) for c in plain_chunks]
    answer_id, created = plain_chunks[0]["id"], plain_chunks[0]["created"]
    rebuilt = b"".join(b"data: " + json.dumps({**c, "id": answer_id, "created": created}, ensure_ascii=False).encode()
                       + b"\n\n" for c in kept) + b"data: [DONE]\n\n"
    assert rebuilt == plain


def test_each_chunk_says_how_its_text_came_and_the_totals_are_the_servers(server):
    received = chunks(raw_stream(server, request("always", include=True)))
    *answer, usage_chunk = received
    usage = usage_chunk["usage"]
    tokens, rounds = [], []
    for chunk in answer:
        extension = chunk["exactspec"]
        assert "".join(t["text"] for t in extension["tokens"]) == chunk["choices"][0]["text"]
        tokens += extension["tokens"]
        rounds += extension["rounds"]
    assert {t["kind"] for t in tokens} <= KINDS and {"accepted", "recovered"} & {t["kind"] for t in tokens}
    summary = answer[-1]["exactspec"]["summary"]
    assert summary == {"speculation": "always", "completion_tokens": usage["completion_tokens"],
                       "draft_tokens": usage["speculation"]["draft_tokens"],
                       "accepted_tokens": usage["speculation"]["accepted_tokens"], "target_passes": len(rounds)}
    assert sum(r["tokens"] for r in rounds) == usage["completion_tokens"] == 24
    assert sum(r["k"] for r in rounds) == usage["speculation"]["draft_tokens"] > 0
    assert sum(r["accepted"] for r in rounds) == usage["speculation"]["accepted_tokens"] > 0
    assert all(0 <= r["accepted"] <= r["k"] <= 4 and r["accepted"] < r["tokens"] <= r["k"] + 1 for r in rounds)
    assert sum(t["kind"] == "accepted" for t in tokens) <= usage["speculation"]["accepted_tokens"]  # a piece may be ""


def test_the_openai_client_parses_the_extended_chunks(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": REPETITIVE}], max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True, "include_speculation": True}, extra_body={"ignore_eos": True})
    text, pieces = "", ""
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            extension = chunk.model_extra.get("exactspec", {"tokens": []})  # the first chunk (the role) has none
            pieces += "".join(t["text"] for t in extension["tokens"])
    assert text and pieces == text and chunk.usage.completion_tokens == 12


# --- the per-request speculation switch -------------------------------------------------------------------------------


def totals(server, body: dict) -> dict:
    status, answer = post(server, "/v1/completions", {**body, "stream": False, "stream_options": None})
    assert status == 200, answer
    return answer


def test_a_request_asks_for_speculation_never_auto_or_always_and_gets_the_same_sample(server):
    """Seeded sampling is drafter-invariant: the three modes give one text; never scores no draft token, always
    scores every token it is offered."""
    answers = {mode: totals(server, request(mode)) for mode in ("never", "auto", "always")}
    assert answers["never"]["usage"]["speculation"]["draft_tokens"] == 0
    assert answers["always"]["usage"]["speculation"]["draft_tokens"] > 0
    assert len({a["choices"][0]["text"] for a in answers.values()}) == 1


def test_num_draft_tokens_bounds_each_round(server):
    received = chunks(raw_stream(server, request("always", include=True, num_draft_tokens=1)))
    rounds = [r for chunk in received[:-1] for r in chunk["exactspec"]["rounds"]]
    assert max(r["k"] for r in rounds) == 1


@pytest.mark.parametrize("extra, param, words", [
    ({"speculation": "sometimes"}, "speculation", "'auto', 'always' or 'never'"),
    ({"num_draft_tokens": 5}, "num_draft_tokens", "at most 4"),
    ({"num_draft_tokens": 0}, "num_draft_tokens", "greater than or equal to 1"),
    ({"stream_options": {"include_speculation": "yes"}}, "stream_options.include_speculation", "boolean"),
])
def test_what_the_server_does_not_offer_is_a_400_naming_it(server, extra, param, words):
    status, answer = post(server, "/v1/completions", {"prompt": "w3", "max_tokens": 2, **extra})
    assert status == 400 and answer["error"]["param"] == param and words in answer["error"]["message"], answer


def test_a_server_that_never_speculates_offers_only_never(tiny):  # noqa: F811
    plain = start_server(tiny, speculation="never")
    try:
        assert json.loads(get(plain, "/v1/speculation")[1])["modes"] == ["never"]
        status, answer = post(plain, "/v1/completions", {"prompt": "w3", "max_tokens": 2, "speculation": "always"})
        assert status == 400 and answer["error"]["param"] == "speculation"
        assert "--speculation never" in answer["error"]["message"] and "ask for never" in answer["error"]["message"]
        assert post(plain, "/v1/completions", {"prompt": "w3", "max_tokens": 2, "speculation": "never"})[0] == 200
    finally:
        plain.shutdown(timeout=5)
