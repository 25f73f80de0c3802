"""The three stage boundaries, as small abstract classes with their contracts.

    EncodeStage.encode(MediaInput, SamplingOptions, ..., PruningConfig)   -> EncodedMedia
    PrefillStage.prefill(messages, EncodedMedia | None, GenerationConfig, ..., PruningConfig) -> PrefillHandle
    DecodeStage.generate(PrefillHandle, GenerationConfig, ..., PruningConfig) -> async iter of TokenStep

Every stage takes the request's PruningConfig; with its default (all off) the stages are exact.
Encode and prefill take the request's `cache_salt` (its tenant): part of every cache key, so one
tenant never reads what another cached ("" = one shared tenant, the default without API keys).

One type per boundary result, like vLLM v1's EngineCoreRequest/EngineCoreOutput: the engines
build these types themselves, `epd.transport.convert` turns each into protobuf and back in one
place, and the encoder's token cache stores `EncodedMedia` through its one plain-data form,
`EncodedMedia.to_record()` / `from_record()`.

Cancellation: each call is an asyncio coroutine (or async iterator); cancelling it is how a caller
says its client went away. A stage then stops its work at the next safe point (the encoder at
the next frame group, the decoder at the next token), stores nothing (prefill keeps no KV cache
for a cancelled call) and frees what it held. A KV cache that prefill did store and that no
decoder will pull is dropped with `PrefillStage.release`.

Two implementations stand side by side: the `Local*Stage` classes (`epd.encoder_svc.stage`,
`epd.prefill_svc.stage`, `epd.decode_svc.stage`) run the engines in this process (the embedded
mode, the services' servicers, and the reference for tests) and the `Remote*Stage` classes
(`epd.transport.remote_encode`, `remote_prefill`, `remote_decode`) call the gRPC services. The gateway's pipeline is written against these contracts only.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from epd.model_runtime.adapter import VisualMeta, VLMAdapter
from epd.model_runtime.detokenizer import StopReason
from epd.model_runtime.logprobs import TokenLogprob
from epd.model_runtime.sampling import GenerationConfig, StructuredOutputs
from epd.stages.errors import InvalidRequest
from epd.stages.messages import ChatTemplateOptions, Message
from epd.stages.model_info import ModelInfo
from epd.stages.raw_prompt import RawPrompt
from epd.stages.scheduling import check_priority
from epd.stages.tokenize import TokenizeInput, TokenizeOutput
from epd.token_pruning import PruningConfig, PruningStats
from epd.video.types import SamplingOptions

if TYPE_CHECKING:
    import torch  # the gateway imports this module and must start without torch


@dataclass(frozen=True)
class StageEvent:
    stage: str  # a Stage (epd.stages.names), the one list of stage names
    state: str  # "started" | "progress" | "finished"
    duration_ms: float = 0.0
    details: dict[str, str] = field(default_factory=dict)


EventSink = Callable[[StageEvent], None]


@dataclass
class MediaInput:
    """A video or image: its bytes, or only its sha256 when the encoder has seen it before."""

    data: bytes | None
    sha256: str = ""


MAX_CACHE_SALT_CHARS = 256


def check_cache_salt(salt: str) -> str:
    """A request's `cache_salt` (vLLM's name): any printable text up to 256 characters; requests
    share cached tokens and prefix KV only when their salts are equal ("" = the shared tenant)."""
    if not isinstance(salt, str):
        raise InvalidRequest("cache_salt must be a string")
    if len(salt) > MAX_CACHE_SALT_CHARS:
        raise InvalidRequest(
            f"cache_salt has {len(salt)} characters, over the limit of {MAX_CACHE_SALT_CHARS}"
        )
    if not salt.isprintable():
        raise InvalidRequest("cache_salt must be printable text (no control characters or line breaks)")
    return salt


class TensorLike(Protocol):
    """What the boundary types need of their tensors. Two forms satisfy it: torch.Tensor (the
    engines, the embedded mode, the token cache, the services after receiving) and the wire form
    `epd.transport.tensor_wire.WireTensor` (dtype name, shape, bytes; no torch), in which the
    gateway relays a request's tensors from one stage to the next without looking inside."""

    @property
    def shape(self) -> Sequence[int]: ...

    def tolist(self) -> Any: ...


T = TypeVar("T", bound=TensorLike)
"""The tensor form of an `EncodedMedia` / `MediaRecord` / `PrefillHandle`: all its tensors are
torch.Tensor, or all are WireTensor (`EncodedMedia[WireTensor]` in the gateway's remote stages)."""

IndexFromList = Callable[[list, str], Any]
"""(values, dtype name "int64" | "bool") -> a 1-D tensor [len(values)] of the wanted form."""


def torch_from_list(values: list, dtype: str) -> torch.Tensor:
    import torch

    return torch.tensor(values, dtype=getattr(torch, dtype))


@dataclass
class MediaRecord(Generic[T]):
    """An `EncodedMedia` as plain data: its tensors by name and a JSON-able dict of everything else.

    The keys of `fields` are the field names of the wire's `epd.v1.EncodeResult` (with
    `pruning` the fields of `epd.v1.PruningReport`), so the proto converter is
    `EncodeResult(**record.fields)` and its inverse; the encoder's token cache stores the same
    record (tensors in a safetensors file, `fields` in its JSON sidecar). Its tensors (the
    embeddings and any DeepStack features) travel on the wire as named tensor chunks beside the
    EncodeResult, through the same byte-budgeted assembler.
    """

    tensors: dict[str, T]
    """{"visual_embeds": [num_visual_tokens, hidden_size]} plus, for DeepStack families
    (Qwen3-VL), {"deepstack.{k}": [num_visual_tokens, hidden_size]} for k < num_deepstack_features."""
    fields: dict[str, Any]


@dataclass
class EncodedMedia(Generic[T]):
    """Visual token embeddings and what prefill needs to place them.

    Its tensors are torch.Tensor everywhere a model runs; the gateway holds them in wire form
    (`EncodedMedia[WireTensor]`, see `TensorLike`) since it only relays them to prefill."""

    embeds: T  # [num_visual_tokens, hidden_size]
    meta: VisualMeta
    num_frames: int
    frame_timestamps_s: list[float]
    decode_ms: float
    encode_ms: float
    cache_hit: bool = False
    sha256: str = ""
    token_index: T | None = None
    """[N'] long, increasing: index in the full visual-token list of each embedding, when
    encode-stage dropping removed some (None: all sent, in order)."""
    key_mask: T | None = None
    """[N'] bool: key tokens, which no later stage drops (None: none)."""
    pruning: PruningStats = field(default_factory=PruningStats)
    deepstack: list[T] = field(default_factory=list)
    """DeepStack features (Qwen3-VL): one [N', hidden_size] per DeepStack layer, row i belonging to
    embedding i, so every stage that drops or keeps visual tokens keeps the same rows of each;
    empty for families without DeepStack."""

    def to_record(self) -> MediaRecord[T]:
        """The one plain-data form of this object (see `MediaRecord`); `from_record` inverts it."""
        tensors = {"visual_embeds": self.embeds}
        tensors.update({deepstack_tensor_name(k): d for k, d in enumerate(self.deepstack)})
        return MediaRecord(
            tensors=tensors,
            fields={
                "modality": self.meta.modality,
                "grid_thw": list(self.meta.grid_thw),
                "num_visual_tokens": self.meta.num_visual_tokens,
                "second_per_grid_t": self.meta.second_per_grid_t,
                "num_frames": self.num_frames,
                "frame_timestamps_s": list(self.frame_timestamps_s),
                "decode_ms": self.decode_ms,
                "encode_ms": self.encode_ms,
                "cache_hit": self.cache_hit,
                "media_sha256": self.sha256,
                "kept_token_index": [] if self.token_index is None else self.token_index.tolist(),
                # [K] positions among the N' embeddings of the True entries of key_mask [N'].
                "key_token_index": []
                if self.key_mask is None
                else [i for i, key in enumerate(self.key_mask.tolist()) if key],
                "pruning": pruning_stats_to_record(self.pruning),
                "num_deepstack_features": len(self.deepstack),
                "group_timestamps_s": list(self.meta.group_timestamps_s),
            },
        )

    @classmethod
    def from_record(
        cls, record: MediaRecord[T], from_list: IndexFromList = torch_from_list
    ) -> EncodedMedia[T]:
        """The inverse of `to_record`. The record may come from a client (a proto) or from disk
        (the token cache): InvalidRequest when its metadata is malformed or a DeepStack feature it
        names is missing or misshapen, KeyError when a field or the embeddings tensor is missing. `from_list` builds token_index and key_mask in the
        embeddings' form (torch by default; `WireTensor.from_list` in the gateway)."""
        f = record.fields
        embeds = record.tensors["visual_embeds"]  # [N', hidden_size]
        grid = [int(x) for x in f["grid_thw"]]
        if f["modality"] not in ("video", "image") or len(grid) != 3 or min(grid) < 1:
            raise InvalidRequest(
                "visual metadata must name modality 'video' or 'image' and a 3-value grid_thw"
            )
        key_mask = None
        if len(f["key_token_index"]):
            index = [int(i) for i in f["key_token_index"]]  # [K]
            if min(index) < 0 or max(index) >= embeds.shape[0]:
                raise InvalidRequest("key_token_index points outside the visual tokens sent")
            mask = [False] * embeds.shape[0]  # [N']
            for i in index:
                mask[i] = True
            key_mask = from_list(mask, "bool")
        kept = list(f["kept_token_index"])
        num_deepstack = int(f["num_deepstack_features"])
        names = [deepstack_tensor_name(k) for k in range(max(num_deepstack, 0))]
        if num_deepstack < 0 or any(n not in record.tensors for n in names):
            raise InvalidRequest(
                f"the media names {num_deepstack} DeepStack features but "
                f"{sum(n in record.tensors for n in names)} were sent"
            )
        deepstack = [record.tensors[n] for n in names]
        if any(tuple(d.shape) != tuple(embeds.shape) for d in deepstack):
            raise InvalidRequest("each DeepStack feature must have the visual embeddings' shape, row for row")
        times = tuple(float(t) for t in f["group_timestamps_s"])
        return cls(
            embeds=embeds,
            meta=VisualMeta(
                str(f["modality"]),
                (grid[0], grid[1], grid[2]),
                float(f["second_per_grid_t"]),
                int(f["num_visual_tokens"]),
                times,
            ),
            num_frames=int(f["num_frames"]),
            frame_timestamps_s=[float(t) for t in f["frame_timestamps_s"]],
            decode_ms=float(f["decode_ms"]),
            encode_ms=float(f["encode_ms"]),
            cache_hit=bool(f["cache_hit"]),
            sha256=str(f["media_sha256"]),
            token_index=from_list([int(i) for i in kept], "int64") if kept else None,
            key_mask=key_mask,
            pruning=pruning_stats_from_record(f["pruning"]),
            deepstack=deepstack,
        )


def deepstack_tensor_name(k: int) -> str:
    """Name of DeepStack feature k in a `MediaRecord` and on the wire (a TensorChunk's name)."""
    return f"deepstack.{k}"


def pruning_stats_to_record(stats: PruningStats) -> dict[str, Any]:
    """PruningStats as a JSON-able dict keyed like `epd.v1.PruningReport`. `transfer_bytes` is
    left out: the gateway counts it for its own request, it never crosses a stage boundary."""
    return {
        "stages": [
            {
                "stage": s.stage,
                "num_visual_tokens_in": s.num_visual_tokens_in,
                "num_visual_tokens_out": s.num_visual_tokens_out,
            }
            for s in stats.stages
        ],
        "num_key_tokens": stats.num_key_tokens,
        "prefill_flops_full": stats.prefill_flops_full,
        "prefill_flops_pruned": stats.prefill_flops_pruned,
        "kv_bytes_before": stats.kv_bytes_before,
        "kv_bytes_after": stats.kv_bytes_after,
    }


def pruning_stats_from_record(fields: dict[str, Any]) -> PruningStats:
    """The inverse of `pruning_stats_to_record`."""
    stats = PruningStats(
        num_key_tokens=int(fields["num_key_tokens"]),
        prefill_flops_full=int(fields["prefill_flops_full"]),
        prefill_flops_pruned=int(fields["prefill_flops_pruned"]),
        kv_bytes_before=int(fields["kv_bytes_before"]),
        kv_bytes_after=int(fields["kv_bytes_after"]),
    )
    for s in fields["stages"]:
        stats.record(str(s["stage"]), int(s["num_visual_tokens_in"]), int(s["num_visual_tokens_out"]))
    return stats


@dataclass(frozen=True)
class ChoiceStart:
    """How one choice of a request with n > 1 begins (`PrefillHandle.other_choices`)."""

    first_token_id: int
    first_text: str | None
    """As `PrefillHandle.first_text`, for this choice's token."""
    first_logprob: TokenLogprob | None = None
    """As `PrefillHandle.first_logprob`, for this choice's token."""


@dataclass
class PrefillHandle(Generic[T]):
    """What decoding starts from, and where the KV cache waits.

    The prefill engine builds it without the location (`kv_handle`, `kv_address` empty) and the
    stage that stores the cache fills that in; `epd.transport.convert` carries it as
    `epd.v1.PrefillResult`, field for field, but for `prompt_logprobs`, which go before it in pieces
    (`prefill_responses`)."""

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
    visual_entry_mask: T | None = None
    """[num_layers, num_kv_heads, num_cached_tokens] bool: visual cache entries, for decode-stage
    eviction (None unless it is on). Flat [num_layers * num_kv_heads * num_cached_tokens] once it
    has crossed the wire; the decoder shapes it by its cache. A torch.Tensor, except in the
    gateway, which relays it to the decoder in wire form (`TensorLike`)."""
    kept_visual_token_index: list[int] = field(default_factory=list)
    """Full-list index of each visual token left after prefill dropping (empty: all kept)."""
    kv_handle: str = ""
    """The cache's name in the prefill stage's KvStore ("" until the stage stored it)."""
    kv_address: str = ""
    """host:port of the prefill server a decoder pulls the cache from ("" for an in-process store)."""
    num_reused_prompt_tokens: int = 0
    """Prompt tokens [0, this) whose KV came from prefill's prefix cache instead of being computed
    (a follow-up question about the same media; 0: none)."""
    num_stored_prompt_tokens: int = 0
    """Prompt tokens this request wrote into prefill's prefix cache: those past the prefix it held
    already (`PrefixCache.put`); 0 with the cache off, or when it held them all. The Responses
    API's `input_tokens_details.cache_write_tokens`."""
    first_text: str | None = None
    """The text the decoder's first step will stream with `first_token_id` (the same rules from the
    same state, `OutputText`), so the pipeline can send that token as soon as prefill is done,
    before a decoder has the cache. None when that token ends the request (its step then carries
    the finish reason, which only the decoder sends) or when prefill did not work it out."""
    distinct_prompt_token_ids: list[int] = field(default_factory=list)
    """The prompt's distinct token ids, increasing, for the decoder's repetition penalty (which
    covers the prompt, as vLLM's and generate()'s); empty unless the request's penalty is on."""
    prompt_ends_reasoning: bool = False
    """The prompt closed the thinking block, so a structured output that starts after the
    reasoning (`StructuredOutputs.after_reasoning`) holds from the first token; False without one.
    Prefill reads the prompt (`CompiledGrammar.prompt_ends_reasoning`), the decoder has none."""
    max_new_tokens: int = 0
    """The request's max_new_tokens as prefill ran it: what it asked, or what the context left
    after the prompt (`GenerationConfig.fit_max_new_tokens`); the decoder generates at most this
    many (`decode_generation`). 0: as the request asked (a prefill that does not say)."""
    other_choices: list[ChoiceStart] = field(default_factory=list)
    """Choices 1 to n-1 of a request with `GenerationConfig.n` > 1, each's first token sampled from
    the same last logits by its own sampler (choice 0 is `first_token_id`, `first_text`); the KV
    cache is kept for n pulls. Empty for one choice."""
    first_logprob: TokenLogprob | None = None
    """`first_token_id`'s log-probability and the top tokens at its position, when the request
    asked (`GenerationConfig.logprobs`); the decoder streams it with its first step."""
    prompt_logprobs: Sequence[TokenLogprob] | None = None
    """Every prompt token, each after the first with its log-probability given the tokens before
    it, rank and top k (the first's logprob is NaN: `prompt_token_logprobs`), when the request asked
    (`GenerationConfig.prompt_logprobs`); at most `MAX_PROMPT_LOGPROB_ENTRIES` entries. For the
    gateway to send: `for_choice` leaves it out of what a decoder gets."""
    prompt_token_ids: list[int] | None = None
    """The prompt's token ids, in order (`num_prompt_tokens` of them: the prompt as the model ran
    it, media placeholders included, whatever pruning dropped), when the request asked
    (`GenerationConfig.return_prompt_token_ids`); else None. The gateway's to send (vLLM's
    `prompt_token_ids`): `for_choice` leaves them out of what a decoder gets."""

    @property
    def num_choices(self) -> int:
        return 1 + len(self.other_choices)

    def for_choice(self, index: int) -> PrefillHandle[T]:
        """The handle choice `index`'s decoder starts from: the same cache, that choice's first token."""
        if index == 0:
            return replace(self, other_choices=[], prompt_logprobs=None, prompt_token_ids=None)
        start = self.other_choices[index - 1]
        return replace(
            self,
            first_token_id=start.first_token_id,
            first_text=start.first_text,
            first_logprob=start.first_logprob,
            other_choices=[],
            prompt_logprobs=None,
            prompt_token_ids=None,
        )

    def decode_generation(self, generation: GenerationConfig) -> GenerationConfig:
        """The request's `generation` with the max_new_tokens prefill ran it with."""
        if not self.max_new_tokens or self.max_new_tokens == generation.max_new_tokens:
            return generation
        return replace(generation, max_new_tokens=self.max_new_tokens)


PRUNING_STAGES = {
    "temporal_drop": "encoder",
    "spatial_merge": "encoder",
    "key_tokens": "encoder",
    "prefill_drop": "prefill",
    "kv_compress": "prefill",
    "decode_evict": "decode",
}
"""Every token-dropping / KV-compression stage, by name, with the service it runs in. A family
declares the ones it supports (`VLMAdapter.supported_pruning`); `kv_dtype` (narrower KV on the
wire) works for every family and is not listed."""


def pruning_stages_used(pruning: PruningConfig) -> list[str]:
    """The stages of `PRUNING_STAGES` that `pruning` turns on."""
    used = {
        "temporal_drop": pruning.temporal_drop,
        "spatial_merge": pruning.spatial_merge,
        "key_tokens": pruning.key_token_ratio > 0,
        "prefill_drop": pruning.prefill_drop,
        "kv_compress": pruning.kv_compress,
        "decode_evict": pruning.decode_evict,
    }
    return [name for name in PRUNING_STAGES if used[name]]


def refuse_unsupported_pruning(
    family: str, supported: frozenset[str], reason: str, pruning: PruningConfig
) -> None:
    """InvalidRequest naming each stage `pruning` turns on that the model family does not support,
    and the family. The encoder asks at the start of every request (a refused later stage costs no
    decoding), prefill again before it queues (it may get media from elsewhere)."""
    refused = [name for name in pruning_stages_used(pruning) if name not in supported]
    if refused:
        stages = ", ".join(f"{name} ({PRUNING_STAGES[name]} stage)" for name in refused)
        works = ", ".join(sorted(supported)) or "none"
        raise InvalidRequest(
            f"pruning {stages} is not supported for model family {family}"
            f"{': ' + reason if reason else ''}; turn it off (this family supports: {works}; kv_dtype always works)"
        )


def check_generation_limits(
    generation: GenerationConfig,
    max_new_tokens_limit: int,
    vocab_size: int | None = None,
    max_logprobs: int | None = None,
    scheduling_policy: str = "fcfs",
) -> None:
    """The one check of a request's generation settings against a stage's limits (and the token
    ids it names against the model's vocabulary, and its priority against the stage's
    `--scheduling-policy`), made by prefill (before it runs the prompt) and by decode (before it
    takes the KV cache)."""
    try:
        generation.validate(max_new_tokens_limit, vocab_size, max_logprobs)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None
    check_request_priority(generation.priority, scheduling_policy)


def check_request_priority(priority: int, scheduling_policy: str) -> None:
    """InvalidRequest for a priority out of range, or not 0 under fcfs (`epd.stages.scheduling`):
    each stage's check against its own policy, and the front door's against prefill's."""
    try:
        check_priority(priority, scheduling_policy)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None


def bad_words_token_ids(generation: GenerationConfig, adapter: VLMAdapter) -> tuple[tuple[int, ...], ...]:
    """The request's bad_words as the model's token sequences, made where its sampler is (prefill's
    first token, when it renders the request, before it queues, on a tokenizer thread; decode's
    others, on its model thread), with the settled tokenizer (`VLMAdapter.settle_tokenizer`);
    InvalidRequest for a word the tokenizer gives no token, or an id
    outside the logits (the front door refuses the empty ones already)."""
    if not generation.bad_words:
        return ()
    try:
        return adapter.bad_words_token_ids(generation.bad_words)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None


@dataclass
class TokenStep:
    """Tokens produced since the last step and the text they add."""

    token_ids: list[int]
    text: str
    finish_reason: str = ""  # "" while generating, then "stop" or "length"
    kv_transfer_ms: float = 0.0  # set on the first step
    kv_num_bytes: int = 0  # set on the first step
    decode_evict: tuple[int, int] | None = None  # last step: visual entries per head (in, out)
    stop_reason: StopReason = None
    """Last step: the stop string or stop token id that ended the answer (`OutputText.stop_reason`)."""
    logprobs: list[TokenLogprob] | None = None
    """One per token of `token_ids`, when the request asked (`GenerationConfig.logprobs`); else None."""
    index: int = 0
    """The choice these tokens belong to (OpenAI's `n`: 0 to n-1); set by the pipeline, which runs
    one decode request per choice."""


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
        cache_salt: str = "",
        priority: int = 0,
    ) -> EncodedMedia:
        """Decode and encode the media. Raises MediaError / EpdError with a client-safe message.
        `cache_salt` (the tenant, `check_cache_salt`) is part of the token-cache key: a by-hash
        request (no bytes) finds only what the same salt cached, else NotFound. `priority` (the
        request's, `GenerationConfig.priority`) orders its waits under `--scheduling-policy
        priority`; under fcfs anything but 0 is InvalidRequest (`check_request_priority`)."""


class PrefillStage(ABC):
    @abstractmethod
    async def prefill(
        self,
        messages: Sequence[Message],
        media: EncodedMedia | None,
        generation: GenerationConfig,
        request_id: str,
        pruning: PruningConfig = PruningConfig(),
        cache_salt: str = "",
        *,
        raw_prompt: RawPrompt | None = None,
        template: ChatTemplateOptions = ChatTemplateOptions(),
    ) -> PrefillHandle:
        """Render `messages` (`epd.stages.messages`: at most one media part, the user's message
        last, or the assistant's: `template` says whether a new answer follows it or the model
        continues it) with the model's chat template around `media` and run the prompt (`media` None: the
        messages have no media part, and the prompt is their text alone, without visual tokens); the KV cache stays with the
        stage until a decoder takes it (or its TTL passes). Cancelled before it returns, the stage
        stores no cache. `cache_salt` (the tenant) is part of the prefix-cache key: a prompt reuses
        only KV that a request of the same salt stored. `raw_prompt` (then `messages` is empty
        and `media` None): a prompt run as it is, without the chat template
        (`epd.stages.raw_prompt`)."""

    @abstractmethod
    async def release(self, handle: PrefillHandle, request_id: str) -> None:
        """Drop the KV cache of `handle`: its request ended (cancelled or failed) before a decoder
        took it. Idempotent: an unknown, expired or already taken handle is not an error."""

    async def compile_structured_outputs(
        self,
        spec: StructuredOutputs,
        messages: Sequence[Message],
        media: MediaInput,
        request_id: str,
        cache_salt: str = "",
    ) -> None:
        """Compile a request's constraint where its `prefill` will run (the same replica: routed
        by `messages`, the media not yet encoded and `cache_salt` as `prefill` routes), so that
        `prefill` finds it compiled; the pipeline calls it while the media is encoded. Raises the
        constraint's refusal (InvalidConstraint: it does not compile, or not within the stage's
        deadline; ConstraintBusy: too many slow compiles still run, retry later), which `prefill`
        would raise after the encode. Any other failure (a replica lost, one that cannot compile
        early) is logged and returns: `prefill` compiles the spec then, as it always does. This
        default compiles nothing early."""
        return None

    def model_info(self) -> ModelInfo | None:
        """What the model behind this stage can take (`epd.stages.model_info`); None while not
        known (a remote stage before any replica answered, or a stage that cannot say)."""
        return None

    async def wait_model_info(self, timeout_s: float) -> ModelInfo | None:
        """`model_info`, waiting up to `timeout_s` for it while it is not known yet (a remote stage
        whose replicas have not answered); None when it still is not. A local stage knows it."""
        return self.model_info()

    async def tokenize(self, request: TokenizeInput, request_id: str) -> TokenizeOutput:
        """The token ids of `request`'s text or text-only conversation, as this stage's tokenizer
        and chat template give them, and their token strings when asked (`epd.stages.tokenize`);
        InvalidRequest for what it refuses."""
        raise NotImplementedError(f"{type(self).__name__} cannot tokenize")

    async def detokenize(self, token_ids: Sequence[int], request_id: str) -> str:
        """The text of `token_ids` (special tokens kept); InvalidRequest for an id outside the vocabulary."""
        raise NotImplementedError(f"{type(self).__name__} cannot detokenize")


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
