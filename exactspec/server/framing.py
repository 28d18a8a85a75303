"""HTTP framing that a proxy in front cannot read otherwise: uvicorn's httptools protocol (llhttp, strict) with
exactspec's refusals around it (:func:`http_protocol`), the checks before routing (:class:`Framing`), the answering
instance's header (:class:`InstanceHeader`), and a body read within its limits (:func:`read_body`). Every refusal
is an OpenAI error body with ``Connection: close``: nothing after it on the connection is read as a request.

Framing knows nothing of the app it guards: the server hands it its settings, its name (the instance header), the
check of a request's key (an :data:`Authorise`) and where refusals are counted (a :data:`CountRefusal`)."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import Callable
from http import HTTPStatus

from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect

from exactspec.server.page import PAGE_PATHS
from exactspec.server.protocol import ApiError, BadRequest
from exactspec.server.settings import ServerSettings

log = logging.getLogger("exactspec.server")
MAX_TARGET_BYTES = 65535  # the longest request target httptools' URL parser takes
OPEN_PATHS = frozenset({"/health", *PAGE_PATHS})  # answered without the API key: they hold no data

Authorise = Callable[[str], None]  # takes a request's Authorization header; raises ApiError (401) if it admits not
CountRefusal = Callable[[int], None]  # takes the HTTP status of each request refused


class ClientGone(Exception):
    """The client closed its connection."""


class JSON(JSONResponse):
    """JSON as the rest of exactspec writes it (json.dumps' own separators, UTF-8 as is)."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=False).encode()


def http_protocol(settings: ServerSettings, instance: bytes, count_refusal: CountRefusal):
    """uvicorn's httptools protocol (llhttp, strict: it refuses a length with a transfer encoding, a folded header
    line, a bad chunk size and bare LF line ends the moment it reads them) with three changes: its refusals are
    OpenAI error bodies, not plain text, and an unknown HTTP version is 505; a request head that has not ended
    ``head_timeout`` seconds after its first byte gets 408; and a head still arriving past ``max_head_bytes`` gets
    431 before the parser holds more of it. Each refusal closes the connection (nothing after it is read), names
    the ``instance`` like every response, and is counted (``count_refusal``)."""
    import httptools
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    target_limit = min(settings.max_head_bytes, MAX_TARGET_BYTES)

    class StrictHttpToolsProtocol(HttpToolsProtocol):
        _head_timer = None
        _refusal: ApiError | None = None
        _head_bytes: int | None = None  # bytes read while a head is unfinished, after the read it began in

        def data_received(self, data: bytes) -> None:
            self._unset_keepalive_if_required()
            try:
                self.parser.feed_data(data)
            except httptools.HttpParserUpgrade:  # no upgrade is served: the request is answered as it is, and
                if self.cycle is not None:  # llhttp reads nothing after its head, so the connection then closes
                    self.cycle.keep_alive = False
                return
            except httptools.HttpParserError as error:
                self._refuse(parser_refusal(error))
                return
            self._count_head(len(data))

        def on_url(self, url: bytes) -> None:  # the request target, a piece at a time
            super().on_url(url)
            if len(self.url) > target_limit:
                raise ApiError(f"the request target passes {target_limit} bytes, the most this server reads of "
                               "it (--max-head-bytes, at most 64 KiB)", status=431)  # ends the parse: a refusal

        def send_400_response(self, msg: str) -> None:
            self._refuse(BadRequest(f"the request's HTTP framing is invalid: {msg}"))

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._head_bytes = -1  # counted from the next read on
            self._head_timer = self.loop.call_later(settings.head_timeout, self._head_stalled)

        def on_headers_complete(self) -> None:
            self._head_ended()
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._head_ended()
            super().connection_lost(exc)

        def _count_head(self, read: int) -> None:
            if self._head_bytes is None:
                return
            self._head_bytes = 0 if self._head_bytes < 0 else self._head_bytes + read
            if self._head_bytes > settings.max_head_bytes:
                self._refuse(ApiError(f"the request's head passed {settings.max_head_bytes} bytes, the limit",
                                      status=431))

        def _head_ended(self) -> None:
            self._head_bytes = None
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_stalled(self) -> None:
            self._head_timer = None
            if self._head_bytes is not None and not self.transport.is_closing():
                self._refuse(ApiError(f"the request's head stalled for {settings.head_timeout:g} s", status=408))

        def on_response_complete(self) -> None:
            if self._refusal is None or self.pipeline:
                super().on_response_complete()
            elif not self.transport.is_closing():  # (a response that closed the connection ends it as well)
                self._write_refusal()

        def _refuse(self, error: ApiError) -> None:
            """Refuse once: at once, or after the whole requests read before it are answered (pipelined requests
            keep their order; nothing more is read meanwhile)."""
            self._head_ended()
            if self._refusal is not None:
                return
            self._refusal = error
            answering = self.cycle is not None and not self.cycle.response_complete
            if answering and not self.cycle.more_body:  # a whole request read before it: answer that first
                self.flow.pause_reading()
                return
            if answering:  # the refusal is in this request's own body: the request ends with it
                self.cycle.disconnected = True
                self.cycle.message_event.set()
            self._write_refusal()

        def _write_refusal(self) -> None:
            """The refusal as a whole response, written as bytes (the parser is in no state to frame one), then the
            connection closed."""
            error = self._refusal
            count_refusal(error.status)
            body = json.dumps(error.body()).encode()
            reason = HTTPStatus(error.status).phrase.encode()
            self.transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                                 b"x-exactspec-instance: %s\r\nconnection: close\r\n\r\n%s"
                                 % (error.status, reason, len(body), instance, body))
            self.transport.close()

    return StrictHttpToolsProtocol


def parser_refusal(error: Exception) -> ApiError:
    """llhttp's refusal as an OpenAI error: the refusal a callback raised; 400 for a target that is no URL; 505
    for a version it does not know; else 400 with llhttp's reason. Never llhttp's own word for a callback that
    raised ("User callback error")."""
    import httptools

    if isinstance(error, httptools.HttpParserCallbackError):  # what the callback raised is the reason
        cause = error.__context__
        if isinstance(cause, ApiError):
            return cause
        if isinstance(cause, httptools.HttpParserInvalidURLError):  # uvicorn parses the target once the head is read
            return BadRequest(f"the request target is not a valid URL: {cause}")
        log.error("reading a request's head failed", exc_info=cause)  # a fault of the server's, not the request's
        return ApiError(f"internal error reading the request's head: {cause!r}")
    reason = str(error).strip() or type(error).__name__
    if "HTTP version" in reason or "PRI" in reason:  # PRI: HTTP/2's connection preface
        return ApiError("the request's HTTP version is not served here: send HTTP/1.1 or HTTP/1.0", status=505)
    return BadRequest(f"the request's HTTP framing is invalid: {reason}")


def header(scope, name: bytes) -> str:
    """A request's header ``name`` (lower case), "" where it has none."""
    return next((value for key, value in scope["headers"] if key.lower() == name), b"").decode("latin-1")


def check_api_key(key: str | None, header: str | None) -> None:
    """Admit a request whose Authorization header carries the API key ``key``, or any where none is set; else 401."""
    if key is None:
        return
    scheme, _, given = (header or "").strip().partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):
        raise ApiError("a valid API key is required: Authorization: Bearer <key>", code="invalid_api_key", status=401)


class Framing:
    """What the HTTP parser lets through, refused before routing with an OpenAI error body and ``Connection:
    close`` (so that no byte after it on that connection is read as a request): an HTTP version other than 1.0 and
    1.1 (505); a header line or a head over the limits (431); HTTP/1.1 without Host, or a transfer coding other
    than chunked (400: a proxy in front could frame its body otherwise); and, with an API key set, any path but
    /health and the page's own files (which hold no data: the page asks for the key) without the key (401), whether
    the path exists or not: the one place the key is checked (by the server's ``authorize``, which admits any
    request where no key is set). (A length with a transfer encoding, or two lengths, never get here: llhttp
    refuses them, in this server's protocol and in Ray Serve's proxy alike.)"""

    def __init__(self, app, settings: ServerSettings, authorize: Authorise, count_refusal: CountRefusal) -> None:
        self.app, self.settings, self.authorize, self.count_refusal = app, settings, authorize, count_refusal

    async def __call__(self, scope, receive, send) -> None:
        refusal = self.refusal(scope) if scope["type"] == "http" else None
        if refusal is None:
            await self.app(scope, receive, send)
            return
        self.count_refusal(refusal.status)
        response = JSON(refusal.body(), status_code=refusal.status, headers={"Connection": "close"})
        await response(scope, receive, send)

    def refusal(self, scope) -> ApiError | None:
        settings = self.settings
        version = scope.get("http_version", "1.1")
        if version not in ("1.0", "1.1"):
            return ApiError(f"HTTP/{version} is not served here: send HTTP/1.1 or HTTP/1.0", status=505)
        headers = scope["headers"]
        longest = max((len(name) + 2 + len(value) for name, value in headers), default=0)
        if longest > settings.max_header_line:
            return ApiError(f"a header line has {longest} bytes; the limit is {settings.max_header_line}", status=431)
        query = scope.get("query_string") or b""
        target = len(scope.get("raw_path") or b"") + (len(query) + 1 if query else 0)  # the path, "?" and query
        head = target + sum(len(name) + 4 + len(value) for name, value in headers)
        if head > settings.max_head_bytes:
            return ApiError(f"the request's head has {head} bytes; the limit is {settings.max_head_bytes}",
                            status=431)
        names = [name.lower() for name, _ in headers]
        if version == "1.1" and b"host" not in names:
            return BadRequest("an HTTP/1.1 request must carry a Host header")
        codings = [value.strip().lower() for name, value in headers if name.lower() == b"transfer-encoding"]
        if codings and codings != [b"chunked"]:
            return BadRequest("the only transfer coding taken is chunked")
        if scope["path"] not in OPEN_PATHS:
            try:
                self.authorize(header(scope, b"authorization"))
            except ApiError as error:
                return error
        return None


class InstanceHeader:
    """Names the process that answered in every response (X-Exactspec-Instance): replicas tell themselves apart."""

    def __init__(self, app, value: bytes) -> None:
        self.app, self.value = app, value

    async def __call__(self, scope, receive, send) -> None:
        async def send_with_header(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-exactspec-instance", self.value)]}
            await send(message)

        await self.app(scope, receive, send_with_header if scope["type"] == "http" else send)


async def read_body(request, settings: ServerSettings) -> bytes:
    """The body, read as it arrives: 413 past the limit (declared or streamed), 408 if it stalls or, however it
    trickles, has not ended ``body_timeout`` seconds after it began."""
    declared = request.headers.get("Content-Length")
    if declared is not None and declared.isdigit() and int(declared) > settings.max_body_bytes:
        raise ApiError(f"the request body has {declared} bytes; the limit is {settings.max_body_bytes}", status=413)
    chunks, size = [], 0
    stream = request.stream().__aiter__()
    deadline = time.monotonic() + settings.body_timeout
    while True:
        wait = min(settings.read_timeout, deadline - time.monotonic())
        try:
            chunk = await asyncio.wait_for(stream.__anext__(), max(wait, 0.0))
        except StopAsyncIteration:
            break
        except ClientDisconnect:  # it left mid-body, or its framing was refused
            raise ClientGone from None
        except asyncio.TimeoutError:
            if wait < settings.read_timeout:
                raise ApiError(f"the request body did not end within {settings.body_timeout:g} s", status=408
                               ) from None
            raise ApiError(f"the request body stalled for {settings.read_timeout:g} s", status=408) from None
        size += len(chunk)
        if size > settings.max_body_bytes:
            raise ApiError(f"the request body passes the limit of {settings.max_body_bytes} bytes", status=413)
        chunks.append(chunk)
    return b"".join(chunks)
