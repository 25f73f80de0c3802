"""Settings of the front door."""

from __future__ import annotations

from dataclasses import dataclass, field

from model_runtime.sampling import GenerationConfig
from transport.server import ServerConfig
from video.types import SamplingOptions

DEFAULT_PORT = 50050


@dataclass(frozen=True)
class GatewayConfig:
    server: ServerConfig = field(default_factory=lambda: ServerConfig(port=DEFAULT_PORT))
    encoder_addresses: tuple[str, ...] = ("127.0.0.1:50051",)
    """Replicas of the Encode service (round-robin)."""
    prefill_addresses: tuple[str, ...] = ("127.0.0.1:50052",)
    decode_addresses: tuple[str, ...] = ("127.0.0.1:50053",)
    max_upload_bytes: int = 256 * 1024 * 1024
    """Largest media upload accepted; larger ones get RESOURCE_EXHAUSTED before any decoding."""
    stage_timeout_s: float = 600.0
    """Deadline of each call to a stage."""
    max_transfer_bytes: int = 1 << 30
    """Largest visual-embedding tensor accepted from an encoder."""
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    """Defaults for sampling fields a request leaves unset."""
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    """Defaults for generation fields a request leaves unset."""
