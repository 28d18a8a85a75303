"""The server's HTTP framing over raw sockets: what a proxy in front could read otherwise is refused at the door, in
OpenAI's error shape, and the connection closed after it (issue 26)."""

from __future__ import annotations

import json
import socket
import time

import pytest
from test_server import get, raw_exchange, start_server, tiny  # noqa: F401  (tiny: the module's model fixture)

BODY = b'{"prompt": "w5 w9", "max_tokens": 2}'
CHUNKED = b"%x\r\n%s\r\n0\r\n\r\n" % (len(BODY), BODY)


@pytest.fixture(scope="module")
def server(tiny):  # noqa: F811
    server = start_server(tiny, drafter="prompt-lookup", speculation="always", read_timeout=1.5, head_timeout=1.5)
    yield server
    server.shutdown(timeout=5)


@pytest.fixture(scope="module")
def keyed_server(tiny):  # noqa: F811
    server = start_server(tiny, api_key="sesame")
    yield server
    server.shutdown(timeout=5)


def exchange(server, raw: bytes) -> bytes:
    """Everything the server answers ``raw`` on a new connection, waiting past its 1.5 s stall timeouts."""
    return raw_exchange(server, raw, wait=10.0)


def responses(received: bytes) -> list[tuple[int, dict, dict]]:
    """Each response's status, headers (lower-cased names) and JSON body, in order."""
    found = []
    while received.startswith(b"HTTP/1."):
        head, _, rest = received.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = dict((name.lower(), value.strip()) for name, _, value in (line.partition(":") for line in lines[1:]))
        length = int(headers.get("content-length", len(rest)))
        found.append((int(lines[0].split()[1]), headers, json.loads(rest[:length] or b"null")))
        received = rest[length:]
    return found


def post_head(*headers: str) -> bytes:
    return ("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + "".join(f"{header}\r\n" for header in headers) + "\r\n").encode()


def assert_one_refusal(received: bytes, status: int, words: str) -> None:
    """One response (no second request read from the connection), the status, OpenAI's error shape, and the
    connection closed after it."""
    answered = responses(received)
    assert len(answered) == 1, received
    code, headers, body = answered[0]
    assert code == status and headers.get("connection") == "close", received
    assert headers["content-type"].startswith("application/json") and words in body["error"]["message"], body
    assert set(body["error"]) == {"message", "type", "param", "code"} and "x-exactspec-instance" in headers


@pytest.mark.parametrize("headers", [(f"Content-Length: {len(CHUNKED)}", "Transfer-Encoding: chunked"),
                                     ("transfer-encoding: chunked", "content-length: 5")])
def test_a_length_and_a_transfer_encoding_together_are_refused(server, headers):
    assert_one_refusal(exchange(server, post_head(*headers) + CHUNKED), 400, "Content-Length")
    assert get(server, "/health")[0] == 200


def test_a_request_hidden_after_the_chunked_end_is_never_served(server):
    """The length covers a second request after the chunked body's end: a proxy trusting the length forwards one
    request, a parser following the chunks would read two. One answer, then the connection closes."""
    hidden = b"0\r\n\r\nGET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
    received = exchange(server, post_head(f"Content-Length: {len(hidden)}", "Transfer-Encoding: chunked") + hidden)
    assert_one_refusal(received, 400, "Content-Length")
    assert b'"object":"list"' not in received and b'"object": "list"' not in received


@pytest.mark.parametrize("raw, words", [
    (post_head("Content-Length: 5", "Content-Length: 6") + BODY, "Content-Length"),  # two lengths
    (post_head("Transfer-Encoding: gzip, chunked") + CHUNKED, "chunked"),  # a coding other than chunked alone
    (post_head("Transfer-Encoding: chunked") + b"zz\r\n" + BODY + b"\r\n0\r\n\r\n", "chunk size"),
    (post_head("Transfer-Encoding: chunked") + b"%x\n%s\n0\n\n" % (len(BODY), BODY), "CR"),  # bare LF chunk lines
    (post_head("X-Folded: a", " b", f"Content-Length: {len(BODY)}") + BODY, "whitespace"),  # obsolete line folding
    (b"GARBAGE\r\n\r\n", "method"),
    (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Bad: a\x00b\r\n\r\n", "header value char"),
    (b"GET /v1/models HTTP/1.1\r\n\r\n", "Host"),
])
def test_framing_the_parser_cannot_read_is_refused_at_once(server, raw, words):
    """Two lengths, a transfer coding other than chunked, a malformed chunk size, bare LF line ends in a chunked
    body, an obsolete folded header line, a garbage request line, a NUL in a header, HTTP/1.1 without Host: 400 in
    OpenAI's shape at once (well before the 1.5 s stall timeouts), and the connection closed. (Two equal lengths
    are one length: RFC 9112 lets a recipient merge them, and no reader can frame the body otherwise.)"""
    before = rejected(server, 400)
    started = time.monotonic()
    received = exchange(server, raw)
    assert time.monotonic() - started < 1.0, "refused only after a stall timeout"
    assert_one_refusal(received, 400, words)
    assert get(server, "/health")[0] == 200
    assert rejected(server, 400) == before + 1


def rejected(server, status: int) -> float:
    """exactspec_requests_rejected_total for one status, from /metrics."""
    label = f'exactspec_requests_rejected_total{{status="{status}"}} '
    return sum(float(line[len(label):]) for line in get(server, "/metrics")[1].splitlines() if line.startswith(label))


@pytest.mark.parametrize("raw", [b"GET /v1/models HTTP/2.0\r\nHost: x\r\n\r\n", b"GET /v1/models HTTP/0.9\r\n\r\n",
                                 b"GET /v1/models\r\n\r\n", b"GET /v1/models HTTP/3.0\r\nHost: x\r\n\r\n",
                                 b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"])  # HTTP/2's connection preface
def test_an_http_version_other_than_1_0_and_1_1_gets_505(server, raw):
    assert_one_refusal(exchange(server, raw), 505, "HTTP")
    assert get(server, "/health")[0] == 200


@pytest.mark.parametrize("upgrade", ["Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
                                     "HTTP2-Settings: AAMAAABkAAQAAP__",
                                     "Connection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\n"
                                     "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ=="])
def test_an_upgrade_is_answered_as_plain_http_and_the_connection_closes(server, upgrade):
    """No upgrade is served: the request itself is answered, and nothing after its head is read as a request."""
    request = f"GET /v1/models HTTP/1.1\r\nHost: x\r\n{upgrade}\r\n\r\n".encode()
    answered = responses(exchange(server, request + b"GET /nope HTTP/1.1\r\nHost: x\r\n\r\n"))
    assert len(answered) == 1 and answered[0][0] == 200 and answered[0][1]["connection"] == "close", answered
    assert answered[0][2]["object"] == "list"


def test_a_long_header_line_and_a_long_head_get_431(server):
    line = exchange(server, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Long: " + b"a" * (9 << 10) + b"\r\n\r\n")
    assert_one_refusal(line, 431, "header line")
    many = b"".join(b"X-Part-%d: %s\r\n" % (i, b"b" * (6 << 10)) for i in range(6))  # each line under 8 KiB
    assert_one_refusal(exchange(server, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + many + b"\r\n"), 431, "head")
    assert get(server, "/health")[0] == 200


@pytest.mark.parametrize("target", [b"/v1/models?" + b"q" * 40_000, b"/v1/models?" + b"q" * 70_000,
                                    b"/v1/models?" + b"q" * 300_000, b"/v1/" + b"p" * 40_000,
                                    b"/v1/models?" + b"q" * (31 << 10)])  # over the limit with the headers
def test_a_long_request_target_counts_in_the_head_limit_and_gets_431(server, target):
    """Issue 33: the query string was left out of the head's count (40,000 bytes of it answered 200), and past
    65,535 bytes of target httptools' URL parser failed inside a callback: 400 with llhttp's 'User callback error'.
    The whole target counts, sent in one read or in many."""
    padding = b"X-Pad: " + b"p" * 2000 + b"\r\n"
    request = b"GET " + target + b" HTTP/1.1\r\nHost: x\r\n" + padding + b"\r\n"
    assert_one_refusal(exchange(server, request), 431, "")
    assert b"callback" not in exchange(server, request)
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as connection:
        try:
            for start in range(0, len(request), 4096):  # a read at a time
                connection.sendall(request[start : start + 4096])
        except (BrokenPipeError, ConnectionResetError):
            pass
        received = b""
        try:
            while chunk := connection.recv(65536):
                received += chunk
        except (TimeoutError, ConnectionResetError):
            pass
    assert_one_refusal(received, 431, "")
    assert get(server, "/health")[0] == 200


def test_a_request_target_the_url_parser_refuses_is_400_in_its_own_words(server):
    """Not llhttp's 'User callback error': a port past 65535, which llhttp reads and uvicorn's parse of the target
    (once the head has ended) refuses."""
    received = exchange(server, b"GET http://x:99999/v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
    assert_one_refusal(received, 400, "not a valid URL")
    assert b"callback" not in received


@pytest.mark.parametrize("path", ["/v1/models/", "/health/", "/v1/chat/completions/", "/page/page.css/"])
def test_a_trailing_slash_is_an_unknown_path_never_a_redirect_to_the_clients_host(server, path):
    """Issue 33: Starlette's redirect_slashes answered ``GET /v1/models/`` with ``307 Location:
    http://evil.example/v1/models``, built from the client's Host header (behind a caching proxy, a poisoned
    cache). Now a 404 in OpenAI's error shape."""
    received = exchange(server, f"GET {path} HTTP/1.1\r\nHost: evil.example\r\nConnection: close\r\n\r\n".encode())
    [(status, headers, body)] = responses(received)
    assert status == 404 and "location" not in headers and b"evil.example" not in received, received
    assert body["error"]["message"] == f"no such endpoint: {path}" and body["error"]["type"] == "invalid_request_error"


def test_with_a_key_every_path_but_health_answers_401_without_it(keyed_server):
    for path in ("/nope", "/v1/models", "/metrics", "/v1/completions"):
        received = exchange(keyed_server, f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        assert_one_refusal(received, 401, "API key")
    assert get(keyed_server, "/health")[0] == 200
    with_key = exchange(keyed_server, b"GET /nope HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sesame\r\n"
                                      b"Connection: close\r\n\r\n")
    assert responses(with_key)[0][0] == 404


@pytest.mark.parametrize("raw, words", [
    (b"GET /v1/models HTTP/1.1\r\nHost: x\r\n", "head stalled"),  # the blank line never comes
    (post_head("Content-Length: 100") + BODY, "body stalled"),  # 63 bytes of 100
    (post_head("Transfer-Encoding: chunked") + b"%x\r\n%s" % (len(BODY) + 9, BODY), "body stalled"),  # chunk unfinished
])
def test_a_stalled_head_or_body_gets_408_and_the_connection_closes(server, raw, words):
    """(The server here waits 1.5 s; by default 20 s for a head, 30 s between a body's reads.)"""
    assert_one_refusal(exchange(server, raw), 408, words)
    assert get(server, "/health")[0] == 200


def test_a_head_still_arriving_past_the_limit_gets_431_before_it_ends(server):
    """Header lines each under 8 KiB, sent a read at a time and never ended: refused once the parser has held more
    than 32 KiB of one head, not left to grow until the head's timer."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as connection:
        connection.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")
        received = b""
        try:
            for i in range(64):  # 64 lines of 4 KiB: twice the limit
                connection.sendall(b"X-Part-%d: %s\r\n" % (i, b"c" * 4096))
                time.sleep(0.01)
        except (BrokenPipeError, ConnectionResetError):
            pass
        try:
            while chunk := connection.recv(65536):
                received += chunk
        except (TimeoutError, ConnectionResetError):
            pass
    assert_one_refusal(received, 431, "head")
    assert get(server, "/health")[0] == 200


def test_a_refusal_after_a_served_request_on_a_kept_alive_connection_ends_it(server):
    """A served request, then a smuggling attempt on the same connection: the first answered, the second refused,
    and nothing after it read."""
    served = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
    hidden = b"0\r\n\r\nGET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
    smuggled = post_head(f"Content-Length: {len(hidden)}", "Transfer-Encoding: chunked") + hidden
    answered = responses(exchange(server, served + smuggled))
    assert [status for status, _, _ in answered] == [200, 400], answered
    assert answered[1][1]["connection"] == "close"


def test_framing_stands_alone_on_the_authoriser_and_counter_it_is_handed():
    """Framing needs no server behind it: the key is checked by the authoriser it is handed (never for /health or
    the page), each refusal is counted by the counter it is handed, and what passes reaches the app unchanged."""
    import asyncio

    from exactspec.server.framing import Framing
    from exactspec.server.protocol import ApiError
    from exactspec.server.settings import ServerSettings

    checked, counted, reached = [], [], []

    def authorize(header: str) -> None:
        checked.append(header)
        if header != "Bearer sesame":
            raise ApiError("a valid API key is required", status=401)

    async def app(scope, receive, send) -> None:
        reached.append(scope["path"])

    framing = Framing(app, ServerSettings(), authorize, counted.append)

    def answer(path: str, *headers: tuple[bytes, bytes]) -> int | None:
        """The status framing answered (None: it let the request through)."""
        sent = []

        async def send(message) -> None:
            sent.append(message)

        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        scope = {"type": "http", "http_version": "1.1", "method": "GET", "path": path, "raw_path": path.encode(),
                 "query_string": b"", "headers": list(headers)}
        asyncio.run(framing(scope, receive, send))
        return next((m["status"] for m in sent if m["type"] == "http.response.start"), None)

    host = (b"host", b"x")
    assert answer("/v1/models", host) == 401 and checked == [""] and counted == [401] and reached == []
    assert answer("/v1/models", host, (b"Authorization", b"Bearer sesame")) is None and reached == ["/v1/models"]
    assert answer("/health", host) is None and len(checked) == 2 and reached[-1] == "/health"
    assert answer("/v1/models", (b"authorization", b"Bearer sesame")) == 400 and counted == [401, 400]  # no Host
