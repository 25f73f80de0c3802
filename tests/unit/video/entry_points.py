"""Every way a client's bytes enter the video library (`_entry_points(decoder)`: name -> a call on
the data), for the untrusted-media tests that check each one refuses the same file the same way."""

from __future__ import annotations

from epd.video import simple_decoder
from epd.video.keyframe_index import KeyframeIndexCache, build_video_index, probe_rotation
from epd.video.media_open import open_video
from epd.video.parallel_decoder import ParallelDecoder
from epd.video.types import DecodeLimits, SamplingOptions


def _entry_points(decoder: ParallelDecoder) -> dict:
    opts = SamplingOptions(num_frames=2)
    return {
        "simple": lambda data: simple_decoder.decode(data, opts),
        "parallel_iter_groups": lambda data: list(decoder.iter_groups(data, opts, group_size=2)),
        "build_video_index": lambda data: build_video_index(data),
        "index_cache": lambda data: KeyframeIndexCache().get_or_build(data, DecodeLimits()),
        "probe_rotation": lambda data: probe_rotation(data),
        "open_video": lambda data: open_video(data).close(),
    }
