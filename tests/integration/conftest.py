"""Fixtures that several integration test files use: a clip whose decode keeps the encoder busy
(`long_clip`: test_cancellation, test_structured_early_compile); tiny Qwen2-VL built before any
test, so that the session's zygote preloads its weights."""

from __future__ import annotations

import pytest

from tests.media import make_video


@pytest.fixture(scope="session", autouse=True)
def _shared_weights_of_tiny_qwen2_vl(tiny_models):
    """tiny_models names tiny Qwen2-VL's weights to the session's zygote (tests/stack.py), which
    only takes them before it starts: built first, so every stack on it shares them whichever test
    starts the zygote (test_shared_weights checks one does)."""


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
