"""The ``exactspec serve`` command's run: start, serve until a signal, drain."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from exactspec.choices import DEFAULT_DRAFTER, parse_tree
from exactspec.datastore import HEADER
from exactspec.errors import UsageError
from exactspec.proposers import check_drafter_path, drafters_where, takes_draft_model
from exactspec.server.batching import BatchSettings
from exactspec.server.serving import ServerOptions, load_server, wait_for_signal
from exactspec.server.settings import ServerSettings


def api_key(given: str | None, path: str | None) -> str | None:
    """The key clients must send: from --api-key-file, else $EXACTSPEC_API_KEY, else --api-key (with a warning:
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
        print("exactspec: warning: --api-key shows in the process list; prefer $EXACTSPEC_API_KEY or --api-key-file",
              file=sys.stderr)
        return given
    return os.environ.get("EXACTSPEC_API_KEY") or None


def run_serve(args) -> int:
    logging.basicConfig(level=getattr(logging, args.log_level.upper()), format="%(asctime)s %(name)s %(message)s")
    if args.datastore_save and not args.datastore:
        raise UsageError("--datastore-save keeps the shared suffix index in --datastore DIR: give one")
    built = args.datastore is not None and (Path(args.datastore) / HEADER).is_file()
    batch = BatchSettings(speculation=args.speculation,
        drafter=args.drafter or DEFAULT_DRAFTER,
        num_draft_tokens=args.num_draft_tokens,
        max_batch_size=args.max_batch_size, max_model_len=args.max_model_len, max_waiting=args.max_waiting,
        datastore_capacity=args.datastore_capacity, learn_prompts=args.datastore_learn_prompts,
        save_learned=Path(args.datastore) if args.datastore_save else None, prefix_cache_mib=args.prefix_cache_mib,
        prefix_cache_tokens=args.prefix_cache_tokens,
        tree=parse_tree(args.tree))
    settings = ServerSettings(host=args.host, port=args.port, max_body_bytes=args.max_body_bytes,
                              api_key=api_key(args.api_key, args.api_key_file), max_header_line=args.max_header_line,
                              max_head_bytes=args.max_head_bytes)
    if args.replicas < 0:
        raise UsageError(f"replicas must be >= 1, got {args.replicas}")
    if args.ray_address and not args.replicas:
        raise UsageError("--ray-address goes with --replicas N")
    if args.request_timeout < 0:
        raise UsageError(f"request-timeout must be >= 0 seconds (0: no limit), got {args.request_timeout:g}")
    datastore = args.datastore if built or not args.datastore_save else None  # a directory for the learned index only
    if args.draft_model and not takes_draft_model(batch.drafter):
        drafting = ", ".join(drafters_where(lambda r: r.needs_draft_model or r.takes_draft_model))
        raise UsageError(f"--draft-model is for --drafter {drafting}, not {batch.drafter}")
    check_drafter_path(batch.drafter, args.drafter_path is not None)
    options = ServerOptions(args.model, batch, settings, datastore, args.dtype, args.device,
                            args.served_model_name, args.backend, args.threads, args.draft_model,
                            args.drafter_path, args.cross_vocabulary, args.draft_grade)
    if args.replicas:
        from exactspec.server.replicas import run_replicas

        return run_replicas(args, options)
    server = load_server(options, sock=getattr(args, "listening", None))
    server.start()
    print(f"exactspec: serving {server.model_name} at {server.url} (speculation {batch.speculation}, drafter "
          f"{batch.drafter}, up to {batch.max_batch_size} requests per batch"
          f"{', API key required' if settings.api_key else ''}); the live page at {server.url}/; Ctrl-C to stop",
          file=sys.stderr, flush=True)
    wait_for_signal()
    print(f"exactspec: shutting down: finishing requests in flight (up to {args.shutdown_timeout:g} s)",
          file=sys.stderr, flush=True)
    server.shutdown(args.shutdown_timeout)
    return 0
