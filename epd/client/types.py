"""What the SDK hands back: typed results, stream events and errors (no protobuf in user code)."""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc

from epd.v1 import common_pb2, gateway_pb2


class EpdError(Exception):
    """A call failed; `code` is the gRPC status (`grpc.StatusCode`), `message` says what to change."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


@dataclass(frozen=True)
class StageEvent:
    """A stage of the request started, progressed or finished (in the order the server saw it)."""

    stage: str
    """"upload", "decode", "encode", "prefill", "kv_transfer" or "decode_tokens"."""
    state: str
    """"started", "progress" or "finished"."""
    at_ms: float
    """Milliseconds since the request reached the front door."""
    duration_ms: float = 0.0
    """For "finished": how long the stage took."""
    details: dict[str, str] = field(default_factory=dict)
    """Free-form details, e.g. {"num_frames": "8", "cache": "hit"}."""


@dataclass(frozen=True)
class TokenDelta:
    """Tokens generated since the previous delta, and the text they completed."""

    token_ids: list[int]
    text: str


@dataclass
class AskResult:
    """The whole answer, sent last by the server (the summary)."""

    answer: str
    token_ids: list[int]
    finish_reason: str
    """"stop" or "length"."""
    num_frames: int
    num_visual_tokens: int
    num_prompt_tokens: int
    timings_ms: dict[str, float]
    """Per stage: decode, encode, prefill, kv_transfer, ttft, generate, total."""
    kv_num_bytes: int
    """KV cache bytes moved from Prefill to Decode."""
    encoder_cache_hit: bool
    """True when the encoder served the visual tokens from its cache."""
    media_sha256: str
    events: list[common_pb2.StageEvent] = field(default_factory=list)
    """The stage events of the call, as protos (kept for callers of the first SDK version)."""
    request_id: str = ""
    frame_timestamps_s: list[float] = field(default_factory=list)
    """Time in the video of each sampled frame."""
    num_attempts: int = 1
    """Calls made, retries of UNAVAILABLE included."""
    media_num_bytes_sent: int = 0
    """Media bytes uploaded by the call that answered; 0 when the server reused them by hash."""


StreamEvent = StageEvent | TokenDelta | AskResult
"""What `stream()` yields: stage events and token deltas as they happen, then one AskResult."""


def stage_event_from_proto(e: common_pb2.StageEvent) -> StageEvent:
    return StageEvent(e.stage, e.state, e.at_ms, e.duration_ms, dict(e.details))


def result_from_proto(s: gateway_pb2.AskSummary, events: list[common_pb2.StageEvent]) -> AskResult:
    return AskResult(
        answer=s.answer,
        token_ids=list(s.token_ids),
        finish_reason=s.finish_reason,
        num_frames=s.num_frames,
        num_visual_tokens=s.num_visual_tokens,
        num_prompt_tokens=s.num_prompt_tokens,
        timings_ms=dict(s.timings_ms),
        kv_num_bytes=s.kv_num_bytes,
        encoder_cache_hit=s.encoder_cache_hit,
        media_sha256=s.media_sha256,
        events=events,
        request_id=s.request_id,
        frame_timestamps_s=list(s.frame_timestamps_s),
    )
