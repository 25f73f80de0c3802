"""The three stage boundaries, as small abstract classes with their contracts.

    EncodeStage.encode(MediaInput, SamplingOptions, ..., PruningConfig)   -> EncodedMedia
    PrefillStage.prefill(question, EncodedMedia, GenerationConfig, ..., PruningConfig) -> PrefillHandle
    DecodeStage.generate(PrefillHandle, GenerationConfig, ..., PruningConfig) -> async iter of TokenStep

Every stage takes the request's PruningConfig; with its default (all off) the stages are exact.

Cancellation: each call is an asyncio coroutine (or async iterator); cancelling it is how a caller
says its client went away. A stage then stops its work at the next safe point (the encoder at
the next frame group, the decoder at the next token), stores nothing (prefill keeps no KV cache
for a cancelled call) and frees what it held. A KV cache that prefill did store and that no
decoder will pull is dropped with `PrefillStage.release`.

Two implementations stand side by side: the `Local*Stage` classes (`epd.encoder_svc.stage`,
`epd.prefill_svc.stage`, `epd.decode_svc.stage`) run the engines in this process (the embedded
mode, the services' servicers, and the reference for tests) and `epd.transport.remote_stages`
calls the gRPC services. The
gateway's pipeline is written against these contracts only.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import torch

from epd.model_runtime.adapter import VisualMeta
from epd.model_runtime.sampling import GenerationConfig
from epd.token_pruning import PruningConfig, PruningStats
from epd.video.types import SamplingOptions


@dataclass(frozen=True)
class StageEvent:
    stage: str  # "upload" | "decode" | "encode" | "prefill" | "kv_transfer" | "generate"
    state: str  # "started" | "progress" | "finished"
    duration_ms: float = 0.0
    details: dict[str, str] = field(default_factory=dict)


EventSink = Callable[[StageEvent], None]


@dataclass
class MediaInput:
    """A video or image: its bytes, or only its sha256 when the encoder has seen it before."""

    data: bytes | None
    sha256: str = ""


@dataclass
class EncodedMedia:
    """Visual token embeddings and what prefill needs to place them."""

    embeds: torch.Tensor  # [num_visual_tokens, hidden_size]
    meta: VisualMeta
    num_frames: int
    frame_timestamps_s: list[float]
    decode_ms: float
    encode_ms: float
    cache_hit: bool = False
    sha256: str = ""
    token_index: torch.Tensor | None = None
    """[N'] long, increasing: index in the full visual-token list of each embedding, when
    encode-stage dropping removed some (None: all sent, in order)."""
    key_mask: torch.Tensor | None = None
    """[N'] bool: key tokens, which no later stage drops (None: none)."""
    pruning: PruningStats = field(default_factory=PruningStats)


@dataclass
class PrefillHandle:
    """Where the KV cache waits and what decoding starts from."""

    kv_handle: str
    kv_address: str  # "" for an in-process store
    first_token_id: int
    num_prompt_tokens: int
    num_cached_tokens: int
    next_position_ids: list[int]  # [4]: text, temporal, height, width
    kv_num_bytes: int
    prefill_ms: float
    num_visual_tokens_in: int = 0
    num_visual_tokens_out: int = 0
    kv_num_bytes_uncompressed: int = 0
    pruning: PruningStats = field(default_factory=PruningStats)
    visual_entry_mask: torch.Tensor | None = None
    """[num_layers, num_kv_heads, num_cached_tokens] bool: visual cache entries, for decode-stage
    eviction (None unless it is on)."""
    kept_visual_token_index: list[int] = field(default_factory=list)
    """Full-list index of each visual token left after prefill dropping (empty: all kept)."""


@dataclass
class TokenStep:
    """Tokens produced since the last step and the text they add."""

    token_ids: list[int]
    text: str
    finish_reason: str = ""  # "" while generating, then "stop" or "length"
    kv_transfer_ms: float = 0.0  # set on the first step
    kv_num_bytes: int = 0  # set on the first step
    decode_evict: tuple[int, int] | None = None  # last step: visual entries per head (in, out)


class RequestCancelled(Exception):
    """Raised inside an engine's blocking driver when its request's cancel flag is set: the work
    stops there and nobody waits for the result (the caller's task was already cancelled)."""


class EncodeStage(ABC):
    @abstractmethod
    async def encode(
        self,
        media: MediaInput,
        sampling: SamplingOptions,
        on_event: EventSink,
        request_id: str,
        pruning: PruningConfig = PruningConfig(),
    ) -> EncodedMedia:
        """Decode and encode the media. Raises MediaError / EpdError with a client-safe message."""


class PrefillStage(ABC):
    @abstractmethod
    async def prefill(
        self,
        question: str,
        media: EncodedMedia,
        generation: GenerationConfig,
        request_id: str,
        pruning: PruningConfig = PruningConfig(),
    ) -> PrefillHandle:
        """Run the prompt; the KV cache stays with the stage until a decoder takes it (or its TTL
        passes). Cancelled before it returns, the stage stores no cache."""

    @abstractmethod
    async def release(self, handle: PrefillHandle, request_id: str) -> None:
        """Drop the KV cache of `handle`: its request ended (cancelled or failed) before a decoder
        took it. Idempotent: an unknown, expired or already taken handle is not an error."""


class DecodeStage(ABC):
    @abstractmethod
    def generate(
        self,
        handle: PrefillHandle,
        generation: GenerationConfig,
        request_id: str,
        pruning: PruningConfig = PruningConfig(),
    ) -> AsyncIterator[TokenStep]:
        """Take the KV cache and stream tokens; the first step carries the first token (so once it
        arrives, the cache has left the prefill stage). Closing or cancelling the stream stops
        generation and frees the cache."""
