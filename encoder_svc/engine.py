"""Encode: media bytes -> sampled frames -> visual token embeddings. No gRPC here."""

from __future__ import annotations

import hashlib
import logging
import time

from encoder_svc.config import EncoderConfig
from model_runtime.adapter import VisualMeta, VLMAdapter
from stages.contracts import EncodedMedia, EventSink, StageEvent
from transport.errors import ResourceExhausted
from video import simple_decoder
from video.types import SamplingOptions

log = logging.getLogger(__name__)


class EncoderEngine:
    """Owns the vision tower. `encode` is synchronous and runs one request at a time."""

    def __init__(self, config: EncoderConfig, adapter: VLMAdapter) -> None:
        self.config = config
        self.adapter = adapter

    def encode(self, data: bytes, sampling: SamplingOptions, on_event: EventSink) -> EncodedMedia:
        sha256 = hashlib.sha256(data).hexdigest()
        on_event(StageEvent("decode", "started"))
        video = simple_decoder.decode(data, sampling, self.config.limits)
        decode_ms = video.stats.get("decode_ms", 0.0)
        on_event(
            StageEvent(
                "decode",
                "finished",
                decode_ms,
                {"num_frames": str(video.num_frames), "height": str(video.frames.shape[1]),
                 "width": str(video.frames.shape[2])},
            )
        )
        on_event(StageEvent("encode", "started"))
        t0 = time.perf_counter()
        inputs = self.adapter.preprocess(video)
        num_tokens = self.adapter.num_visual_tokens(inputs.grid_thw)
        if num_tokens > self.config.max_visual_tokens:
            raise ResourceExhausted(
                f"this video would give {num_tokens} visual tokens but the encoder allows "
                f"{self.config.max_visual_tokens}; lower max_frames/fps or max_pixels"
            )
        embeds = self.adapter.encode(inputs)
        encode_ms = (time.perf_counter() - t0) * 1e3
        on_event(StageEvent("encode", "finished", encode_ms, {"num_visual_tokens": str(num_tokens)}))
        meta = VisualMeta(inputs.modality, inputs.grid_thw, inputs.second_per_grid_t, int(embeds.shape[0]))
        return EncodedMedia(
            embeds=embeds,
            meta=meta,
            num_frames=video.num_frames,
            frame_timestamps_s=video.timestamps_s,
            decode_ms=decode_ms,
            encode_ms=encode_ms,
            sha256=sha256,
        )
