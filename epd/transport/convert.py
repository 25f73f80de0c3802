"""Protobuf <-> domain objects. Servicers and remote stages use only these, so the wire format
lives in one place: one converter each way per boundary type. Zero in a proto field means
"server default"."""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from google.protobuf.message import Message

from epd.model_runtime.logprobs import MAX_PROMPT_LOGPROB_ENTRIES
from epd.model_runtime.sampling import GenerationConfig, StructuredOutputs
from epd.stages.contracts import (
    ChoiceStart,
    EncodedMedia,
    MediaRecord,
    PrefillHandle,
    StageEvent,
    TokenStep,
    pruning_stats_from_record,
    pruning_stats_to_record,
)
from epd.stages.errors import InvalidRequest
from epd.token_pruning import PruningConfig, PruningStats
from epd.transport.message_convert import PromptLogprobsFromPieces
from epd.transport.message_convert import logprob_from_proto as logprob_from_proto  # re-exported
from epd.transport.message_convert import logprob_to_proto as logprob_to_proto  # re-exported
from epd.transport.message_convert import logprobs_from_proto as logprobs_from_proto  # re-exported
from epd.transport.message_convert import messages_from_proto as messages_from_proto  # re-exported
from epd.transport.message_convert import messages_to_proto as messages_to_proto  # re-exported
from epd.transport.message_convert import prompt_logprobs_pieces as prompt_logprobs_pieces  # re-exported
from epd.transport.message_convert import (
    prompt_logprobs_pieces_off_loop as prompt_logprobs_pieces_off_loop,  # re-exported
)
from epd.transport.message_convert import raw_prompt_from_proto as raw_prompt_from_proto  # re-exported
from epd.transport.message_convert import raw_prompt_to_proto as raw_prompt_to_proto  # re-exported
from epd.transport.message_convert import set_stop_reason as set_stop_reason  # re-exported
from epd.transport.message_convert import stop_reason_from_proto as stop_reason_from_proto  # re-exported
from epd.transport.message_convert import template_from_proto as template_from_proto  # re-exported
from epd.transport.message_convert import template_to_proto as template_to_proto  # re-exported
from epd.transport.tensor_wire import WireTensor, tensor_bytes, tensor_num_bytes, tensor_to_chunks
from epd.v1 import common_pb2, decode_pb2, encoder_pb2, prefill_pb2
from epd.video.types import ONE_FRAME_CHOICE, MediaError, SamplingOptions

if TYPE_CHECKING:
    import torch  # the gateway uses this module without torch (its tensors stay WireTensors)


def require_finite(**values: float) -> None:
    """Refuse NaN and infinities: every comparison with NaN is false, so a NaN slips past
    each range check and fails later, deep in a stage, as an internal error."""
    for name, value in values.items():
        if not math.isfinite(value):
            raise InvalidRequest(f"{name} must be a finite number, got {value}")


def media_sha256_from_proto(text: str) -> str:
    """The media reference of an upload: empty (none), or a sha256 digest as 64 lower-case hex
    digits, the form every cache key is built from."""
    if text and (len(text) != 64 or text.strip(_HEX_DIGITS)):
        raise InvalidRequest(
            "media_sha256 must be the sha256 of the media as 64 lower-case hex digits "
            "(hashlib.sha256(data).hexdigest()), or empty"
        )
    return text


_HEX_DIGITS = "0123456789abcdef"

MAX_SAMPLING_FPS = 1000.0
"""Above any video's frame rate (sampling past it only repeats frames), and far below where
span * fps stops being a finite number of frames."""


def sampling_from_proto(
    msg: common_pb2.VideoSampling, defaults: SamplingOptions, from_client: bool = False
) -> SamplingOptions:
    """`msg` over `defaults` (0: the default). An fps without num_frames samples at that rate,
    whatever num_frames the defaults hold (a client's fps is not overridden by the server's
    --num-frames). `from_client` (the gateway's door): fps and num_frames together are refused;
    on the gateway's hop to the encoder fps is always set, and num_frames, when set, is the count."""
    require_finite(fps=msg.fps, start_time_s=msg.start_time_s, end_time_s=msg.end_time_s)
    if from_client and msg.fps and msg.num_frames:
        raise MediaError(f"fps {msg.fps:g} and num_frames {msg.num_frames}: {ONE_FRAME_CHOICE}")
    for name in ("fps", "max_frames", "min_frames", "num_frames", "max_pixels", "start_time_s", "end_time_s"):
        if getattr(msg, name) < 0:  # the HTTP API's words for the same value (its 400 names the field)
            raise MediaError(
                f"{name} must not be negative (0: the server's default), got {getattr(msg, name):g}"
            )
    if msg.fps > MAX_SAMPLING_FPS:
        raise MediaError(f"fps must be at most {MAX_SAMPLING_FPS:g}, got {msg.fps:g}")
    opts = replace(
        defaults,
        fps=msg.fps or defaults.fps,
        max_frames=msg.max_frames or defaults.max_frames,
        min_frames=msg.min_frames or min(defaults.min_frames, msg.max_frames or defaults.max_frames),
        num_frames=msg.num_frames or (None if msg.fps else defaults.num_frames),
        start_time_s=msg.start_time_s,
        end_time_s=msg.end_time_s or None,
        max_pixels=msg.max_pixels or defaults.max_pixels,
    )
    return opts


def sampling_to_proto(opts: SamplingOptions) -> common_pb2.VideoSampling:
    return common_pb2.VideoSampling(
        fps=opts.fps,
        max_frames=opts.max_frames,
        min_frames=opts.min_frames,
        num_frames=opts.num_frames or 0,
        start_time_s=opts.start_time_s,
        end_time_s=opts.end_time_s or 0.0,
        max_pixels=opts.max_pixels or 0,
    )


TOP_K_OFF = -1
"""vLLM's top_k for "off", as 0 is: taken by the gRPC API as by the HTTP API (`generation_options`)."""


def generation_from_proto(msg: common_pb2.GenerationParams, defaults: GenerationConfig) -> GenerationConfig:
    """The wire's generation settings; their ranges are checked by `GenerationConfig.validate`
    (where each is used), NaN and infinities here."""
    require_finite(
        temperature=msg.temperature,
        top_p=msg.top_p,
        repetition_penalty=msg.repetition_penalty,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        min_p=msg.min_p,
    )
    require_finite(**{f"logit_bias[{token}]": bias for token, bias in msg.logit_bias.items()})
    for name in ("max_new_tokens", "temperature", "top_p"):
        if getattr(msg, name) < 0:
            raise InvalidRequest(f"{name} must not be negative, got {getattr(msg, name):g}")
    if msg.top_k < TOP_K_OFF:
        raise InvalidRequest(f"top_k must be >= 1, or 0 or -1 (vLLM's) for off, got {msg.top_k}")
    return GenerationConfig(
        max_new_tokens=msg.max_new_tokens or defaults.max_new_tokens,
        # Unset fields take the front door's defaults (`--generation-config`): temperature, top_k
        # and min_p by their presence (0 is greedy / off), top_p, repetition_penalty and
        # max_new_tokens by 0, which no request may send (each is > 0).
        temperature=msg.temperature if msg.HasField("temperature") else defaults.temperature,
        top_p=msg.top_p or defaults.top_p,
        # -1 is off, as 0, on every door (the HTTP API's too)
        top_k=max(0, msg.top_k if msg.HasField("top_k") else defaults.top_k),
        seed=msg.seed if msg.HasField("seed") else None,
        stop=tuple(msg.stop),
        ignore_eos=msg.ignore_eos,
        repetition_penalty=msg.repetition_penalty or defaults.repetition_penalty,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        min_p=msg.min_p if msg.HasField("min_p") else defaults.min_p,
        min_tokens=msg.min_tokens,
        logit_bias=tuple(sorted(msg.logit_bias.items())),
        stop_token_ids=tuple(msg.stop_token_ids),
        include_stop_str_in_output=msg.include_stop_str_in_output,
        allowed_token_ids=tuple(msg.allowed_token_ids),
        bad_words=tuple(msg.bad_words),
        fit_max_new_tokens=msg.fit_max_new_tokens or not msg.max_new_tokens,  # unset: the default, fitted
        skip_special_tokens=msg.skip_special_tokens if msg.HasField("skip_special_tokens") else True,
        spaces_between_special_tokens=(
            msg.spaces_between_special_tokens if msg.HasField("spaces_between_special_tokens") else True
        ),
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,  # its range: `validate`
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
        n=msg.n or 1,
        priority=msg.priority,  # its range and the stage's policy: `check_generation_limits`
        return_prompt_token_ids=msg.return_prompt_token_ids,
        structured_outputs=structured_from_proto(msg.structured_outputs)
        if msg.HasField("structured_outputs")
        else None,
    )


def structured_from_proto(msg: common_pb2.StructuredOutputs) -> StructuredOutputs:
    return StructuredOutputs(
        json_schema=msg.json_schema,
        json_object=msg.json_object,
        regex=msg.regex,
        choice=tuple(msg.choice),
        grammar=msg.grammar,
        disable_any_whitespace=msg.disable_any_whitespace,
        after_reasoning=msg.after_reasoning,
    )


def generation_to_proto(cfg: GenerationConfig) -> common_pb2.GenerationParams:
    """Field for field (the message names each field of GenerationConfig; seed None is unset)."""
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    fields["logit_bias"] = dict(cfg.logit_bias)  # (id, bias) pairs -> the proto's map
    structured = fields.pop("structured_outputs")
    if structured is not None:  # None is unset
        fields["structured_outputs"] = structured_to_proto(structured)
    return common_pb2.GenerationParams(**fields)


def structured_to_proto(spec: StructuredOutputs) -> common_pb2.StructuredOutputs:
    """Field for field (the message names each field of StructuredOutputs)."""
    return common_pb2.StructuredOutputs(**dataclasses.asdict(spec))


def event_to_proto(event: StageEvent, at_ms: float) -> common_pb2.StageEvent:
    return common_pb2.StageEvent(
        stage=event.stage,
        state=event.state,
        at_ms=at_ms,
        duration_ms=event.duration_ms,
        details=event.details,
    )


def event_from_proto(msg: common_pb2.StageEvent) -> StageEvent:
    return StageEvent(msg.stage, msg.state, msg.duration_ms, dict(msg.details))


def message_fields(msg: Message) -> dict[str, Any]:
    """Every field of `msg` by name, as plain Python values (lists, and dicts for messages): the
    inverse of building a message with `Type(**fields)`, for the record forms of the domain types."""
    out: dict[str, Any] = {}
    for f in msg.DESCRIPTOR.fields:
        value = getattr(msg, f.name)
        if f.message_type is not None:
            value = [message_fields(v) for v in value] if f.is_repeated else message_fields(value)
        elif f.is_repeated:
            value = list(value)
        out[f.name] = value
    return out


def encode_result_to_proto(media: EncodedMedia) -> encoder_pb2.EncodeResult:
    """Everything but the tensors, which go as tensor chunks (`encoded_media_chunks`)."""
    return encoder_pb2.EncodeResult(**media.to_record().fields)


def encoded_media_chunks(media: EncodedMedia) -> Iterator[common_pb2.TensorChunk]:
    """Every tensor of the media as named chunks: "visual_embeds", then any DeepStack features
    ("deepstack.{k}"), all through the receiver's one byte-budgeted `TensorAssembler`."""
    for name, tensor in media.to_record().tensors.items():
        yield from tensor_to_chunks(name, tensor)


def encoded_media_num_bytes(media: EncodedMedia) -> int:
    """Payload bytes of the tensors `encoded_media_chunks` sends (embeddings + DeepStack features)."""
    return sum(tensor_num_bytes(t) for t in media.to_record().tensors.values())


def encoded_media_from_proto(
    msg: encoder_pb2.EncodeResult,
    tensors: Mapping[str, torch.Tensor] | Mapping[str, WireTensor] | torch.Tensor | WireTensor,
) -> EncodedMedia:
    """tensors: the named tensors reassembled from the chunks beside `msg` ("visual_embeds"
    [num_visual_tokens, hidden_size] and the DeepStack features `msg` names), or the embeddings
    alone. WireTensors (the gateway, relaying) give the media's index tensors in wire form too.
    InvalidRequest when the embeddings or a named DeepStack feature is missing."""
    named = dict(tensors) if isinstance(tensors, Mapping) else {"visual_embeds": tensors}
    if "visual_embeds" not in named:
        raise InvalidRequest("no visual_embeds tensor was sent")
    record: MediaRecord[Any] = MediaRecord(named, message_fields(msg))
    if isinstance(named["visual_embeds"], WireTensor):
        return EncodedMedia.from_record(record, WireTensor.from_list)
    return EncodedMedia.from_record(record)


def handle_to_proto(h: PrefillHandle) -> prefill_pb2.PrefillResult:
    return prefill_pb2.PrefillResult(
        kv_handle=h.kv_handle,
        kv_address=h.kv_address,
        first_token_id=h.first_token_id,
        num_prompt_tokens=h.num_prompt_tokens,
        num_cached_tokens=h.num_cached_tokens,
        next_position_ids=h.next_position_ids,
        kv_num_bytes=h.kv_num_bytes,
        prefill_ms=h.prefill_ms,
        num_visual_tokens_in=h.num_visual_tokens_in,
        num_visual_tokens_out=h.num_visual_tokens_out,
        kv_num_bytes_uncompressed=h.kv_num_bytes_uncompressed,
        pruning=stats_to_proto(h.pruning),
        visual_entry_mask=b"" if h.visual_entry_mask is None else tensor_bytes(h.visual_entry_mask),
        kept_visual_token_index=h.kept_visual_token_index,
        num_reused_prompt_tokens=h.num_reused_prompt_tokens,
        num_stored_prompt_tokens=h.num_stored_prompt_tokens,
        first_text=h.first_text,
        distinct_prompt_token_ids=h.distinct_prompt_token_ids,
        prompt_ends_reasoning=h.prompt_ends_reasoning,
        prompt_token_ids=h.prompt_token_ids or (),
        max_new_tokens=h.max_new_tokens,
        first_logprob=None if h.first_logprob is None else logprob_to_proto(h.first_logprob),
        other_choices=[
            prefill_pb2.ChoiceStart(
                first_token_id=c.first_token_id,
                first_text=c.first_text,
                first_logprob=None if c.first_logprob is None else logprob_to_proto(c.first_logprob),
            )
            for c in h.other_choices
        ],
    )


async def prefill_responses(h: PrefillHandle) -> AsyncIterator[prefill_pb2.PrefillResponse]:
    """Prefill's answer: the prompt's logprobs in pieces when the request asked (made off the event
    loop), then the result."""
    async for piece in prompt_logprobs_pieces_off_loop(h.prompt_logprobs or ()):
        yield prefill_pb2.PrefillResponse(prompt_logprobs=piece)
    yield prefill_pb2.PrefillResponse(result=handle_to_proto(h))


class PrefillAnswer:
    """Prefill's answer as its messages arrive (`prefill_responses`): the prompt logprobs' pieces,
    joined and bounded as they come, then the result (`handle`). An answer that is malformed
    (past the bound, without its result, a malformed result, a wrong count of prompt logprobs) is
    RuntimeError: our own prefill's fault, INTERNAL / 500, not the client's."""

    def __init__(self) -> None:
        self.prompt_logprobs = PromptLogprobsFromPieces()
        self.num_prompt_logprob_entries = 0
        self.result: prefill_pb2.PrefillResult | None = None

    async def add(self, response: prefill_pb2.PrefillResponse) -> None:
        """A piece is joined on a worker thread: kept as it came, but its about 50,000 entries
        counted (a few ms of Python; making them `TokenLogprob`s here took 0.3 s a piece)."""
        if response.WhichOneof("kind") == "prompt_logprobs":
            await asyncio.to_thread(self._add, response)
        else:
            self._add(response)

    def _add(self, response: prefill_pb2.PrefillResponse) -> None:
        if response.WhichOneof("kind") != "prompt_logprobs":
            self.result = response.result
            return
        piece = response.prompt_logprobs.logprobs
        self.num_prompt_logprob_entries += sum(1 + len(lp.top_logprobs) for lp in piece)
        # Prefill refuses a request past this before its prompt runs (RESOURCE_EXHAUSTED, 413:
        # the client's to change); held here too, since these pieces are what the gateway's memory
        # bound is about. An answer past it is prefill's fault, as any other malformed answer.
        if self.num_prompt_logprob_entries > MAX_PROMPT_LOGPROB_ENTRIES:
            raise RuntimeError(
                f"prefill's answer is malformed: more than {MAX_PROMPT_LOGPROB_ENTRIES} prompt logprob "
                "entries, the most one answer may hold (prefill refuses a request past it before its prompt runs)"
            )
        self.prompt_logprobs.append_piece(response.prompt_logprobs)

    def handle(self, relay: bool = False) -> PrefillHandle:
        """The answer's PrefillHandle. A malformed answer is prefill's fault, not the client's:
        RuntimeError (INTERNAL / 500, its detail in the log), not the InvalidRequest that
        `handle_from_proto` raises for a caller's malformed handle."""
        if self.result is None:
            raise RuntimeError("prefill's answer ended without its result")
        try:
            handle = handle_from_proto(self.result, relay)
        except InvalidRequest as exc:
            raise RuntimeError(f"prefill's answer is malformed: {exc}") from exc
        if self.prompt_logprobs:
            if len(self.prompt_logprobs) != handle.num_prompt_tokens:
                raise RuntimeError(
                    f"prefill sent {len(self.prompt_logprobs)} prompt logprobs for a "
                    f"{handle.num_prompt_tokens}-token prompt; it sends one per prompt token"
                )
            handle.prompt_logprobs = self.prompt_logprobs
        if handle.prompt_token_ids is not None and len(handle.prompt_token_ids) != handle.num_prompt_tokens:
            raise RuntimeError(
                f"prefill sent {len(handle.prompt_token_ids)} prompt token ids for a "
                f"{handle.num_prompt_tokens}-token prompt; it sends one per prompt token"
            )
        return handle


def handle_from_proto(msg: prefill_pb2.PrefillResult, relay: bool = False) -> PrefillHandle:
    """relay: keep visual_entry_mask in wire form (the gateway, which only passes it to decode).
    Without the prompt's logprobs, which come in pieces before it (`PrefillAnswer`)."""
    if len(msg.next_position_ids) != 4 or not msg.kv_handle:
        raise InvalidRequest("prefill result must carry a kv_handle and 4 next_position_ids")
    return PrefillHandle(
        kv_handle=msg.kv_handle,
        kv_address=msg.kv_address,
        first_token_id=msg.first_token_id,
        num_prompt_tokens=msg.num_prompt_tokens,
        num_cached_tokens=msg.num_cached_tokens,
        next_position_ids=list(msg.next_position_ids),
        kv_num_bytes=msg.kv_num_bytes,
        prefill_ms=msg.prefill_ms,
        num_visual_tokens_in=msg.num_visual_tokens_in,
        num_visual_tokens_out=msg.num_visual_tokens_out,
        kv_num_bytes_uncompressed=msg.kv_num_bytes_uncompressed,
        pruning=stats_from_proto(msg.pruning),
        # Flat here; the decoder shapes it [layers, kv_heads, cached] once it has the cache.
        visual_entry_mask=_flat_mask(msg.visual_entry_mask, relay) if msg.visual_entry_mask else None,
        kept_visual_token_index=list(msg.kept_visual_token_index),
        num_reused_prompt_tokens=msg.num_reused_prompt_tokens,
        num_stored_prompt_tokens=msg.num_stored_prompt_tokens,
        first_text=msg.first_text if msg.HasField("first_text") else None,
        distinct_prompt_token_ids=list(msg.distinct_prompt_token_ids),
        prompt_ends_reasoning=msg.prompt_ends_reasoning,
        prompt_token_ids=list(msg.prompt_token_ids) or None,  # a prompt is never empty: not asked
        max_new_tokens=msg.max_new_tokens,
        first_logprob=logprob_from_proto(msg.first_logprob) if msg.HasField("first_logprob") else None,
        other_choices=[
            ChoiceStart(
                c.first_token_id,
                c.first_text if c.HasField("first_text") else None,
                logprob_from_proto(c.first_logprob) if c.HasField("first_logprob") else None,
            )
            for c in msg.other_choices
        ],
    )


def _flat_mask(data: bytes, relay: bool) -> Any:
    """[num_bytes] bool, one byte per entry: a WireTensor when relaying, else a torch.Tensor."""
    wire = WireTensor("bool", (len(data),), bytearray(data))
    return wire if relay else wire.to_torch()


def token_step_to_proto(step: TokenStep) -> decode_pb2.GenerateResponse:
    msg = decode_pb2.GenerateResponse(
        token_ids=step.token_ids,
        text=step.text,
        finish_reason=step.finish_reason,
        kv_transfer_ms=step.kv_transfer_ms,
        kv_num_bytes=step.kv_num_bytes,
        logprobs=[logprob_to_proto(lp) for lp in step.logprobs or ()],
    )
    set_stop_reason(msg, step.stop_reason)
    if step.decode_evict is not None:
        msg.decode_evict.stage = "decode_evict"
        msg.decode_evict.num_visual_tokens_in, msg.decode_evict.num_visual_tokens_out = step.decode_evict
    return msg


def token_step_from_proto(msg: decode_pb2.GenerateResponse) -> TokenStep:
    evict = None
    if msg.HasField("decode_evict"):
        evict = (int(msg.decode_evict.num_visual_tokens_in), int(msg.decode_evict.num_visual_tokens_out))
    return TokenStep(
        list(msg.token_ids),
        msg.text,
        msg.finish_reason,
        msg.kv_transfer_ms,
        msg.kv_num_bytes,
        decode_evict=evict,
        stop_reason=stop_reason_from_proto(msg),
        logprobs=logprobs_from_proto(msg.logprobs),
    )


def pruning_from_proto(msg: common_pb2.PruningOptions) -> PruningConfig:
    """A preset (default "off") with knobs given as strings, parsed by each knob's type."""
    try:
        return PruningConfig.from_knobs(dict(msg.knobs), msg.preset or "off")
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None


def pruning_to_proto(cfg: PruningConfig) -> common_pb2.PruningOptions:
    return common_pb2.PruningOptions(preset="off", knobs=cfg.to_knobs())


def stats_to_proto(stats: PruningStats) -> common_pb2.PruningReport:
    return common_pb2.PruningReport(**pruning_stats_to_record(stats))


def stats_from_proto(msg: common_pb2.PruningReport) -> PruningStats:
    return pruning_stats_from_record(message_fields(msg))
