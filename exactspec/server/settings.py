"""How one ``exactspec serve`` process listens, and the limits its HTTP framing holds requests to."""

from __future__ import annotations

from dataclasses import dataclass

from exactspec.errors import UsageError
from exactspec.listening import MAX_PORT

STALL_SECONDS = 300.0  # /health answers 503 when requests have waited this long without a step finishing


@dataclass(frozen=True)
class ServerSettings:
    """Checked when made (a :class:`UsageError` naming the field as its flag, in one line), as
    :class:`exactspec.server.batching.BatchSettings` are: the CLI, the tests and Ray's replicas share the checks."""

    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port
    api_key: str | None = None  # checked on every endpoint but /health
    max_body_bytes: int = 1 << 20
    read_timeout: float = 30.0  # seconds a request body may stall between reads: 408 after
    body_timeout: float = 120.0  # seconds a request body may take in all, from the end of its head: 408 after
    head_timeout: float = 20.0  # seconds a request head may take from its first byte to its last: 408 after
    max_header_line: int = 8 << 10  # bytes of one header line (name, ": ", value): 431 above
    max_head_bytes: int = 32 << 10  # bytes of the request line and headers together: 431 above
    stall_seconds: float = STALL_SECONDS

    def __post_init__(self) -> None:
        if not 0 <= self.port <= MAX_PORT:
            raise UsageError(f"port must be in 0..{MAX_PORT}, got {self.port}")
        if self.api_key is not None and not self.api_key.strip():
            raise UsageError("api-key must not be empty (give none to serve without a key)")
        for name, low in (("max_body_bytes", 1024), ("max_header_line", 256), ("max_head_bytes", 256)):
            if getattr(self, name) < low:
                raise UsageError(f"{_flag(name)} must be >= {low}, got {getattr(self, name)}")
        for name in ("read_timeout", "body_timeout", "head_timeout", "stall_seconds"):
            if not getattr(self, name) > 0:  # (NaN too)
                raise UsageError(f"{_flag(name)} must be > 0 seconds, got {getattr(self, name):g}")


def _flag(name: str) -> str:
    """A field's name as the CLI spells its flag."""
    return name.replace("_", "-")
