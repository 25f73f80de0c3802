"""Protobuf <-> domain objects. Servicers and remote stages use only these, so the wire format
lives in one place. Zero in a proto field means "server default"."""

from __future__ import annotations

import math
from dataclasses import fields, replace

import torch

from epd.model_runtime.adapter import VisualMeta
from epd.model_runtime.sampling import GenerationConfig
from epd.stages.contracts import EncodedMedia, PrefillHandle, StageEvent, TokenStep
from epd.stages.errors import InvalidRequest
from epd.token_pruning import PruningConfig, PruningStats
from epd.v1 import common_pb2, encoder_pb2, prefill_pb2
from epd.video.types import MediaError, SamplingOptions


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


def sampling_from_proto(msg: common_pb2.VideoSampling, defaults: SamplingOptions) -> SamplingOptions:
    require_finite(fps=msg.fps, start_time_s=msg.start_time_s, end_time_s=msg.end_time_s)
    if msg.fps < 0 or msg.max_frames < 0 or msg.min_frames < 0 or msg.num_frames < 0 or msg.max_pixels < 0:
        raise MediaError("sampling options must not be negative")
    if msg.fps > MAX_SAMPLING_FPS:
        raise MediaError(f"fps must be at most {MAX_SAMPLING_FPS:g}, got {msg.fps:g}")
    opts = replace(
        defaults,
        fps=msg.fps or defaults.fps,
        max_frames=msg.max_frames or defaults.max_frames,
        min_frames=msg.min_frames or min(defaults.min_frames, msg.max_frames or defaults.max_frames),
        num_frames=msg.num_frames or defaults.num_frames,
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


def generation_from_proto(msg: common_pb2.GenerationParams, defaults: GenerationConfig) -> GenerationConfig:
    require_finite(temperature=msg.temperature, top_p=msg.top_p)
    if msg.max_new_tokens < 0 or msg.top_k < 0 or msg.temperature < 0 or msg.top_p < 0:
        raise InvalidRequest("generation parameters must not be negative")
    return GenerationConfig(
        max_new_tokens=msg.max_new_tokens or defaults.max_new_tokens,
        temperature=msg.temperature,
        top_p=msg.top_p or 1.0,
        top_k=msg.top_k,
        seed=msg.seed,
        stop=tuple(msg.stop),
        ignore_eos=msg.ignore_eos,
    )


def generation_to_proto(cfg: GenerationConfig) -> common_pb2.GenerationParams:
    return common_pb2.GenerationParams(
        max_new_tokens=cfg.max_new_tokens,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        top_k=cfg.top_k,
        seed=cfg.seed,
        stop=list(cfg.stop),
        ignore_eos=cfg.ignore_eos,
    )


def event_to_proto(event: StageEvent, at_ms: float) -> common_pb2.StageEvent:
    return common_pb2.StageEvent(
        stage=event.stage, state=event.state, at_ms=at_ms, duration_ms=event.duration_ms, details=event.details
    )


def event_from_proto(msg: common_pb2.StageEvent) -> StageEvent:
    return StageEvent(msg.stage, msg.state, msg.duration_ms, dict(msg.details))


def encode_result_to_proto(media: EncodedMedia) -> encoder_pb2.EncodeResult:
    return encoder_pb2.EncodeResult(
        modality=media.meta.modality,
        grid_thw=list(media.meta.grid_thw),
        num_visual_tokens=media.meta.num_visual_tokens,
        num_frames=media.num_frames,
        frame_timestamps_s=media.frame_timestamps_s,
        second_per_grid_t=media.meta.second_per_grid_t,
        decode_ms=media.decode_ms,
        encode_ms=media.encode_ms,
        cache_hit=media.cache_hit,
        media_sha256=media.sha256,
        kept_token_index=[] if media.token_index is None else media.token_index.tolist(),
        key_token_index=[] if media.key_mask is None else media.key_mask.nonzero().flatten().tolist(),
        pruning=stats_to_proto(media.pruning),
    )


def visual_meta_from_proto(msg: encoder_pb2.EncodeResult) -> VisualMeta:
    if msg.modality not in ("video", "image") or len(msg.grid_thw) != 3 or min(msg.grid_thw) < 1:
        raise InvalidRequest("visual metadata must name modality 'video' or 'image' and a 3-value grid_thw")
    grid = (int(msg.grid_thw[0]), int(msg.grid_thw[1]), int(msg.grid_thw[2]))
    return VisualMeta(msg.modality, grid, msg.second_per_grid_t, int(msg.num_visual_tokens))


def encoded_media_from_proto(msg: encoder_pb2.EncodeResult, embeds) -> EncodedMedia:
    token_index = torch.tensor(list(msg.kept_token_index), dtype=torch.long) if msg.kept_token_index else None
    key_mask = None
    if msg.key_token_index:
        key_mask = torch.zeros(embeds.shape[0], dtype=torch.bool)
        index = torch.tensor(list(msg.key_token_index), dtype=torch.long)
        if int(index.min()) < 0 or int(index.max()) >= embeds.shape[0]:
            raise InvalidRequest("key_token_index points outside the visual tokens sent")
        key_mask[index] = True
    return EncodedMedia(
        embeds=embeds,
        meta=visual_meta_from_proto(msg),
        num_frames=msg.num_frames,
        frame_timestamps_s=list(msg.frame_timestamps_s),
        decode_ms=msg.decode_ms,
        encode_ms=msg.encode_ms,
        cache_hit=msg.cache_hit,
        sha256=msg.media_sha256,
        token_index=token_index,
        key_mask=key_mask,
        pruning=stats_from_proto(msg.pruning),
    )


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
        visual_entry_mask=b"" if h.visual_entry_mask is None else h.visual_entry_mask.numpy().tobytes(),
        kept_visual_token_index=h.kept_visual_token_index,
    )


def handle_from_proto(msg: prefill_pb2.PrefillResult) -> PrefillHandle:
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
        visual_entry_mask=torch.frombuffer(bytearray(msg.visual_entry_mask), dtype=torch.bool)
        if msg.visual_entry_mask else None,
        kept_visual_token_index=list(msg.kept_visual_token_index),
    )


def token_step_from_proto(msg) -> TokenStep:
    evict = None
    if msg.HasField("decode_evict"):
        evict = (int(msg.decode_evict.num_visual_tokens_in), int(msg.decode_evict.num_visual_tokens_out))
    return TokenStep(list(msg.token_ids), msg.text, msg.finish_reason, msg.kv_transfer_ms, msg.kv_num_bytes,
                     decode_evict=evict)


def pruning_from_proto(msg: common_pb2.PruningOptions) -> PruningConfig:
    """A preset (default "off") with knobs given as strings, parsed by each knob's type."""
    knobs: dict[str, object] = {}
    types = {f.name: f.type for f in fields(PruningConfig)}
    for name, text in msg.knobs.items():
        if name not in types:
            raise InvalidRequest(f"unknown pruning option {name[:64]!r}; known options: {sorted(types)}")
        knobs[name] = _parse_knob(name, text, str(types[name]))
    try:
        return PruningConfig.from_preset(msg.preset or "off", **knobs)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None


def _parse_knob(name: str, text: str, type_name: str) -> object:
    try:
        if type_name == "bool":
            if text.lower() not in ("true", "false", "1", "0"):
                raise ValueError
            return text.lower() in ("true", "1")
        if "None" in type_name and text.lower() in ("", "none"):
            return None
        if type_name.startswith("int"):
            return _knob_int(text)
        if type_name == "float":
            value = float(text)
            if not math.isfinite(value):
                raise ValueError
            return value
        if type_name.startswith("tuple[int"):
            # "1,3", "(1, 3)" or "[1, 3]"; "" or "()" is the empty tuple
            parts = text.strip().strip("()[]").replace(" ", "")
            return tuple(_knob_int(x) for x in parts.split(",") if x)
        return text
    except ValueError:
        raise InvalidRequest(
            f"pruning option {name}={text[:64]!r} is not a valid {type_name}"
            + (f" (integers within +-{_MAX_KNOB_INT}, finite numbers)" if type_name != "bool" else "")
        ) from None


_MAX_KNOB_INT = 2**62
"""Integer knobs (layers, counts, byte budgets) beyond this are refused: no real value is near
it, and torch index arithmetic overflows int64 past it."""


def _knob_int(text: str) -> int:
    value = int(text)
    if abs(value) > _MAX_KNOB_INT:
        raise ValueError
    return value


def pruning_to_proto(cfg: PruningConfig) -> common_pb2.PruningOptions:
    default = PruningConfig()
    knobs = {f.name: str(getattr(cfg, f.name)) for f in fields(cfg) if getattr(cfg, f.name) != getattr(default, f.name)}
    return common_pb2.PruningOptions(preset="off", knobs=knobs)


def stats_to_proto(stats: PruningStats) -> common_pb2.PruningReport:
    return common_pb2.PruningReport(
        stages=[
            common_pb2.PruningStageCount(stage=s.stage, num_visual_tokens_in=s.num_visual_tokens_in,
                                         num_visual_tokens_out=s.num_visual_tokens_out)
            for s in stats.stages
        ],
        num_key_tokens=stats.num_key_tokens,
        prefill_flops_full=stats.prefill_flops_full,
        prefill_flops_pruned=stats.prefill_flops_pruned,
        kv_bytes_before=stats.kv_bytes_before,
        kv_bytes_after=stats.kv_bytes_after,
    )


def stats_from_proto(msg: common_pb2.PruningReport) -> PruningStats:
    stats = PruningStats(
        num_key_tokens=msg.num_key_tokens,
        prefill_flops_full=msg.prefill_flops_full,
        prefill_flops_pruned=msg.prefill_flops_pruned,
        kv_bytes_before=msg.kv_bytes_before,
        kv_bytes_after=msg.kv_bytes_after,
    )
    for s in msg.stages:
        stats.record(s.stage, s.num_visual_tokens_in, s.num_visual_tokens_out)
    return stats
