"""Fixtures that several integration test files use: a clip whose decode keeps the encoder busy
(`long_clip`: test_cancellation, test_structured_early_compile)."""

from __future__ import annotations

import pytest

from tests.media import make_video


@pytest.fixture(scope="session")
def long_clip(tmp_path_factory):
    """One keyframe in 30 s of 640x480: decoding 256 frames of it takes the encoder seconds.
    Session-scoped: 900 textured frames take seconds to encode, and both modules only read it."""
    return make_video(
        tmp_path_factory.mktemp("long") / "long.mp4",
        size=(640, 480),
        fps=30.0,
        seconds=30.0,
        gop=900,
        pattern="texture",
    )
