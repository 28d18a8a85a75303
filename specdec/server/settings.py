"""How one ``specdec serve`` process listens, and the limits its HTTP framing holds requests to."""

from __future__ import annotations

from dataclasses import dataclass

STALL_SECONDS = 300.0  # /health answers 503 when requests have waited this long without a step finishing


@dataclass(frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # checked on every endpoint but /health
    max_body_bytes: int = 1 << 20
    read_timeout: float = 30.0  # seconds a request body may stall between reads: 408 after
    body_timeout: float = 120.0  # seconds a request body may take in all, from the end of its head: 408 after
    head_timeout: float = 20.0  # seconds a request head may take from its first byte to its last: 408 after
    max_header_line: int = 8 << 10  # bytes of one header line (name, ": ", value): 431 above
    max_head_bytes: int = 32 << 10  # bytes of the request line and headers together: 431 above
    stall_seconds: float = STALL_SECONDS
