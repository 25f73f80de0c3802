"""Python client SDK of an epd front door (gRPC): sync and asyncio clients, typed stream events
and results (no protobuf in user code), chunked uploads or reuse by sha256, deadlines, retries of
UNAVAILABLE, TLS and an API key. A call carries a conversation (`Message`s of text / VIDEO /
IMAGE parts in your order, `epd.stages.messages`) or, the 0.1 form kept until 0.3, one question. Result fields and the 0.2 renames: `epd.client.types`. Follow-up questions that see the earlier
answers: `client.conversation(video)` (`epd.client.conversation`). A text's or a text-only
conversation's token ids, and back: `client.tokenize(...)`, `client.detokenize(...)`. The clients:
`epd.client.client` (asyncio) and `epd.client.sync_client` (blocking); a call's options, checked
before it is sent: `build_header` (`epd.client.request`)."""

from epd.client.client import AsyncEpdClient
from epd.client.conversation import AsyncConversation, Conversation
from epd.client.media import MediaSource
from epd.client.request import build_header
from epd.client.retry import NO_RETRY, RetryPolicy
from epd.client.sync_client import EpdClient
from epd.client.types import (
    AskResult,
    EpdError,
    GridTHW,
    PruningReport,
    PruningStageCount,
    Stage,
    StageEvent,
    StreamEvent,
    Timings,
    TokenDelta,
    TokenizeResult,
    TokenLogprob,
    TopLogprob,
)
from epd.stages.messages import IMAGE, VIDEO, ContentPart, Message, ToolCall

__all__ = [
    "IMAGE",
    "NO_RETRY",
    "VIDEO",
    "AskResult",
    "AsyncConversation",
    "AsyncEpdClient",
    "ContentPart",
    "Conversation",
    "EpdClient",
    "EpdError",
    "GridTHW",
    "MediaSource",
    "Message",
    "PruningReport",
    "PruningStageCount",
    "RetryPolicy",
    "Stage",
    "StageEvent",
    "StreamEvent",
    "Timings",
    "TokenDelta",
    "TokenizeResult",
    "TokenLogprob",
    "ToolCall",
    "TopLogprob",
    "build_header",
]
