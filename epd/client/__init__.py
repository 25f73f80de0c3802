"""Python client SDK of an epd front door (gRPC): sync and asyncio clients, typed stream events,
chunked uploads or reuse by sha256, deadlines, retries of UNAVAILABLE, TLS and an API key."""

from epd.client.client import AsyncEpdClient, EpdClient, build_header
from epd.client.media import MediaSource
from epd.client.retry import NO_RETRY, RetryPolicy
from epd.client.types import AskResult, EpdError, StageEvent, StreamEvent, TokenDelta

__all__ = [
    "NO_RETRY",
    "AskResult",
    "AsyncEpdClient",
    "EpdClient",
    "EpdError",
    "MediaSource",
    "RetryPolicy",
    "StageEvent",
    "StreamEvent",
    "TokenDelta",
    "build_header",
]
