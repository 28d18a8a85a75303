"""A server loaded and run: what it loads and how it serves (:class:`ServerOptions`), the port claimed before the slow
load (:func:`load_server`), and the wait for a signal that ends a run; for ``exactspec serve`` (``launch.py``) and for
each Ray Serve replica (``replicas.py``) alike."""

from __future__ import annotations

import socket
import threading
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path

from exactspec.errors import UsageError
from exactspec.proposers import role, takes_draft_model
from exactspec.server.app import OpenAIServer, bind
from exactspec.server.batching import BatchSettings, build_scheduler
from exactspec.server.settings import ServerSettings

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class ServerOptions:
    """What a server loads and how it serves: one process's, or each Ray Serve replica's."""

    model: str | None = None
    batch: BatchSettings = field(default_factory=BatchSettings)
    settings: ServerSettings = field(default_factory=ServerSettings)
    datastore: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    served_model_name: str | tuple[str, ...] | None = None  # the names it answers to (the first its own)
    backend: str = "auto"
    threads: int | None = None
    draft_model: str | None = None  # the draft-model drafter's model (any tokenizer)
    drafter_path: str | None = None  # a trained drafter (exactspec train), or a published EAGLE / Medusa checkpoint
    cross_vocabulary: str = "auto"  # how it proposes where its tokenizer is not the target's
    draft_grade: str = "auto"  # whether the draft model drafts as its draft-grade copy (choices.DRAFT_GRADES)

    def __post_init__(self) -> None:
        names = self.served_model_name
        for name in (names,) if isinstance(names, str) else names or ():
            check_served_name(name)


def check_served_name(name: str) -> None:
    """A name clients ask for (``--served-model-name``), or one line saying why it is not one: empty, holding a
    control or format character (which a log line or a header would carry), or with whitespace around it (a client
    that asks for the name as it reads it would be answered 404)."""
    if not name.strip():
        raise UsageError(f"served-model-name must not be empty or blank, got {name!r}")
    hidden = next((c for c in name if unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp")), None)
    if hidden is not None:
        raise UsageError(f"served-model-name {name!r} holds a control character (U+{ord(hidden):04X})")
    if name != name.strip():
        raise UsageError(f"served-model-name {name!r} starts or ends with whitespace")


def load_server(options: ServerOptions, listen: bool = True, sock: socket.socket | None = None) -> OpenAIServer:
    """Claim the port (``sock``: claimed already, as ``exactspec serve`` does before its imports), then load the model
    (checks first, the slow load last); ``start()`` the server to serve (``listen=False``: the app alone, for Ray
    Serve to run, and no port). A busy port is refused in one line before anything slow."""
    from exactspec.loading import draft_source, load_target

    settings = options.settings
    sock = sock if sock is not None or not listen else bind(settings)
    drafter = options.batch.drafter
    declared = role(drafter)
    try:
        loaded = load_target(options.model, dtype=options.dtype, device=options.device, backend=options.backend,
                             threads=options.threads, datastore=options.datastore, drafters=(drafter,),
                             draft_model=options.draft_model if takes_draft_model(drafter) else None,
                             draft_grade=options.draft_grade,
                             trained=(drafter,) if options.drafter_path is not None else ())
        draft = draft_source(drafter, loaded.target, loaded.runtime, loaded.draft, loaded.precision,
                             options.drafter_path, options.cross_vocabulary, loaded.draft_found) \
            if takes_draft_model(drafter) or declared.trained else None
        scheduler = build_scheduler(loaded.runtime, options.batch, loaded.stop_ids, loaded.datastore, draft)
    except BaseException:
        if sock is not None:
            sock.close()
        raise
    model = options.model
    file_name = DEFAULT_MODEL_NAME if model is None else Path(model).name.removesuffix(".gguf")
    name = options.served_model_name or file_name  # the names given (--served-model-name), else the file's
    return OpenAIServer(scheduler, loaded.target.tokenizer, name, settings, listen=listen, sock=sock)


def wait_for_signal() -> None:
    """Block until SIGINT or SIGTERM: the server's run, from start to drain."""
    import signal

    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    stop.wait()
