"""Shared fixtures for the video tests: tiny real videos (made once per session) and a decoder."""

from __future__ import annotations

from pathlib import Path

import pytest

from epd.video.parallel_decode_config import ParallelDecodeConfig
from epd.video.parallel_decoder import ParallelDecoder
from tests.media import encoder_available, make_video


@pytest.fixture(scope="session")
def video_factory(tmp_path_factory):
    """make(name_suffix, **make_video kwargs) -> bytes, cached per argument set for the session."""
    root = tmp_path_factory.mktemp("videos")
    made: dict[tuple, bytes] = {}

    def make(suffix: str = ".mp4", **kwargs) -> bytes:
        key = (suffix, tuple(sorted(kwargs.items())))
        if key not in made:
            codec = kwargs.get("codec", "h264")
            if not encoder_available(codec):
                pytest.skip(f"this FFmpeg build has no {codec} encoder")
            path = root / f"v{len(made)}{suffix}"
            made[key] = Path(make_video(path, **kwargs)).read_bytes()
        return made[key]

    return make


@pytest.fixture(scope="module")
def decoder():
    """Two workers; seek_cost_frames=0 so even these tiny videos split into several intervals."""
    dec = ParallelDecoder(ParallelDecodeConfig(num_workers=2, seek_cost_frames=0))
    yield dec
    dec.close()
