"""Loading a model into a server, and the ``specdec serve`` command's run: start, serve until a signal, drain."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from pathlib import Path

from specdec.errors import UsageError
from specdec.server import BatchSettings, build_scheduler
from specdec.server.app import OpenAIServer, ServerSettings

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def load_server(model: str | None, batch: BatchSettings, settings: ServerSettings, datastore: str | None = None,
                dtype: str = "auto", device: str = "auto", served_model_name: str | None = None,
                backend: str = "torch", threads: int | None = None, listen: bool = True) -> OpenAIServer:
    """Load the model (checks first, the slow load last) and bind the server; ``start()`` it to serve
    (``listen=False``: the app alone, for Ray Serve to run)."""
    from specdec import datastore as datastores
    from specdec.api import eos_token_ids
    from specdec.backends import target_backend
    from specdec.models import load_model

    store = None if datastore is None else datastores.load(datastore)
    loaded = load_model(model, dtype=dtype, device=device, backend=backend, threads=threads)
    if store is not None:
        store.check_vocabulary(loaded.vocab_size)
    runtime = target_backend(loaded, "auto" if dtype == "auto" else None)
    scheduler = build_scheduler(runtime, batch, eos_token_ids(loaded), store)
    name = served_model_name or (DEFAULT_MODEL_NAME if model is None else Path(model).name.removesuffix(".gguf"))
    try:
        return OpenAIServer(scheduler, loaded.tokenizer, name, settings, listen=listen)
    except OSError as error:
        raise UsageError(f"cannot listen on {settings.host}:{settings.port}: {error.strerror or error}") from None


def api_key(given: str | None, path: str | None) -> str | None:
    """The key clients must send: from --api-key-file, else $SPECDEC_API_KEY, else --api-key (with a warning:
    a key on the command line shows in ps)."""
    if path is not None:
        try:
            lines = Path(path).read_text().splitlines()
        except (OSError, UnicodeDecodeError) as error:
            raise UsageError(f"cannot read the API key file {path}: {getattr(error, 'strerror', None) or error}"
                             ) from None
        if not lines or not lines[0].strip():
            raise UsageError(f"the API key file {path} is empty")
        return lines[0].strip()
    if given is not None:
        print("specdec: warning: --api-key shows in the process list; prefer $SPECDEC_API_KEY or --api-key-file",
              file=sys.stderr)
        return given
    return os.environ.get("SPECDEC_API_KEY") or None


def run_serve(args) -> int:
    logging.basicConfig(level=getattr(logging, args.log_level.upper()), format="%(asctime)s %(name)s %(message)s")
    batch = BatchSettings(speculation=args.speculation, drafter=args.drafter or (
        "retrieval" if args.datastore else "prompt-lookup"), num_draft_tokens=args.num_draft_tokens,
        max_batch_size=args.max_batch_size, max_model_len=args.max_model_len, max_waiting=args.max_waiting)
    if not 0 <= args.port < 65536:
        raise UsageError(f"port must be in 0..65535, got {args.port}")
    if args.max_body_bytes < 1024:
        raise UsageError(f"max-body-bytes must be >= 1024, got {args.max_body_bytes}")
    settings = ServerSettings(host=args.host, port=args.port, max_body_bytes=args.max_body_bytes,
                              api_key=api_key(args.api_key, args.api_key_file))
    if args.replicas < 0:
        raise UsageError(f"replicas must be >= 1, got {args.replicas}")
    if args.ray_address and not args.replicas:
        raise UsageError("--ray-address goes with --replicas N")
    if args.replicas:
        from specdec.server.replicas import ReplicaOptions, run_replicas

        return run_replicas(args, ReplicaOptions(args.model, batch, settings, args.datastore, args.dtype, args.device,
                                                 args.served_model_name, args.backend, args.threads))
    server = load_server(args.model, batch, settings, args.datastore, args.dtype, args.device,
                         args.served_model_name, args.backend, args.threads)
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    server.start()
    print(f"specdec: serving {server.model_name} at {server.url} (speculation {batch.speculation}, drafter "
          f"{batch.drafter}, up to {batch.max_batch_size} requests per batch"
          f"{', API key required' if settings.api_key else ''}); Ctrl-C to stop", file=sys.stderr, flush=True)
    stop.wait()
    print(f"specdec: shutting down: finishing requests in flight (up to {args.shutdown_timeout:g} s)",
          file=sys.stderr, flush=True)
    server.shutdown(args.shutdown_timeout)
    return 0
