"""What the SDK hands back: typed results, stream events and errors (no protobuf in user code).

`AskResult` carries every field of the server's summary (`epd.v1.AskSummary`), under the same
names as the HTTP API's `epd` object and `epd ask --json` (`AskResult.to_dict()` is that JSON):

    answer, token_ids, finish_reason, stop_reason, request_id, num_frames, frame_timestamps_s,
    num_visual_tokens, num_prompt_tokens, num_reused_prompt_tokens, kv_num_bytes,
    encoder_cache_hit, media_sha256, timings_ms (Timings), pruning (PruningReport), grid_thw
    (GridTHW), kept_visual_token_index, events (StageEvent), and, from the SDK itself,
    num_attempts and media_num_bytes_sent.

Stage names are `epd.stages.names.Stage`: "video_decode" is decoding the video's frames,
"generate" is token generation. An older server's "decode" arrives as Stage.VIDEO_DECODE.

Changed in 0.2, with the 0.1 form kept (deprecated) until 0.3:
  - `timings_ms` is a `Timings` dataclass (`result.timings_ms.ttft_ms`). It still reads like the
    0.1 dict (`result.timings_ms["ttft"]`, `.get`, `in`, iteration), where the key "decode" is the
    old name of "video_decode".
  - `events` are SDK `StageEvent`s, not protos; `event_protos` gives the 0.1 protos.
  - `AsyncEpdClient.ask_stream` (raw protos) is deprecated: use `stream`.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import grpc

from epd.model_runtime.logprobs import TokenLogprob, TopLogprob
from epd.stages.names import TIMING_NAMES, Stage, timings_from_either, timings_with_legacy_names
from epd.transport.message_convert import logprobs_from_proto, stop_reason_from_proto
from epd.v1 import common_pb2, gateway_pb2

__all__ = [
    "AskResult",
    "EpdError",
    "GridTHW",
    "PruningReport",
    "PruningStageCount",
    "Stage",
    "StageEvent",
    "StreamEvent",
    "Timings",
    "TokenDelta",
    "TokenizeResult",
    "TokenLogprob",
    "TopLogprob",
]


class EpdError(Exception):
    """A call failed; `code` is the gRPC status (`grpc.StatusCode`), `message` says what to change."""

    def __init__(
        self, code: grpc.StatusCode, message: str, retry_after_s: int | None = None, request_id: str = ""
    ) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.request_id = request_id
        """The id the server ran the request under (its `x-request-id`, as the HTTP API's response
        header; the server's log lines carry it); "" when the call failed before reaching it."""
        self.retry_after_s = retry_after_s
        """Seconds to wait before the same request may succeed, when the server refused it for load
        (a RESOURCE_EXHAUSTED marked busy: the HTTP API's 429 + Retry-After); None for every other
        failure, a RESOURCE_EXHAUSTED for a limit included (HTTP's 413: send less, not later)."""


@dataclass(frozen=True)
class StageEvent:
    """A stage of the request started, progressed or finished (in the order the server saw it)."""

    stage: Stage | str
    """A `Stage` (upload, video_decode, encode, prefill, kv_transfer, generate); a name this SDK
    does not know (a newer server's) stays a plain str."""
    state: str
    """"started", "progress" or "finished"."""
    at_ms: float
    """Milliseconds since the request reached the front door."""
    duration_ms: float = 0.0
    """For "finished": how long the stage took."""
    details: dict[str, str] = field(default_factory=dict)
    """Free-form details, e.g. {"num_frames": "8", "cache": "hit"}."""

    def to_dict(self) -> dict[str, Any]:
        return {"stage": str(self.stage), "state": self.state, "at_ms": self.at_ms,
                "duration_ms": self.duration_ms, "details": dict(self.details)}  # fmt: skip


@dataclass(frozen=True)
class TokenDelta:
    """Tokens generated since the previous delta, and the text they completed."""

    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None = None
    """One per token of `token_ids` when the request asked (`logprobs=k`); else None."""


@dataclass
class Timings(Mapping[str, float]):
    """Milliseconds per stage of the request (0.0 when the server did not report one).

    Also a read-only mapping by wire name ("video_decode", "encode", "prefill", "kv_transfer",
    "generate", "ttft", "total"; "decode" too, the old name of "video_decode"): the 0.1 dict form,
    deprecated, kept until 0.3."""

    video_decode_ms: float = 0.0
    """Decoding the sampled frames of the video (0 when the encoder's cache served them)."""
    encode_ms: float = 0.0
    """The vision tower (0 on an encoder cache hit)."""
    prefill_ms: float = 0.0
    kv_transfer_ms: float = 0.0
    """The decoder pulling the KV cache from prefill."""
    generate_ms: float = 0.0
    """Token generation, the KV transfer included."""
    ttft_ms: float = 0.0
    """Time to the first token, from the request reaching the front door."""
    total_ms: float = 0.0
    extra_ms: dict[str, float] = field(default_factory=dict)
    """Timings of a newer server that this SDK has no field for, by wire name."""

    @classmethod
    def from_wire(cls, timings_ms: Mapping[str, float]) -> Timings:
        """From a `timings_ms` map of a server of any version (old names accepted)."""
        named = timings_from_either(timings_ms)
        known = {f"{name}_ms": float(named.pop(name)) for name in TIMING_NAMES if name in named}
        return cls(**known, extra_ms={name: float(v) for name, v in named.items()})

    def to_dict(self) -> dict[str, float]:
        """By wire name, as the HTTP API and `epd ask --json` write them (with "decode" until 0.3)."""
        return timings_with_legacy_names(
            {**{name: float(getattr(self, f"{name}_ms")) for name in TIMING_NAMES}, **self.extra_ms}
        )

    # -- the 0.1 dict form (deprecated) ---------------------------------------------------------

    def __getitem__(self, name: str) -> float:
        warnings.warn(
            "reading AskResult.timings_ms like a dict is deprecated (removed in 0.3); "
            "use its fields, e.g. timings_ms.ttft_ms or timings_ms.video_decode_ms",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.to_dict()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.to_dict())

    def __len__(self) -> int:
        return len(self.to_dict())


@dataclass(frozen=True)
class PruningStageCount:
    """Visual tokens entering and leaving one token-dropping stage."""

    stage: str
    """"temporal", "spatial_merge", "prefill_drop", "kv_compress" or "decode_evict"."""
    num_visual_tokens_in: int
    num_visual_tokens_out: int


@dataclass(frozen=True)
class PruningReport:
    """What token dropping and KV compression did to the request (empty when all were off)."""

    stages: tuple[PruningStageCount, ...] = ()
    """One entry per stage that ran, in order."""
    num_key_tokens: int = 0
    """Visual tokens flagged never-drop at encode."""
    prefill_flops_full: int = 0
    """Estimated prefill FLOPs had nothing been pruned."""
    prefill_flops_pruned: int = 0
    """Estimated prefill FLOPs of the prefill that ran."""
    kv_bytes_before: int = 0
    """KV cache bytes after prefill, before compression."""
    kv_bytes_after: int = 0
    """KV cache bytes sent to Decode."""
    transfer_bytes: int = 0
    """Tensor bytes that crossed a process boundary for the request, summed over its hops (visual
    embeddings encoder -> gateway -> prefill, the KV cache prefill -> decode; docs/architecture.md,
    "Bytes moved per request"); 0 from an embedded or colocated server, where nothing crosses."""

    @property
    def prefill_flops_saved(self) -> int:
        return self.prefill_flops_full - self.prefill_flops_pruned

    def to_dict(self) -> dict[str, Any]:
        """As the HTTP API's `epd.pruning` writes it."""
        return {
            "stages": [
                {"stage": s.stage, "num_visual_tokens_in": s.num_visual_tokens_in,
                 "num_visual_tokens_out": s.num_visual_tokens_out}
                for s in self.stages
            ],
            "num_key_tokens": self.num_key_tokens,
            "prefill_flops_full": self.prefill_flops_full,
            "prefill_flops_pruned": self.prefill_flops_pruned,
            "kv_bytes_before": self.kv_bytes_before,
            "kv_bytes_after": self.kv_bytes_after,
            "transfer_bytes": self.transfer_bytes,
            "prefill_flops_saved": self.prefill_flops_saved,
        }  # fmt: skip


class GridTHW(NamedTuple):
    """Grid of the vision input, in patches. With `kept_visual_token_index` it tells which
    visual tokens of which frames survived token dropping: a token covers `temporal_patch` (2)
    frames and 2x2 patches, tokens numbered group by group, row by row."""

    temporal: int
    height: int
    width: int


@dataclass
class AskResult:
    """The whole answer, sent last by the server (the summary), and how the call went."""

    answer: str
    token_ids: list[int]
    finish_reason: str
    """"stop" or "length"."""
    num_frames: int
    num_visual_tokens: int
    num_prompt_tokens: int
    timings_ms: Timings
    """Per stage, in milliseconds (see `Timings`)."""
    kv_num_bytes: int
    """KV cache bytes moved from Prefill to Decode."""
    encoder_cache_hit: bool
    """True when the encoder served the visual tokens from its cache."""
    media_sha256: str
    events: list[StageEvent] = field(default_factory=list)
    """The stage events of the call, in order (SDK StageEvents; protos in 0.1: `event_protos`)."""
    request_id: str = ""
    frame_timestamps_s: list[float] = field(default_factory=list)
    """Time in the video of each sampled frame."""
    num_attempts: int = 1
    """Calls made, retries of UNAVAILABLE included."""
    media_num_bytes_sent: int = 0
    """Media bytes uploaded by the call that answered; 0 when the server reused them by hash."""
    pruning: PruningReport = field(default_factory=PruningReport)
    """What token dropping and KV compression did (empty when off)."""
    grid_thw: GridTHW = GridTHW(0, 0, 0)
    """Grid of the vision input in patches (temporal, height, width)."""
    kept_visual_token_index: list[int] = field(default_factory=list)
    """Index, in the full list of visual tokens, of each one that reached the KV cache; empty
    when every token did."""
    num_reused_prompt_tokens: int = 0
    """Prompt tokens whose KV the server's prefill took from its prefix cache (earlier turns of
    the same conversation about the same media) instead of computing them; 0 when none."""
    stop_reason: str | int | None = None
    """vLLM's: the stop string that ended the answer, or the stop token id (of `stop_token_ids`);
    None when the end-of-sequence token or `max_new_tokens` ended it."""
    logprobs: list[TokenLogprob] | None = None
    """One per token of `token_ids` when the request asked (`logprobs=k`): the token's float32
    log-probability under the model's raw distribution and the k most likely tokens' (`top`, in
    rank order); None when it did not ask."""
    prompt_logprobs: list[TokenLogprob] | None = None
    """One per prompt token when the request asked (`prompt_logprobs=k`), else None: each after the
    first with its log-probability given the tokens before it, its `rank` and the k most likely
    tokens' there; the first's logprob is NaN (nothing comes before it)."""
    prompt_token_ids: list[int] | None = None
    """The prompt's token ids as the server's prefill ran it (`num_prompt_tokens` of them, media
    placeholders included) when the request asked (`return_prompt_token_ids=True`), else None."""

    def __post_init__(self) -> None:
        if not isinstance(self.timings_ms, Timings):  # a 0.1 caller's dict
            self.timings_ms = Timings.from_wire(self.timings_ms)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able, with the field names of the HTTP API's `epd` object."""
        return {
            "request_id": self.request_id,
            "answer": self.answer,
            "token_ids": list(self.token_ids),
            "finish_reason": self.finish_reason,
            "num_frames": self.num_frames,
            "frame_timestamps_s": list(self.frame_timestamps_s),
            "num_visual_tokens": self.num_visual_tokens,
            "num_prompt_tokens": self.num_prompt_tokens,
            "timings_ms": self.timings_ms.to_dict(),
            "kv_num_bytes": self.kv_num_bytes,
            "encoder_cache_hit": self.encoder_cache_hit,
            "media_sha256": self.media_sha256,
            "pruning": self.pruning.to_dict(),
            "grid_thw": list(self.grid_thw),
            "kept_visual_token_index": list(self.kept_visual_token_index),
            "num_reused_prompt_tokens": self.num_reused_prompt_tokens,
            "stop_reason": self.stop_reason,
            "logprobs": None if self.logprobs is None else [logprob_to_dict(lp) for lp in self.logprobs],
            # vLLM's None for the first prompt token (its NaN); the others with their rank.
            "prompt_logprobs": None
            if self.prompt_logprobs is None
            else [
                None if math.isnan(lp.logprob) else {**logprob_to_dict(lp), "rank": lp.rank}
                for lp in self.prompt_logprobs
            ],
            "prompt_token_ids": None if self.prompt_token_ids is None else list(self.prompt_token_ids),
            "events": [e.to_dict() for e in self.events],
            "num_attempts": self.num_attempts,
            "media_num_bytes_sent": self.media_num_bytes_sent,
        }

    @property
    def event_protos(self) -> list[common_pb2.StageEvent]:
        """Deprecated (removed in 0.3): the events as `epd.v1.StageEvent` protos, as 0.1's
        `events` were. Use `events`."""
        warnings.warn("AskResult.event_protos is deprecated (removed in 0.3); use AskResult.events",
                      DeprecationWarning, stacklevel=2)  # fmt: skip
        return [
            common_pb2.StageEvent(stage=str(e.stage), state=e.state, at_ms=e.at_ms, duration_ms=e.duration_ms,
                                  details=e.details)
            for e in self.events
        ]  # fmt: skip


@dataclass(frozen=True)
class TokenizeResult:
    """`tokenize()`'s answer: the HTTP API's /tokenize answer (vLLM's), under the SDK's names."""

    token_ids: list[int]
    """The ids, in order (HTTP: tokens). For a conversation with the default options, exactly the
    prompt the server runs for it: `len(token_ids)` is its answer's `num_prompt_tokens`."""
    max_model_len: int | None
    """The longest prompt plus answer a request may have (vLLM's); None while the server does not
    know it yet (its gateway has not heard from prefill)."""
    token_strs: list[str] | None = None
    """With return_token_strs=True: the tokenizer's token of each id; None otherwise."""

    @property
    def num_tokens(self) -> int:
        """How many ids (HTTP: count)."""
        return len(self.token_ids)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able, with the HTTP API's /tokenize field names."""
        return {"count": self.num_tokens, "max_model_len": self.max_model_len, "tokens": list(self.token_ids),
                "token_strs": None if self.token_strs is None else list(self.token_strs)}  # fmt: skip


StreamEvent = StageEvent | TokenDelta | AskResult
"""What `stream()` yields: stage events and token deltas as they happen, then one AskResult."""


def stage_event_from_proto(e: common_pb2.StageEvent) -> StageEvent:
    return StageEvent(Stage.of(e.stage), e.state, e.at_ms, e.duration_ms, dict(e.details))


def pruning_from_proto(p: common_pb2.PruningReport) -> PruningReport:
    return PruningReport(
        stages=tuple(
            PruningStageCount(s.stage, s.num_visual_tokens_in, s.num_visual_tokens_out) for s in p.stages
        ),
        num_key_tokens=p.num_key_tokens,
        prefill_flops_full=p.prefill_flops_full,
        prefill_flops_pruned=p.prefill_flops_pruned,
        kv_bytes_before=p.kv_bytes_before,
        kv_bytes_after=p.kv_bytes_after,
        transfer_bytes=p.transfer_bytes,
    )


def result_from_proto(
    s: gateway_pb2.AskSummary, events: list[StageEvent], prompt_logprobs: list[TokenLogprob] | None = None
) -> AskResult:
    """prompt_logprobs: joined from the call's `AskResponse.prompt_logprobs` pieces (None: none came)."""
    grid = list(s.grid_thw)
    return AskResult(
        answer=s.answer,
        token_ids=list(s.token_ids),
        finish_reason=s.finish_reason,
        num_frames=s.num_frames,
        num_visual_tokens=s.num_visual_tokens,
        num_prompt_tokens=s.num_prompt_tokens,
        timings_ms=Timings.from_wire(s.timings_ms),
        kv_num_bytes=s.kv_num_bytes,
        encoder_cache_hit=s.encoder_cache_hit,
        media_sha256=s.media_sha256,
        events=events,
        request_id=s.request_id,
        frame_timestamps_s=list(s.frame_timestamps_s),
        pruning=pruning_from_proto(s.pruning),
        # An older server sends no grid: zeros, like every other field it did not send.
        grid_thw=GridTHW(*grid) if len(grid) == 3 else GridTHW(0, 0, 0),
        kept_visual_token_index=list(s.kept_visual_token_index),
        num_reused_prompt_tokens=s.num_reused_prompt_tokens,
        stop_reason=stop_reason_from_proto(s),
        logprobs=logprobs_from_proto(s.logprobs),
        prompt_logprobs=prompt_logprobs,
        prompt_token_ids=list(s.prompt_token_ids) or None,  # a prompt is never empty: not asked
    )


def tokenize_result_from_proto(
    r: gateway_pb2.GatewayServiceTokenizeResponse, return_token_strs: bool
) -> TokenizeResult:
    """`return_token_strs`: the request's (an empty repeated field cannot say whether they were asked)."""
    return TokenizeResult(
        token_ids=list(r.token_ids),
        max_model_len=r.max_model_len if r.HasField("max_model_len") else None,
        token_strs=list(r.token_strs) if return_token_strs else None,
    )


def logprob_to_dict(lp: TokenLogprob) -> dict[str, Any]:
    """JSON-able; -inf (a masked logit) as JSON cannot hold it: vLLM's floor, -9999.0."""
    return {
        "token_id": lp.token_id,
        "token": lp.token,
        "logprob": max(lp.logprob, -9999.0),
        "top": [
            {"token_id": t.token_id, "token": t.token, "logprob": max(t.logprob, -9999.0)} for t in lp.top
        ],
    }
