"""Settings of the Prefill service."""

from __future__ import annotations

from dataclasses import dataclass, field

from epd.model_runtime.config import ModelConfig
from epd.stages.server_config import ServerConfig

DEFAULT_PORT = 50052


@dataclass(frozen=True)
class PrefillConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    server: ServerConfig = field(default_factory=lambda: ServerConfig(port=DEFAULT_PORT))
    advertise_address: str = ""
    """host:port the decode service pulls KV caches from; default host:port of `server`."""
    max_prompt_tokens: int = 32768
    """Prompts longer than this (text + visual tokens) are refused."""
    max_question_chars: int = 4096
    kv_store_bytes: int = 4 << 30
    """KV caches waiting to be pulled may hold at most this many bytes; beyond it new prefills are
    refused with RESOURCE_EXHAUSTED until decoders catch up."""
    kv_ttl_s: float = 120.0
    """A KV cache nobody pulls within this time is dropped."""
    max_new_tokens_limit: int = 4096
    max_transfer_bytes: int = 1 << 30
    """Largest visual-embedding upload accepted."""

    def __post_init__(self) -> None:
        if self.kv_store_bytes < 0:
            raise ValueError(f"kv_store_bytes (--kv-store-bytes) must be >= 0, got {self.kv_store_bytes}")
        if self.kv_ttl_s <= 0:
            raise ValueError(f"kv_ttl_s (--kv-ttl) must be > 0 seconds, got {self.kv_ttl_s}")
