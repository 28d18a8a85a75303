"""Whose lines reach the terminal: at the command line's default verbosity only exactspec's, and all of them with
``--verbose``.

- llama.cpp's log callback (``llama_log_set``) is routed into Python logging, logger ``llama.cpp``, at WARNING and
  above (everything with ``--verbose``). llama-cpp-python's own callback reads ggml's levels in an older order
  and prints llama.cpp's warnings to stderr as errors; :func:`route_llama_cpp_logs` replaces it.
- What a user must know is said once, as a ``exactspec:`` line, through :func:`notice`.
- transformers' logging and Python's warnings are kept off the terminal unless ``--verbose``.

A library user who configures logging sees llama.cpp's warnings under ``llama.cpp`` and the notices under
``exactspec.notice``; one who does not sees the notices alone (Python's last-resort handler), never llama.cpp's
lines. :func:`configure` is the command line's choice, not the library's.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import threading
import warnings

LLAMA_CPP = logging.getLogger("llama.cpp")
LLAMA_CPP.setLevel(logging.WARNING)  # what llama.cpp says below this is dropped in its callback, not formatted
# A library's logger has a handler of its own that writes nothing: where the application configured no logging,
# Python would otherwise print llama.cpp's warnings on stderr through its last-resort handler. Where it did, they
# reach its handlers as any logger's records do.
LLAMA_CPP.addHandler(logging.NullHandler())
NOTICES = logging.getLogger("exactspec.notice")
# Held while process-wide state is patched and put back: sys.stderr redirected, Python's warning filters, and
# transformers' loading, which swaps PreTrainedModel.tie_weights out and back. Two threads doing so at once put
# each other's patches back in the wrong order, and a patch stays: every tied model loaded after had its output
# matrix left on the meta device. A draft model loads beside its target (loading.load_target), so they take turns.
PROCESS_WIDE = threading.RLock()
DETAILS = logging.getLogger("exactspec.detail")

# ggml_log_level, as llama.cpp 0.3.16's ggml numbers it: NONE, DEBUG, INFO, WARN, ERROR, then CONT (the rest of
# the previous message)
GGML_LEVELS = {0: logging.INFO, 1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR}
GGML_CONTINUE = 5

_verbose = False


def verbose() -> bool:
    """Whether the command line asked for every library's lines (``--verbose``)."""
    return _verbose


def configure(verbose: bool) -> None:
    """The command line's logging: notices as ``exactspec:`` lines on stderr; llama.cpp's, transformers' and Python's
    warnings nowhere, or, with ``verbose``, everything they say on stderr under their logger's name."""
    global _verbose
    _verbose = verbose
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("exactspec: %(message)s"))
    NOTICES.handlers[:] = [handler]
    NOTICES.propagate = False
    if verbose:
        logging.basicConfig(level=logging.DEBUG, stream=sys.stderr, format="%(name)s: %(message)s")
    else:
        warnings.simplefilter("ignore")
    LLAMA_CPP.setLevel(logging.DEBUG if verbose else logging.WARNING)
    LLAMA_CPP.propagate = verbose  # to the root handler above; by default to no handler at all
    LLAMA_CPP.handlers[:] = [] if verbose else [logging.NullHandler()]
    # transformers keeps its own handler on stderr (and does not propagate): only its level is set
    os.environ["TRANSFORMERS_VERBOSITY"] = "info" if verbose else "critical"  # read when transformers is imported
    if "transformers" in sys.modules:  # imported before this call: the variable above came too late
        from transformers.utils import logging as transformers_logging

        transformers_logging.set_verbosity(logging.INFO if verbose else logging.CRITICAL)


def notice(message: str) -> None:
    """Say one thing a user must know, once, in exactspec's voice."""
    NOTICES.warning(message)


def detail(message: str) -> None:
    """Say why exactspec chose as it did, where a user asked to hear it (``--verbose``; a library's ``exactspec.detail``
    logger at INFO)."""
    DETAILS.info(message)


class _LlamaCppLines:
    """llama.cpp's log pieces joined into lines, each logged at the level of the piece that began it."""

    def __init__(self) -> None:
        self.level = logging.INFO
        self.pending = ""

    def __call__(self, level: int, text: bytes, user_data) -> None:
        if level != GGML_CONTINUE:
            self.level = GGML_LEVELS.get(level, logging.INFO)
        if not LLAMA_CPP.isEnabledFor(self.level):
            self.pending = ""
            return
        self.pending += text.decode("utf-8", errors="replace")
        *lines, self.pending = self.pending.split("\n")
        for line in lines:
            if line.strip():
                LLAMA_CPP.log(self.level, line.rstrip())


_callback = None  # the ctypes callback llama.cpp holds: kept alive here


def route_llama_cpp_logs(lib) -> None:
    """Send llama.cpp's log lines (and ggml's) to the ``llama.cpp`` logger, once per process."""
    global _callback
    if _callback is not None:
        return
    _callback = lib.llama_log_callback(_LlamaCppLines())
    lib.llama_log_set(_callback, ctypes.c_void_p(0))
