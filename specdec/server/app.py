"""The HTTP side of ``specdec serve``: OpenAI's endpoints over the scheduler, on the standard library's server.

One thread per connection parses and checks the request, submits it to the scheduler and writes what comes back,
whole or as server-sent events; the scheduler's own thread runs every request's steps. Refusals are OpenAI error
bodies: 400 for a bad request, 401 without the API key, 404 for an unknown path (405 for a wrong method), 413 for
a body over the limit, 429 when the waiting queue is full, 503 while shutting down.
"""

from __future__ import annotations

import hmac
import json
import logging
import queue
import select
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from specdec.server.protocol import ApiError, BadRequest, Job, Response, parse_body, parse_job, usage
from specdec.server.scheduler import Finished, Handle, QueueFull, Scheduler, ShuttingDown, Tokens
from specdec.view import Detokenizer

log = logging.getLogger("specdec.server")
POLL_SECONDS = 0.25  # how often a waiting connection checks that its client is still there
FINISH_REASONS = {"stop": "stop", "length": "length", "cancelled": "stop", "abort": "abort"}


@dataclass(frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # checked on every endpoint but /health
    max_body_bytes: int = 1 << 20
    read_timeout: float = 120.0  # seconds a socket read or write may block


class ClientGone(Exception):
    """The client closed its connection."""


class OpenAIServer:
    """OpenAI-compatible endpoints for one model, served by a scheduler."""

    def __init__(self, scheduler: Scheduler, tokenizer, model_name: str, settings: ServerSettings = ServerSettings()
                 ) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.settings = settings
        self.created = int(time.time())
        self.httpd = _HTTPServer((settings.host, settings.port), _Handler)
        self.httpd.app = self
        self._serving: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    @property
    def url(self) -> str:
        return f"http://{self.settings.host}:{self.port}"

    def start(self) -> None:
        self.scheduler.start()
        self._serving = threading.Thread(target=self.httpd.serve_forever, name="specdec-http", daemon=True)
        self._serving.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Refuse new requests (503), let those in flight finish for up to ``timeout`` seconds, end the rest with
        finish reason "abort", give their connections a moment to write it, and close."""
        self.scheduler.shutdown(timeout)
        time.sleep(2 * POLL_SECONDS)
        self.httpd.shutdown()
        self.httpd.server_close()

    # --- endpoints ----------------------------------------------------------------------------------------------------

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "specdec", "max_model_len": self.scheduler.max_length}]}

    def prompt_ids(self, job: Job) -> list[int]:
        if job.chat:
            from specdec.api import chat_prompt_ids

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

    def submit(self, job: Job, prompt_ids: list[int]) -> Handle:
        request = job.generation_request(prompt_ids, self.scheduler.max_length)
        try:
            return self.scheduler.submit(request)
        except QueueFull as error:
            raise ApiError(f"the server is at capacity: {error}; retry later", status=429) from None
        except ShuttingDown as error:
            raise ApiError(str(error), status=503) from None


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024  # the listen backlog: the default 5 resets connections under a burst of clients
    app: OpenAIServer


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "specdec"

    def setup(self) -> None:
        self.timeout = self.app.settings.read_timeout  # a client that stalls mid-request is dropped
        super().setup()

    @property
    def app(self) -> OpenAIServer:
        return self.server.app

    def do_GET(self) -> None:
        self._route("GET")

    def do_POST(self) -> None:
        self._route("POST")

    def log_message(self, format: str, *args) -> None:
        log.debug("%s %s", self.address_string(), format % args)

    def _route(self, method: str) -> None:
        path = urlsplit(self.path).path.rstrip("/")
        try:
            if path == "/health":
                self._send_json(200 if self.app.scheduler.accepting else 503,
                                {"status": "ok" if self.app.scheduler.accepting else "shutting down"})
                return
            self._authorize()
            routes = {
                "/v1/models": ("GET", lambda: self._send_json(200, self.app.models())),
                "/metrics": ("GET", self._metrics),
                "/v1/completions": ("POST", lambda: self._generate(chat=False)),
                "/v1/chat/completions": ("POST", lambda: self._generate(chat=True)),
            }
            if path not in routes:
                raise ApiError(f"no such endpoint: {path or '/'}", status=404)
            allowed, endpoint = routes[path]
            if method != allowed:
                raise ApiError(f"{path} answers {allowed}, not {method}", status=405)
            endpoint()
        except ApiError as error:
            self.app.scheduler.metrics.observe_rejection(error.status)
            self._send_json(error.status, error.body())
        except (BrokenPipeError, ConnectionResetError, ClientGone, TimeoutError):  # the client left, or stalled
            self.close_connection = True
        except Exception as error:  # a bug answers 500 with one line; the traceback goes to the log only
            log.exception("request failed")
            self._send_json(500, ApiError(f"internal error: {error}").body())

    def _authorize(self) -> None:
        key = self.app.settings.api_key
        if key is None:
            return
        given = self.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            raise ApiError("a valid API key is required: Authorization: Bearer <key>", code="invalid_api_key",
                           status=401)

    def _metrics(self) -> None:
        scheduler = self.app.scheduler
        body = scheduler.metrics.render(scheduler.running, scheduler.waiting).encode()
        self._send(200, body, "text/plain; version=0.0.4; charset=utf-8")

    def _read_body(self) -> bytes:
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            self.close_connection = True
            raise BadRequest("a request body with a Content-Length header is required")
        if int(length) > self.app.settings.max_body_bytes:
            self.close_connection = True  # the body is left unread
            raise ApiError(f"the request body has {length} bytes; the limit is {self.app.settings.max_body_bytes}",
                           status=413)
        return self.rfile.read(int(length))

    def _generate(self, chat: bool) -> None:
        job = parse_job(parse_body(self._read_body()), chat, self.app.model_name)
        prompt_ids = self.app.prompt_ids(job)
        handle = self.app.submit(job, prompt_ids)
        try:
            answer = _Answer(job, handle, Response(chat, self.app.model_name), len(prompt_ids), self.app.tokenizer)
            if job.stream:
                self._stream(answer)
            else:
                self._whole(answer)
        finally:
            handle.cancel()  # frees the slot if the request is still running (a client gone, a stop string)

    def _whole(self, answer: "_Answer") -> None:
        for _ in answer.pieces(self._client_gone):
            pass
        if answer.error:
            raise ApiError(answer.error)
        self._send_json(200, answer.response.whole(answer.text, answer.finish_reason, answer.usage()))

    def _stream(self, answer: "_Answer") -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        response = answer.response
        self._event(response.chunk(None, first=True) if answer.job.chat else None)
        for piece in answer.pieces(self._client_gone):
            if piece:
                self._event(response.chunk(piece))
        if answer.error:
            self._event(ApiError(answer.error).body())
        else:
            self._event(response.chunk(None, answer.finish_reason))
            if answer.job.include_usage:
                self._event(response.usage_chunk(answer.usage()))
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()

    def _event(self, payload: dict | None) -> None:
        if payload is not None:
            self.wfile.write(b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n")
            self.wfile.flush()

    def _client_gone(self) -> bool:
        """Whether the client has closed its side: the socket reads as ended."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def _send_json(self, status: int, payload: dict) -> None:
        self._send(status, json.dumps(payload, ensure_ascii=False).encode(), "application/json")

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)


class _Answer:
    """One request's answer as it arrives: text cut at the first stop string, its finish reason and usage."""

    def __init__(self, job: Job, handle: Handle, response: Response, prompt_tokens: int, tokenizer) -> None:
        self.job = job
        self.handle = handle
        self.response = response
        self.prompt_tokens = prompt_tokens
        self.detokenizer = Detokenizer(tokenizer)
        self.text = ""
        self.sent = 0  # characters handed out
        self.completion_tokens = self.draft_tokens = self.accepted_tokens = 0
        self.finish_reason = "length"
        self.error = ""

    def pieces(self, client_gone) -> Iterator[str]:
        """Text as it becomes final: never part of a stop string, never past one."""
        for event in self._events(client_gone):
            if isinstance(event, Finished):
                if event.reason == "error":
                    self.error = event.message or "generation failed"
                    return
                self.finish_reason = FINISH_REASONS.get(event.reason, event.reason)
                self.text += self.detokenizer.flush()
                if self._cut_at_stop():
                    self.finish_reason = "stop"
                yield self._release(final=True)
                return
            self.completion_tokens += len(event.token_ids)
            self.draft_tokens += event.draft_tokens
            self.accepted_tokens += event.kinds.count("accepted")
            for token in event.token_ids:
                self.text += self.detokenizer.push(token)
            if self._cut_at_stop():
                self.handle.cancel()
                self.finish_reason = "stop"
                yield self._release(final=True)
                return
            yield self._release(final=False)

    def usage(self) -> dict:
        return usage(self.prompt_tokens, self.completion_tokens, self.draft_tokens, self.accepted_tokens)

    def _events(self, client_gone) -> Iterator[Tokens | Finished]:
        while True:
            try:
                event = self.handle.events.get(timeout=POLL_SECONDS)
            except queue.Empty:
                if client_gone():
                    self.handle.cancel()
                    raise ClientGone from None
                continue
            yield event
            if isinstance(event, Finished):
                return

    def _cut_at_stop(self) -> bool:
        longest = max((len(s) for s in self.job.stop), default=0)
        start = max(0, self.sent - longest)
        found = [i for i in (self.text.find(s, start) for s in self.job.stop) if i >= 0]
        if found:
            self.text = self.text[: min(found)]
            return True
        return False

    def _release(self, final: bool) -> str:
        """The text not yet handed out, less (unless final) a tail that may be the start of a stop string."""
        end = len(self.text) if final else len(self.text) - _held_back(self.text, self.job.stop)
        piece, self.sent = self.text[self.sent : end], max(self.sent, end)
        return piece


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
    held = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), held, -1):
            if text.endswith(stop[:n]):
                held = n
                break
    return held
