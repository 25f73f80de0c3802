"""Settings of the Decode service."""

from __future__ import annotations

from dataclasses import dataclass, field

from model_runtime.config import ModelConfig
from transport.server import ServerConfig

DEFAULT_PORT = 50053


@dataclass(frozen=True)
class DecodeConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    server: ServerConfig = field(default_factory=lambda: ServerConfig(port=DEFAULT_PORT))
    max_new_tokens_limit: int = 4096
    max_transfer_bytes: int = 2 << 30
    """Largest single KV cache accepted from prefill."""
    pull_timeout_s: float = 60.0
    allow_kv_from: tuple[str, ...] = ("127.0.0.1:*", "localhost:*", "[::1]:*")
    """host:port patterns (fnmatch) of prefill servers this decoder may pull KV caches from.
    Requests naming any other address are refused: a client must not make us connect anywhere."""
