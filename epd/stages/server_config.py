"""Where a service listens and the message sizes every server and channel agrees on. No gRPC here:
service configs (encoder_svc.config, ...) embed `ServerConfig`, and engines read those configs.
"""

from __future__ import annotations

from dataclasses import dataclass

CHUNK_BYTES = 1 << 20
"""Payload per message. With the 4 MiB channel limit this leaves room for headers and lets the
receiver start copying early."""
MAX_MESSAGE_BYTES = 4 << 20
"""gRPC receive/send limit we set on purpose on every server and channel."""


@dataclass(frozen=True)
class ServerConfig:
    """Where a service listens and how it drains."""

    host: str = "127.0.0.1"
    """Interface to bind; 0.0.0.0 in containers."""
    port: int = 0
    """TCP port; 0 picks a free one (tests)."""
    max_message_bytes: int = MAX_MESSAGE_BYTES
    """Largest gRPC message sent or received; tensors are chunked below it."""
    grace_s: float = 5.0
    """On shutdown, in-flight calls get this long to finish."""

    def __post_init__(self) -> None:
        if self.max_message_bytes < MIN_MESSAGE_BYTES:
            raise ValueError(
                f"max_message_bytes must be at least {MIN_MESSAGE_BYTES} (one {CHUNK_BYTES}-byte media or "
                f"tensor chunk plus its header), got {self.max_message_bytes}"
            )

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


MIN_MESSAGE_BYTES = CHUNK_BYTES + (64 << 10)
"""Smallest workable message limit: every stream (uploads, tensors, KV caches) is cut into
CHUNK_BYTES pieces, and a piece travels with a small header (tensor name, shape, offsets)."""
