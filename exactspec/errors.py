"""Errors that carry a message meant for the user, not a traceback."""

import sys
from collections.abc import Callable

EXIT_USAGE = 2  # what bad input exits with, from the CLI and from the ``python -m`` scripts


class ExactspecError(Exception):
    """Base class for errors that the CLI reports as one line."""


class UsageError(ExactspecError, ValueError):
    """Bad input from the user: a setting out of range, a missing file, an incompatible model."""


def run_script(main: Callable[[], int | None]) -> int:
    """A ``python -m exactspec...`` script's main, run as the CLI runs a command: bad input (an ExactspecError, such as
    a prompt file that is not there) ends it with one line on stderr and exit 2, not a traceback."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    try:
        return main() or 0
    except ExactspecError as error:
        print(f"{spec.name if spec else 'exactspec'}: error: {error}", file=sys.stderr)
        return EXIT_USAGE
