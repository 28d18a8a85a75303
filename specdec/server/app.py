"""The HTTP side of ``specdec serve``: OpenAI's endpoints over the scheduler, on FastAPI and uvicorn.

The HTTP layer is a thin shell: it reads and checks a request (:mod:`specdec.server.protocol`), submits it to the
scheduler, and writes what comes back, whole or as server-sent events. The scheduler's own thread runs every
request's steps and hands each request's events to the event loop. uvicorn's httptools protocol (llhttp, strict)
frames every request, with specdec's refusals around it (``_http_protocol``, ``_Framing``): a request a proxy in
front could frame otherwise is refused and its connection closed, never read past.

Refusals are OpenAI error bodies: 400 for a bad request, 401 without the API key, 404 for an unknown path, 405 for
a wrong method, 408 for a head or body that stalls or a body that takes too long in all, 413 for a body over the
limit, 429 (with Retry-After) when the waiting queue is full, 431 for a head over the limits, 503 while shutting
down or when the scheduler has stopped serving, 505 for an HTTP version other than 1.0 and 1.1.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import socket
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from functools import partial
from http import HTTPStatus
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from specdec.errors import UsageError
from specdec.server import BatchSettings, build_scheduler
from specdec.server.metrics import MetricsCollector
from specdec.server.protocol import (
    ApiError,
    BadRequest,
    ChatCompletionRequest,
    CompletionRequest,
    Job,
    Response,
    TokenLogprob,
    logprobs_payload,
    parse_body,
    parse_job,
    usage,
)
from specdec.server.scheduler import Finished, Handle, NotOffered, QueueFull, Scheduler, ShuttingDown, Tokens
from specdec.server.stops import StopText
from specdec.view import KIND_STYLES

log = logging.getLogger("specdec.server")
POLL_SECONDS = 0.25  # how often a waiting request checks that its client is still there
STALL_SECONDS = 300.0  # /health answers 503 when requests have waited this long without a step finishing
RETRY_AFTER_SECONDS = 1
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
MAX_TARGET_BYTES = 65535  # the longest request target httptools' URL parser takes
FINISH_REASONS = {"stop": "stop", "length": "length", "cancelled": "stop", "abort": "abort"}


@dataclass(frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # checked on every endpoint but /health
    max_body_bytes: int = 1 << 20
    read_timeout: float = 30.0  # seconds a request body may stall between reads: 408 after
    body_timeout: float = 120.0  # seconds a request body may take in all, from the end of its head: 408 after
    head_timeout: float = 20.0  # seconds a request head may take from its first byte to its last: 408 after
    max_header_line: int = 8 << 10  # bytes of one header line (name, ": ", value): 431 above
    max_head_bytes: int = 32 << 10  # bytes of the request line and headers together: 431 above
    stall_seconds: float = STALL_SECONDS


class ClientGone(Exception):
    """The client closed its connection."""


class OpenAIServer:
    """OpenAI-compatible endpoints for one model, served by a scheduler."""

    def __init__(self, scheduler: Scheduler, tokenizer, model_name: str, settings: ServerSettings = ServerSettings(),
                 listen: bool = True, sock: socket.socket | None = None) -> None:
        """``listen=False``: the app alone, for another server to run (a Ray Serve replica); no socket. ``sock``: a
        socket already bound and listening (``bind``), else one is bound here."""
        import uvicorn

        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.settings = settings
        self.created = int(time.time())
        self.instance = f"{socket.gethostname()}:{os.getpid()}"  # which process answered (X-Specdec-Instance)
        self.app = build_app(self)
        self.socket = (sock or _listen(settings.host, settings.port)) if listen else None
        protocol = _http_protocol(self)
        self.uvicorn = uvicorn.Server(uvicorn.Config(self.app, http=protocol, ws="none", lifespan="off",
                                                     log_level="warning", access_log=False, timeout_keep_alive=30,
                                                     timeout_graceful_shutdown=5))
        self._serving: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int]:
        return self.socket.getsockname()[:2]

    @property
    def port(self) -> int:
        return self.address[1]

    @property
    def url(self) -> str:
        return f"http://{self.settings.host}:{self.port}"

    def start(self) -> None:
        self.scheduler.start()
        self._serving = threading.Thread(target=self.uvicorn.run, kwargs={"sockets": [self.socket]},
                                         name="specdec-http", daemon=True)
        self._serving.start()
        deadline = time.monotonic() + 30
        while not self.uvicorn.started and self._serving.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Refuse new requests (503), let those in flight finish for up to ``timeout`` seconds, end the rest with
        finish reason "abort", give their connections a moment to write it, and close."""
        self.scheduler.shutdown(timeout)
        time.sleep(2 * POLL_SECONDS)
        self.uvicorn.should_exit = True
        if self._serving is not None:
            self._serving.join(timeout=10)
        if self.socket is not None:
            self.socket.close()

    # --- what the endpoints do ------------------------------------------------------------------------------------

    def health(self) -> tuple[int, dict]:
        if not self.scheduler.accepting:
            return 503, {"status": "shutting down"}
        stalled = self.scheduler.stalled(self.settings.stall_seconds)
        if stalled:
            return 503, {"status": "stalled", "reason": stalled}
        return 200, {"status": "ok"}

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "specdec", "max_model_len": self.scheduler.max_length}]}

    def speculation(self) -> dict:
        """What the page needs to offer a request's settings: the drafter, the server's speculation mode, the modes
        a request may ask for, the most draft tokens per round, and each token kind's colour and legend."""
        scheduler = self.scheduler
        return {"model": self.model_name, "drafters": [scheduler.drafter] if scheduler.drafter else [],
                "speculation": scheduler.planner.mode, "modes": list(scheduler.planner.modes),
                "num_draft_tokens": scheduler.max_draft_tokens, "max_model_len": scheduler.max_length,
                "kinds": {kind: {"colour": colour, "legend": legend}
                          for kind, (_, colour, legend) in KIND_STYLES.items()}}

    def authorize(self, header: str | None) -> None:
        key = self.settings.api_key
        if key is None:
            return
        scheme, _, given = (header or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):
            raise ApiError("a valid API key is required: Authorization: Bearer <key>", code="invalid_api_key",
                           status=401)

    def prompt_ids(self, job: Job) -> list[int]:
        ids = self._encoded(job)
        if not ids:
            raise BadRequest("the prompt encodes to no tokens", "messages" if job.chat else "prompt")
        return ids

    def _encoded(self, job: Job) -> list[int]:
        if job.chat:
            from specdec.models import chat_prompt_ids

            try:
                return chat_prompt_ids(self.tokenizer, job.prompt)
            except Exception as error:  # the template's own checks (roles, order) raise their own errors
                raise BadRequest(f"the chat template refused these messages: {error}", "messages") from None
        if isinstance(job.prompt, str):
            return list(self.tokenizer.encode(job.prompt))
        vocab = self.scheduler.pool.vocab_size
        if not all(0 <= t < vocab for t in job.prompt):
            raise BadRequest(f"prompt token ids must be in [0, {vocab})", "prompt")
        return list(job.prompt)

    def submit(self, job: Job, prompt_ids: list[int]) -> list[Handle]:
        """One handle per choice; all or none (a refusal cancels those already queued)."""
        stop = partial(StopText, self.tokenizer, job.stop) if job.stop else None  # the scheduler's, per choice
        requests = [job.generation_request(prompt_ids, self.scheduler.max_length, i, stop) for i in range(job.n)]
        handles: list[Handle] = []
        try:
            for request in requests:
                handles.append(self.scheduler.submit(request))
        except (NotOffered, QueueFull, ShuttingDown) as error:
            for handle in handles:
                handle.cancel()
            if isinstance(error, NotOffered):  # the first choice's, before any is queued: all choices ask alike
                raise BadRequest(str(error), error.param) from None
            if isinstance(error, QueueFull):
                raise ApiError(f"the server is at capacity: {error}; retry later", status=429) from None
            raise ApiError(str(error), status=503) from None
        return handles


@dataclass(frozen=True)
class ServerOptions:
    """What a server loads and how it serves: one process's, or each Ray Serve replica's."""

    model: str | None = None
    batch: BatchSettings = field(default_factory=BatchSettings)
    settings: ServerSettings = field(default_factory=ServerSettings)
    datastore: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    served_model_name: str | None = None
    backend: str = "auto"
    threads: int | None = None


def load_server(options: ServerOptions, listen: bool = True) -> OpenAIServer:
    """Claim the port, then load the model (checks first, the slow load last); ``start()`` the server to serve
    (``listen=False``: the app alone, for Ray Serve to run, and no port). A busy port is refused in one line before
    anything slow."""
    from specdec.backends import target_backend
    from specdec.loading import load_target
    from specdec.models import eos_token_ids

    settings = options.settings
    sock = bind(settings) if listen else None
    try:
        loaded = load_target(options.model, dtype=options.dtype, device=options.device, backend=options.backend,
                             threads=options.threads, datastore=options.datastore, drafters=(options.batch.drafter,))
        runtime = target_backend(loaded.target, loaded.precision)
        scheduler = build_scheduler(runtime, options.batch, eos_token_ids(loaded.target), loaded.datastore)
    except BaseException:
        if sock is not None:
            sock.close()
        raise
    model = options.model
    file_name = DEFAULT_MODEL_NAME if model is None else Path(model).name.removesuffix(".gguf")
    name = options.served_model_name or file_name
    return OpenAIServer(scheduler, loaded.target.tokenizer, name, settings, listen=listen, sock=sock)


def bind(settings: ServerSettings) -> socket.socket:
    """The server's listening socket, or one line saying why the port cannot be had."""
    try:
        return _listen(settings.host, settings.port)
    except OSError as error:
        raise UsageError(f"cannot listen on {settings.host}:{settings.port}: {error.strerror or error}") from None


def wait_for_signal() -> None:
    """Block until SIGINT or SIGTERM: the server's run, from start to drain."""
    import signal

    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    stop.wait()


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(1024)  # the backlog: a small one resets connections under a burst of clients
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


# --- the FastAPI application -----------------------------------------------------------------------------------------


class _JSON(JSONResponse):
    """JSON as the rest of specdec writes it (json.dumps' own separators, UTF-8 as is)."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=False).encode()


def build_app(server: OpenAIServer) -> FastAPI:
    app = FastAPI(title="specdec", summary="OpenAI-compatible completions with exact speculative decoding",
                  docs_url=None, redoc_url=None, default_response_class=_JSON,
                  redirect_slashes=False)  # Starlette's redirect is built from the client's Host header: 404 instead
    metrics = server.scheduler.metrics
    registry = CollectorRegistry()  # this server's, not the process-wide default: a process may hold several
    registry.register(MetricsCollector(metrics, lambda: (server.scheduler.running, server.scheduler.waiting)))
    app.add_middleware(_Framing, server=server)
    app.add_middleware(_InstanceHeader, value=server.instance.encode())  # outermost: on _Framing's refusals too

    def error_response(error: ApiError) -> JSONResponse:
        metrics.observe_rejection(error.status)
        headers = {"Retry-After": str(RETRY_AFTER_SECONDS)} if error.status == 429 else {}
        if error.status in (408, 413):
            headers["Connection"] = "close"  # the body was left unread
        return _JSON(error.body(), status_code=error.status, headers=headers)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError):
        return error_response(error)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException):
        if error.status_code == 405:
            allowed = error.headers.get("Allow", "") if error.headers else ""
            return error_response(ApiError(f"{request.url.path} answers {allowed}, not {request.method}",
                                           status=405))
        if error.status_code == 404:
            return error_response(ApiError(f"no such endpoint: {request.url.path}", status=404))
        return error_response(ApiError(str(error.detail), status=error.status_code))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError):
        return error_response(BadRequest(f"bad request: {error.errors()[0].get('msg', error)}"))

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, error: ClientGone):
        return PlainTextResponse("", status_code=499)  # nobody reads it

    @app.exception_handler(Exception)
    async def internal_error(request: Request, error: Exception):  # a bug: one line to the client, the log keeps it
        log.exception("request failed")
        return error_response(ApiError(f"internal error: {error}"))

    @app.get("/health")
    async def health():
        status, body = server.health()
        return _JSON(body, status_code=status)

    @app.get("/v1/models")
    async def models():
        return server.models()

    @app.get("/v1/speculation")
    async def speculation():
        return server.speculation()

    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    async def page():
        return _page_file("index.html")

    @app.api_route("/page/{name}", methods=["GET", "HEAD"], include_in_schema=False)
    async def page_asset(name: str):
        return _page_file(name)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus():
        return PlainTextResponse(generate_latest(registry), media_type=CONTENT_TYPE_PLAIN_0_0_4)  # the format it writes

    async def generate(request: Request, chat: bool):
        raw = await _read_body(request, server.settings)
        job = parse_job(parse_body(raw), chat, server.model_name, server.scheduler.pool.vocab_size)
        prompt_ids = server.prompt_ids(job)
        handles = server.submit(job, prompt_ids)
        answers = [_Answer(job, handle, server.tokenizer, i) for i, handle in enumerate(handles)]
        response = Response(chat, server.model_name)
        echoed = _echo(job, server.tokenizer, prompt_ids)
        if job.stream:
            return StreamingResponse(_stream(answers, response, len(prompt_ids), echoed),
                                     headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                              "Connection": "close"})
        try:
            await _collect(answers, request)
        finally:
            for answer in answers:
                answer.handle.cancel()  # frees a slot still held (a client gone)
        failed = next((a for a in answers if a.error), None)
        if failed is not None:
            raise ApiError(failed.error, status=failed.error_status)
        choices = [response.choice(a.index, echoed + a.text, a.finish_reason, a.logprobs(chat, len(echoed)))
                   for a in answers]
        return response.whole(choices, _usage(answers, len(prompt_ids)))

    @app.post("/v1/completions", openapi_extra=_body_schema(CompletionRequest))
    async def completions(request: Request):
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions", openapi_extra=_body_schema(ChatCompletionRequest))
    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    _add_schemas(app, CompletionRequest, ChatCompletionRequest)
    return app


def _http_protocol(server: OpenAIServer):
    """uvicorn's httptools protocol (llhttp, strict: it refuses a length with a transfer encoding, a folded header
    line, a bad chunk size and bare LF line ends the moment it reads them) with three changes: its refusals are
    OpenAI error bodies, not plain text, and an unknown HTTP version is 505; a request head that has not ended
    ``head_timeout`` seconds after its first byte gets 408; and a head still arriving past ``max_head_bytes`` gets
    431 before the parser holds more of it. Each refusal closes the connection (nothing after it is read), names
    the instance like every response, and is counted in the server's metrics."""
    import httptools
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    settings = server.settings
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
                self._refuse(_parser_refusal(error))
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
            server.scheduler.metrics.observe_rejection(error.status)
            body = json.dumps(error.body()).encode()
            reason = HTTPStatus(error.status).phrase.encode()
            self.transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                                 b"x-specdec-instance: %s\r\nconnection: close\r\n\r\n%s"
                                 % (error.status, reason, len(body), server.instance.encode(), body))
            self.transport.close()

    return StrictHttpToolsProtocol


def _parser_refusal(error: Exception) -> ApiError:
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


class _Framing:
    """What the HTTP parser lets through, refused before routing with an OpenAI error body and ``Connection:
    close`` (so that no byte after it on that connection is read as a request): an HTTP version other than 1.0 and
    1.1 (505); a header line or a head over the limits (431); HTTP/1.1 without Host, or a transfer coding other
    than chunked (400: a proxy in front could frame its body otherwise); and, with an API key set, any path but
    /health and the page's own files (which hold no data: the page asks for the key) without the key (401), whether
    the path exists or not: the one place the key is checked. (A length with a transfer encoding, or two lengths,
    never get here: llhttp refuses them, in this server's protocol and in Ray Serve's proxy alike.)"""

    def __init__(self, app, server: OpenAIServer) -> None:
        self.app, self.server = app, server

    async def __call__(self, scope, receive, send) -> None:
        refusal = self.refusal(scope) if scope["type"] == "http" else None
        if refusal is None:
            await self.app(scope, receive, send)
            return
        self.server.scheduler.metrics.observe_rejection(refusal.status)
        response = _JSON(refusal.body(), status_code=refusal.status, headers={"Connection": "close"})
        await response(scope, receive, send)

    def refusal(self, scope) -> ApiError | None:
        settings = self.server.settings
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
        if settings.api_key is not None and scope["path"] != "/health" and scope["path"] not in PAGE_PATHS:
            authorization = next((value for name, value in headers if name.lower() == b"authorization"), b"")
            try:
                self.server.authorize(authorization.decode("latin-1"))
            except ApiError as error:
                return error
        return None


class _InstanceHeader:
    """Names the process that answered in every response (X-Specdec-Instance): replicas tell themselves apart."""

    def __init__(self, app, value: bytes) -> None:
        self.app, self.value = app, value

    async def __call__(self, scope, receive, send) -> None:
        async def send_with_header(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-specdec-instance", self.value)]}
            await send(message)

        await self.app(scope, receive, send_with_header if scope["type"] == "http" else send)


PAGE = Path(__file__).with_name("page")  # the live page: one HTML file, its CSS and its script
PAGE_FILES = {"index.html": "text/html; charset=utf-8", "page.css": "text/css; charset=utf-8",
              "page.js": "text/javascript; charset=utf-8"}
PAGE_PATHS = {"/", *(f"/page/{name}" for name in PAGE_FILES if name != "index.html")}  # open without the key
PAGE_HEADERS = {  # nothing from elsewhere: no script, style, image or connection but the server's own
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                               "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"}


def _page_file(name: str) -> FileResponse:
    """One of the page's files, or 404."""
    if name not in PAGE_FILES:
        raise ApiError(f"the page has no file {name!r}", status=404)
    return FileResponse(PAGE / name, media_type=PAGE_FILES[name], headers=PAGE_HEADERS)


def _body_schema(model) -> dict:
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def _add_schemas(app, *models) -> None:
    """Put the request bodies' JSON schemas (and those they refer to) into the OpenAPI document's components."""
    from fastapi.openapi.utils import get_openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            document = get_openapi(title=app.title, version="1", summary=app.summary, routes=app.routes)
            schemas = document.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
                schemas.update(schema.pop("$defs", {}))
                schemas[model.__name__] = schema
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi


async def _read_body(request, settings: ServerSettings) -> bytes:
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


def _echo(job: Job, tokenizer, prompt_ids: list[int]) -> str:
    """The prompt's text, which echo puts before a completion's text."""
    if not job.echo:
        return ""
    return job.prompt if isinstance(job.prompt, str) else tokenizer.decode(prompt_ids)


def _usage(answers: list[_Answer], prompt_tokens: int) -> dict:
    return usage(prompt_tokens, sum(a.completion_tokens for a in answers), sum(a.draft_tokens for a in answers),
                 sum(a.accepted_tokens for a in answers))


async def _events(answers: list[_Answer]) -> AsyncIterator[tuple[_Answer, Tokens | Finished]]:
    """Every choice's events, as the scheduler hands them over, until each has finished."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    def deliverer(answer: _Answer):
        def deliver(event: Tokens | Finished) -> None:  # on the scheduler's thread
            try:
                loop.call_soon_threadsafe(queue.put_nowait, (answer, event))
            except RuntimeError:  # the loop has closed: nobody waits for this answer any more
                pass

        return deliver

    for answer in answers:
        answer.handle.listen(deliverer(answer))
    open_ = len(answers)
    while open_:
        answer, event = await queue.get()
        if isinstance(event, Finished):
            open_ -= 1
        yield answer, event


async def _collect(answers: list[_Answer], request) -> None:
    """Wait for every choice to finish, checking every POLL_SECONDS that the client is still there."""
    events = _events(answers)
    pending = asyncio.ensure_future(events.__anext__())
    try:
        while True:
            done, _ = await asyncio.wait({pending}, timeout=POLL_SECONDS)
            if not done:
                if await request.is_disconnected():
                    raise ClientGone
                continue
            try:
                answer, event = pending.result()
            except StopAsyncIteration:
                return
            answer.take(event)
            pending = asyncio.ensure_future(events.__anext__())
    finally:
        pending.cancel()


async def _stream(answers: list[_Answer], response: Response, prompt_tokens: int, echoed: str
                  ) -> AsyncIterator[bytes]:
    """Server-sent events: a role delta (chat) or the echoed prompt first, the text as it becomes final, each
    choice's finish, usage if asked, then [DONE]. A client that leaves cancels this generator, which cancels the
    requests."""
    try:
        for answer in answers:
            if response.chat:
                yield _event(response.chunk(None, first=True, index=answer.index))
            elif echoed:
                yield _event(response.chunk(echoed, index=answer.index))
        async for answer, event in _events(answers):
            piece = answer.take(event)
            if answer.error:
                yield _event(ApiError(answer.error, status=answer.error_status).body())
            elif piece or answer.logprobs_sent < len(answer.token_logprobs) or answer.unsent_rounds:
                chunk = response.chunk(piece, index=answer.index, logprobs=answer.chunk_logprobs(response.chat))
                yield _event(answer.with_speculation(chunk, piece))
            if isinstance(event, Finished) and not answer.error:  # once per choice: its last event
                yield _event(answer.with_speculation(response.chunk(None, answer.finish_reason, index=answer.index),
                                                     "", final=True))
        if answers[0].job.include_usage:
            yield _event(response.usage_chunk(_usage(answers, prompt_tokens)))
        yield b"data: [DONE]\n\n"
    finally:
        for answer in answers:
            answer.handle.cancel()


def _event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


@dataclass
class _Answer:
    """One choice's answer as it arrives: text cut at the first stop string (the scheduler ends the request with the
    token that completes one), its finish reason, usage, and the tokens' log-probabilities."""

    job: Job
    handle: Handle
    tokenizer: object
    index: int
    sent: int = 0  # characters handed out
    completion_tokens: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    finish_reason: str = "length"
    error: str = ""
    error_status: int = 500
    done: bool = False
    token_logprobs: list[TokenLogprob] = field(default_factory=list)
    logprobs_sent: int = 0  # token_logprobs already streamed
    stop_text: StopText | None = None
    rounds: int = 0  # target passes that emitted its tokens
    unsent_tokens: list[tuple[str, str]] = field(default_factory=list)  # (text, kind) per token, not yet streamed
    unsent_rounds: list[dict] = field(default_factory=list)  # its rounds not yet streamed

    def __post_init__(self) -> None:
        self.stop_text = StopText(self.tokenizer, self.job.stop)

    @property
    def text(self) -> str:
        return self.stop_text.text

    def take(self, event: Tokens | Finished) -> str:
        """Take one event; the text that became final with it (never part of a stop string, never past one)."""
        if self.done:
            return ""
        if isinstance(event, Finished):
            self.done = True
            if event.reason == "error":
                self.error, self.error_status = event.message or "generation failed", event.status
                return ""
            self.finish_reason = FINISH_REASONS.get(event.reason, event.reason)
            rest = self.stop_text.flush()
            if self.job.include_speculation:
                self.unsent_tokens.append((rest, self.unsent_tokens[-1][1] if self.unsent_tokens else "plain"))
            if self.stop_text.stopped:
                self.finish_reason = "stop"
            return self._release(end=True)
        self.completion_tokens += len(event.token_ids)
        self.draft_tokens += event.draft_tokens
        self.accepted_tokens += event.kinds.count("accepted")
        self.rounds += 1
        for token, kind in zip(event.token_ids, event.kinds):
            piece = self.stop_text.push(token)
            if self.job.include_speculation:
                self.unsent_tokens.append((piece, kind))
        if self.job.include_speculation:
            self.unsent_rounds.append({"k": event.draft_tokens, "accepted": event.kinds.count("accepted"),
                                       "tokens": len(event.token_ids)})
        if event.logprobs is not None:
            entries = [TokenLogprob(self._piece(t), lp, [(self._piece(i), v) for i, v in top])
                       for t, (lp, top) in zip(event.token_ids, event.logprobs)]
            self.token_logprobs += entries
        return self._release()

    def with_speculation(self, chunk: dict, piece: str, final: bool = False) -> dict:
        """The chunk, and, when the request asked for ``stream_options.include_speculation``, how its text came
        under a ``specdec`` key: each token's piece of ``piece`` and its kind ("accepted", "recovered", "bonus" or
        "plain"; a token whose text a chunk boundary cut appears in both), the rounds since the last chunk (draft
        tokens scored, accepted, tokens emitted) and, on the last chunk, the request's totals."""
        if not self.job.include_speculation:
            return chunk
        tokens, owed = [], len(piece)
        while self.unsent_tokens and (owed > 0 or not self.unsent_tokens[0][0]):
            text, kind = self.unsent_tokens.pop(0)
            if len(text) > owed:
                self.unsent_tokens.insert(0, (text[owed:], kind))
                text = text[:owed]
            tokens.append({"text": text, "kind": kind})
            owed -= len(text)
        extension = {"tokens": tokens, "rounds": self.unsent_rounds}
        self.unsent_rounds = []
        if final:
            extension["summary"] = {"speculation": self.handle.mode, "completion_tokens": self.completion_tokens,
                                    "draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted_tokens,
                                    "target_passes": self.rounds}
        return {**chunk, "specdec": extension}

    def logprobs(self, chat: bool, echoed: int) -> dict | None:
        if self.job.logprobs is None:
            return None
        return logprobs_payload(chat, self._kept(self.token_logprobs), echoed)

    def chunk_logprobs(self, chat: bool) -> dict | None:
        if self.job.logprobs is None:
            return None
        entries, self.logprobs_sent = self.token_logprobs[self.logprobs_sent:], len(self.token_logprobs)
        return logprobs_payload(chat, entries)

    def _kept(self, entries: list[TokenLogprob]) -> list[TokenLogprob]:
        """Every token, or, when a stop string cut the text, those whose text starts before the cut."""
        if not self.stop_text.stopped:
            return entries
        kept, offset = [], 0
        for entry in entries:
            if offset >= len(self.text):
                break
            kept.append(entry)
            offset += len(entry.text)
        return kept

    def _piece(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def _release(self, end: bool = False) -> str:
        """The final text not yet handed out (all of it at the ``end``)."""
        final = self.stop_text.final(end)
        piece, self.sent = self.text[self.sent : final], max(self.sent, final)
        return piece
