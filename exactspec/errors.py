"""Errors that carry a message meant for the user, not a traceback."""


class ExactspecError(Exception):
    """Base class for errors that the CLI reports as one line."""


class UsageError(ExactspecError, ValueError):
    """Bad input from the user: a setting out of range, a missing file, an incompatible model."""
