"""An HTTP request carried whole from one process to another, for prefix routing on Ray Serve
(``replicas.py``): the ingress reads the request's body, which Ray's request router never sees, names the prompt's
prefix blocks from it (``routing.py``), and hands the request to a replica through a deployment handle; the replica
runs its own app on it and sends back what the app sends, piece by piece, so that a stream stays a stream.

Both ends are plain ASGI and know nothing of Ray: :class:`Forwarder` is the ingress's app, given the call that opens
a replica's stream of messages; :func:`asgi_messages` is what the replica streams.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

from starlette.requests import Request

from exactspec.server.framing import JSON, OPEN_PATHS, ClientGone, check_api_key, header, read_body
from exactspec.server.protocol import RETRY_AFTER_SECONDS, ApiError
from exactspec.server.routing import prefix_keys
from exactspec.server.settings import ServerSettings

log = logging.getLogger("exactspec.server")
# what of an HTTP request's scope travels with it: what the app reads (no server state, nothing unpicklable)
SCOPE_KEYS = ("type", "asgi", "http_version", "method", "scheme", "path", "raw_path", "root_path", "query_string",
              "headers", "client", "server")

# (scope, body, prefix keys) -> the messages a replica's app sends
OpenStream = Callable[[dict, bytes, tuple[str, ...]], AsyncIterator[dict]]


class Forwarder:
    """The ingress's ASGI app: with an API key set, a request without it refused (401) before its body is read; each
    HTTP request's body read within the server's limits (413, 408 as the server answers them), its prefix keys
    named, and the request relayed to the replica that ``open_stream`` reaches; what that replica's app sends is
    sent on as it comes. A replica that fails before it answers is a 503."""

    def __init__(self, open_stream: OpenStream, settings: ServerSettings) -> None:
        self.open_stream, self.settings = open_stream, settings

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":  # lifespan: nothing to start or stop
            return
        try:
            if scope["path"] not in OPEN_PATHS:  # a client without the key is refused before its body is read
                check_api_key(self.settings.api_key, header(scope, b"authorization"))
            body = await read_body(Request(scope, receive), self.settings)
        except ClientGone:
            return
        except ApiError as error:
            await refuse(error, scope, receive, send)
            return
        forwarded = {key: scope[key] for key in SCOPE_KEYS if key in scope}
        started = False
        try:
            async for message in self.open_stream(forwarded, body, prefix_keys(scope["path"], body)):
                started = started or message["type"] == "http.response.start"
                await send(message)
        except Exception as error:  # the replica died, or none could be reached
            if started:  # the answer is cut short: the connection's end tells the client
                raise
            log.warning("forwarding a request failed: %r", error)
            await refuse(ApiError(f"no replica answered: {error}", status=503), scope, receive, send)


async def refuse(error: ApiError, scope, receive, send) -> None:
    """An OpenAI error body, the connection closed after it (a body left unread stays unread)."""
    headers = {"Connection": "close", **({"Retry-After": str(RETRY_AFTER_SECONDS)} if error.status == 503 else {})}
    await JSON(error.body(), status_code=error.status, headers=headers)(scope, receive, send)


async def asgi_messages(app, scope: dict, body: bytes) -> AsyncIterator[dict]:
    """Run the ASGI ``app`` on one HTTP request whose body is read already, and yield each message it sends: the
    response's start, then its body's pieces as the app sends them. The client stays connected while the caller
    reads; a caller that stops reading (it left) cancels the app's run."""
    sent: asyncio.Queue = asyncio.Queue()
    delivered = False

    async def receive() -> dict:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.get_running_loop().create_future()  # never done: a caller that leaves cancels the run
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.put_nowait(message)

    running = asyncio.ensure_future(app(scope, receive, send))
    running.add_done_callback(lambda _: sent.put_nowait(None))
    started = False
    try:
        while (message := await sent.get()) is not None:
            started = started or message["type"] == "http.response.start"
            yield message
        if not running.cancelled() and running.exception() is not None and not started:
            raise running.exception()  # an app error after its answer began was the app's to log (it does)
    finally:
        if not running.done():
            running.cancel()
