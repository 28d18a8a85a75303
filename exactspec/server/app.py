"""The HTTP side of ``exactspec serve``: OpenAI's endpoints over the scheduler, on FastAPI and uvicorn.

The HTTP layer is a thin shell: it reads and checks a request (:mod:`exactspec.server.protocol`), submits it to the
scheduler, and writes what comes back, whole or as server-sent events. The scheduler's own thread runs every
request's steps and hands each request's events to the event loop. uvicorn's httptools protocol (llhttp, strict)
frames every request, with exactspec's refusals around it (:mod:`exactspec.server.framing`): a request a proxy in front
could frame otherwise is refused and its connection closed, never read past. What answers become on the wire
(detokenising, stop strings, log-probabilities, the speculation extension, SSE) is :mod:`exactspec.server.output`;
the live page's files are :mod:`exactspec.server.page`; loading and running a server, :mod:`exactspec.server.launch`.

Refusals are OpenAI error bodies: 400 for a bad request, 401 without the API key, 404 for an unknown path (and
``model_not_found`` for a model the server does not serve), 405 for a wrong method, 408 for a head or body that
stalls or a body that takes too long in all, 413 for a body over the limit, 429 (with Retry-After) when the waiting
queue is full, 431 for a head over the limits, 503 while shutting down or when the scheduler has stopped serving,
505 for an HTTP version other than 1.0 and 1.1. The scheduler's own refusals become statuses by one table,
:data:`exactspec.server.protocol.ERROR_STATUSES`, for every route.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import threading
import time
from functools import partial

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, CollectorRegistry, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from exactspec import listening
from exactspec.grammars import GrammarError, grammar_for, prepare_grammars
from exactspec.server.framing import JSON, ClientGone, Framing, InstanceHeader, check_api_key, http_protocol, read_body
from exactspec.server.metrics import MetricsCollector, Refusals
from exactspec.server.output import POLL_SECONDS, Answer, echo_text, stream, whole
from exactspec.server.page import page_file
from exactspec.server.protocol import (
    ERROR_STATUSES,
    RETRY_AFTER_SECONDS,
    ApiError,
    BadRequest,
    ChatCompletionRequest,
    CompletionRequest,
    Job,
    Response,
    api_error,
    check_served,
    parse_body,
    parse_job,
)
from exactspec.server.scheduler import Handle, Scheduler
from exactspec.server.settings import ServerSettings
from exactspec.server.tools import template_tools
from exactspec.stops import StopText
from exactspec.view import KIND_STYLES
from exactspec.vocabularies import TokenText

log = logging.getLogger("exactspec.server")


class OpenAIServer:
    """OpenAI-compatible endpoints for one model, served by a scheduler."""

    def __init__(self, scheduler: Scheduler, tokenizer, model_name: str | tuple[str, ...],
                 settings: ServerSettings | None = None, listen: bool = True, sock: socket.socket | None = None
                 ) -> None:
        """``model_name``: the name it answers to, or several (``serve --served-model-name NAME [ALIAS ...]``: the
        first its own, the others aliases; each listed by /v1/models). ``listen=False``: the app alone, for another
        server to run (a Ray Serve replica); no socket. ``sock``: a socket already bound and listening (``bind``),
        else one is bound here."""
        import uvicorn

        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.model_names = (model_name,) if isinstance(model_name, str) else tuple(model_name)
        self.model_name = self.model_names[0]
        self.settings = settings = settings or ServerSettings()
        self.created = int(time.time())
        self.instance = f"{socket.gethostname()}:{os.getpid()}"  # which process answered (X-Exactspec-Instance)
        self.refusals = Refusals()  # requests refused, by status: counted by the routes and the framing alike
        self.app = build_app(self)
        self.socket = (sock or bind(settings)) if listen else None
        protocol = http_protocol(settings, self.instance.encode(), self.refusals.observe)
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
        """Start the scheduler and, where this server listens, serve HTTP (``listen=False``: the scheduler alone,
        under another server's HTTP). What the first structured output would wait for (the vocabulary as bytes and
        the grammar engine's tokenizer: 0.6 s for the default model's, measured) is built meanwhile, apart."""
        self.scheduler.start()
        threading.Thread(target=self._prepare_grammars, name="grammar-preparation", daemon=True).start()
        if self.socket is None:
            return
        self._serving = threading.Thread(target=self.uvicorn.run, kwargs={"sockets": [self.socket]},
                                         name="exactspec-http", daemon=True)
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
        """``GET /v1/models``: every name the server answers to."""
        return {"object": "list", "data": [self._model(name) for name in self.model_names]}

    def model(self, name: str) -> dict:
        """``GET /v1/models/{name}`` (the SDK's ``models.retrieve``): a served name's model object, else 404
        ``model_not_found``."""
        check_served(name, self.model_names)
        return self._model(name)

    def _model(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "exactspec",
                "max_model_len": self.scheduler.max_length}

    def speculation(self) -> dict:
        """What the page needs to offer a request's settings: the drafter, the server's speculation mode, the modes
        a request may ask for, the most draft tokens per round, and each token kind's colour and legend."""
        scheduler = self.scheduler
        return {"model": self.model_name, "drafters": [scheduler.drafter] if scheduler.drafter else [],
                "speculation": scheduler.speculation, "modes": list(scheduler.speculation_modes),
                "num_draft_tokens": scheduler.max_draft_tokens, "max_model_len": scheduler.max_length,
                "kinds": {kind: {"colour": colour, "legend": legend}
                          for kind, (_, colour, legend) in KIND_STYLES.items()}}

    def authorize(self, header: str | None) -> None:
        """Admit a request whose Authorization header carries the API key, or any where no key is set; else 401."""
        check_api_key(self.settings.api_key, header)

    def prompt_ids(self, job: Job) -> list[int]:
        """The prompt's ids, no more than the context holds: a prompt that fills it is refused
        (:meth:`Job.generation_request`), and the tokenizer need not tokenize the rest of it (a chat of 30,000
        messages took 19 s to refuse, tokenized whole by llama.cpp)."""
        ids = self._encoded(job, self.scheduler.max_length)
        if not ids:
            raise BadRequest("the prompt encodes to no tokens", "messages" if job.chat else "prompt")
        return ids

    def _encoded(self, job: Job, max_length: int) -> list[int]:
        if job.chat:
            from exactspec.models import chat_prompt_ids

            try:
                return chat_prompt_ids(self.tokenizer, job.prompt, template_tools(job.tool_calling), max_length)
            except Exception as error:  # the template's own checks (roles, order) raise their own errors
                raise BadRequest(f"the chat template refused these messages: {error}", "messages") from None
        if isinstance(job.prompt, str):
            return list(self.tokenizer.encode(job.prompt, truncation=True, max_length=max_length))
        vocab = self.scheduler.vocab_size
        if not all(0 <= t < vocab for t in job.prompt):
            raise BadRequest(f"prompt token ids must be in [0, {vocab})", "prompt")
        return list(job.prompt)

    @functools.cached_property
    def token_text(self) -> TokenText:
        """The tokenizer as bytes per token, over the logits' width: what a grammar reads, and the bytes each answer's
        log-probabilities give."""
        return TokenText(self.tokenizer, self.scheduler.vocab_size)

    def _prepare_grammars(self) -> None:
        try:
            prepare_grammars(self.token_text, self.scheduler.eos_token_ids)
        except Exception as error:  # a help to the first structured request, which builds it itself otherwise
            log.warning("the grammar engine's tokenizer was not built ahead (%r)", error)

    def grammar(self, job: Job):
        """What makes each choice's matcher for the job's structured output (None without one): the grammar is
        compiled once, here, and each choice takes a copy of its matcher; a 400 naming the field where it does not
        compile."""
        if job.grammar is None:
            return None
        try:
            compiled = grammar_for(job.grammar, self.token_text, self.scheduler.eos_token_ids)
        except GrammarError as error:
            raise BadRequest(str(error), job.grammar_param, "invalid_grammar") from None
        return compiled.copy

    def prepared(self, raw: bytes, chat: bool) -> tuple[Job, list[int], object]:
        """A request's body checked, its prompt tokenised and its grammar compiled (``grammar``): the work a request
        brings, which the routes run on a worker thread, off the event loop (a 1 MiB regex compiled there stalled
        every other stream and /health for 0.8 s)."""
        job = parse_job(parse_body(raw), chat, self.model_names, self.scheduler.vocab_size,
                        getattr(self.tokenizer, "chat_template", None))
        return job, self.prompt_ids(job), self.grammar(job)

    def submit(self, job: Job, prompt_ids: list[int], grammar=None) -> list[Handle]:
        """One handle per choice; all or none (a refusal cancels those already queued, and goes on to the error
        table: the first choice's, before any is queued, as all choices ask alike). ``grammar``: what
        :meth:`grammar` made of the job's structured output."""
        stop = partial(StopText, self.tokenizer, job.stop) if job.stop else None  # the scheduler's, per choice
        requests = [job.generation_request(prompt_ids, self.scheduler.max_length, i, stop, grammar)
                    for i in range(job.n)]
        handles: list[Handle] = []
        try:
            for request in requests:
                handles.append(self.scheduler.submit(request))
        except Exception:
            for handle in handles:
                handle.cancel()
            raise
        return handles


def bind(settings: ServerSettings) -> socket.socket:
    """The server's listening socket, or one line saying why the port cannot be had."""
    return listening.bind(settings.host, settings.port)


# --- the FastAPI application -----------------------------------------------------------------------------------------


def build_app(server: OpenAIServer) -> FastAPI:
    app = FastAPI(title="exactspec", summary="OpenAI-compatible completions with exact speculative decoding",
                  docs_url=None, redoc_url=None, default_response_class=JSON,
                  redirect_slashes=False)  # Starlette's redirect is built from the client's Host header: 404 instead
    scheduler = server.scheduler
    registry = CollectorRegistry()  # this server's, not the process-wide default: a process may hold several
    registry.register(MetricsCollector(scheduler.metrics, server.refusals,
                                       lambda: (scheduler.running, scheduler.waiting)))
    app.add_middleware(Framing, settings=server.settings, authorize=server.authorize,
                       count_refusal=server.refusals.observe)
    app.add_middleware(InstanceHeader, value=server.instance.encode())  # outermost: on Framing's refusals too

    def error_response(error: ApiError) -> JSONResponse:
        server.refusals.observe(error.status)
        headers = {"Retry-After": str(RETRY_AFTER_SECONDS)} if error.status == 429 else {}
        if error.status in (408, 413):
            headers["Connection"] = "close"  # the body was left unread
        return JSON(error.body(), status_code=error.status, headers=headers)

    async def refused(request: Request, error: Exception):
        return error_response(api_error(error))

    for kind in (ApiError, *ERROR_STATUSES):  # the error table's classes, raised by any route
        app.add_exception_handler(kind, refused)

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
        return error_response(api_error(error))

    @app.get("/health")
    async def health():
        status, body = server.health()
        return JSON(body, status_code=status)

    @app.get("/v1/models")
    async def models():
        return server.models()

    @app.get("/v1/models/{name:path}")  # a served name may hold "/" (org/name), sent as is or as %2F
    async def model(name: str):
        if not name:  # "/v1/models/": an unknown path, as before (never a redirect)
            raise HTTPException(404)
        return server.model(name)

    @app.get("/v1/speculation")
    async def speculation():
        return server.speculation()

    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    async def page():
        return page_file("index.html")

    @app.api_route("/page/{name}", methods=["GET", "HEAD"], include_in_schema=False)
    async def page_asset(name: str):
        return page_file(name)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus():
        return PlainTextResponse(generate_latest(registry), media_type=CONTENT_TYPE_PLAIN_0_0_4)  # the format it writes

    async def generate(request: Request, chat: bool):
        raw = await read_body(request, server.settings)
        job, prompt_ids, grammar = await run_in_threadpool(server.prepared, raw, chat)
        handles = server.submit(job, prompt_ids, grammar)
        answers = [Answer(job, handle, server.token_text, i) for i, handle in enumerate(handles)]
        response = Response(chat, job.model or server.model_name)  # the name asked for: an alias is answered so
        echoed = echo_text(job, server.tokenizer, prompt_ids)
        if job.stream:
            return StreamingResponse(stream(answers, response, len(prompt_ids), echoed),
                                     headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                              "Connection": "close"})
        return await whole(answers, response, len(prompt_ids), echoed, request)

    @app.post("/v1/completions", openapi_extra=_body_schema(CompletionRequest))
    async def completions(request: Request):
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions", openapi_extra=_body_schema(ChatCompletionRequest))
    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    _add_schemas(app, CompletionRequest, ChatCompletionRequest)
    return app


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


