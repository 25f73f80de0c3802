"""Settings of the Encode service."""

from __future__ import annotations

from dataclasses import dataclass, field

from model_runtime.config import ModelConfig
from transport.server import ServerConfig
from video.types import DecodeLimits, SamplingOptions

DEFAULT_PORT = 50051


@dataclass(frozen=True)
class EncoderConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    server: ServerConfig = field(default_factory=lambda: ServerConfig(port=DEFAULT_PORT))
    limits: DecodeLimits = field(default_factory=DecodeLimits)
    """Caps on uploads and decoding: bytes, duration, pixels, frames."""
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    """Defaults for fields a request leaves unset."""
    max_visual_tokens: int = 16384
    """A request whose sampling would give more visual tokens is refused before encoding."""
