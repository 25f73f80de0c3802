"""A chat request's options for its media (no HTTP in here): frame sampling in one extra object,
`"media": {"fps", "max_frames", "min_frames", "num_frames", "max_pixels", "start_time_s",
"end_time_s"}` (with the openai client: `extra_body={"media": {...}}`) over the server's
defaults, and visual token dropping in `"pruning": {"preset": "balanced", "knobs":
{"kv_keep_ratio": 0.25}}`, parsed as the gRPC path parses its `PruningOptions`. A conversation
without a media part has them checked, with nothing to act on, as vLLM ignores its multimodal
options without media."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from epd.gateway.json_fields import INT32_MAX, INT64_MAX, NumberRange, checked_text, number_field
from epd.stages.errors import InvalidRequest
from epd.token_pruning import PruningConfig
from epd.transport.convert import MAX_SAMPLING_FPS, pruning_from_proto
from epd.v1 import common_pb2
from epd.video.types import ONE_FRAME_CHOICE, SamplingOptions

_MEDIA_OPTIONS = {
    "fps": NumberRange(float, 0.0, MAX_SAMPLING_FPS, low_open=True),
    "max_frames": NumberRange(int, 1, INT32_MAX),
    "min_frames": NumberRange(int, 1, INT32_MAX),
    "num_frames": NumberRange(int, 1, INT32_MAX),
    "max_pixels": NumberRange(int, 1, INT64_MAX),
    "start_time_s": NumberRange(float, 0.0, math.inf),
    "end_time_s": NumberRange(float, 0.0, math.inf, low_open=True),
}


def parse_sampling(media: Any, defaults: SamplingOptions) -> SamplingOptions:
    if media is None:
        return defaults
    if not isinstance(media, dict):
        raise InvalidRequest(
            '\'media\' must be an object such as {"num_frames": 8} or {"fps": 2, "max_frames": 32}'
        )
    unknown = sorted(str(name)[:64] for name in set(media) - set(_MEDIA_OPTIONS))
    if unknown:
        raise InvalidRequest(f"unknown media options {unknown[:8]}; known: {sorted(_MEDIA_OPTIONS)}")
    v = {name: number_field(media, name, spec, None) for name, spec in _MEDIA_OPTIONS.items()}
    if v["fps"] is not None and v["num_frames"] is not None:
        raise InvalidRequest(f"'media': fps and num_frames: {ONE_FRAME_CHOICE}")
    if v["fps"] is not None:  # the request's rate, not the server's --num-frames
        defaults = replace(defaults, num_frames=None)
    max_frames = v["max_frames"] if v["max_frames"] is not None else defaults.max_frames
    return replace(
        defaults,
        fps=v["fps"] if v["fps"] is not None else defaults.fps,
        max_frames=max_frames,
        min_frames=v["min_frames"] if v["min_frames"] is not None else min(defaults.min_frames, max_frames),
        num_frames=v["num_frames"] if v["num_frames"] is not None else defaults.num_frames,
        max_pixels=v["max_pixels"] if v["max_pixels"] is not None else defaults.max_pixels,
        start_time_s=v["start_time_s"] if v["start_time_s"] is not None else defaults.start_time_s,
        end_time_s=v["end_time_s"] if v["end_time_s"] is not None else defaults.end_time_s,
    )


def parse_pruning(value: Any) -> PruningConfig:
    """{"preset": name, "knobs": {name: value}} -> PruningConfig, parsed as the gRPC path does."""
    if value is None:
        return PruningConfig()
    if not isinstance(value, dict) or set(value) - {"preset", "knobs"}:
        raise InvalidRequest('\'pruning\' must be an object like {"preset": "balanced", "knobs": {...}}')
    knobs = value.get("knobs") or {}
    if not isinstance(knobs, dict):
        raise InvalidRequest("pruning.knobs must be an object of knob names to values")
    preset = value.get("preset") or "off"
    if not isinstance(preset, str):
        raise InvalidRequest('pruning.preset must be a string such as "balanced"')
    text_knobs = {}
    for name, knob in knobs.items():
        if isinstance(knob, (dict, list)):
            raise InvalidRequest(
                f"pruning.knobs.{checked_text(name, 'pruning.knobs')[:64]} must be a number, string or bool"
            )
        text = str(knob).lower() if isinstance(knob, bool) else str(knob)
        text_knobs[checked_text(name, "pruning.knobs")] = checked_text(text, f"pruning.knobs.{name[:64]}")
    options = common_pb2.PruningOptions(preset=checked_text(preset, "pruning.preset"), knobs=text_knobs)
    return pruning_from_proto(options)
