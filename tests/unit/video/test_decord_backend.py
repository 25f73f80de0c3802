"""The optional decord backend: same frames as PyAV where its FFmpeg agrees; a hang is killed."""

from __future__ import annotations

import numpy as np
import pytest

from epd.video import simple_decoder
from epd.video.decord_backend import DecordConfig, DecordDecoder, decord_available
from epd.video.types import MediaError, SamplingOptions

# Never import decord into the test process: it breaks PyAV's own codecs (see decord_backend).
pytestmark = pytest.mark.skipif(not decord_available(), reason="decord is an optional backend")

SMALL = dict(size=(96, 64), fps=10.0, seconds=3.0, gop=10)


@pytest.fixture(scope="module")
def decord_decoder():
    dec = DecordDecoder()
    yield dec
    dec.close()


@pytest.mark.parametrize(
    "codec,suffix",
    [("h264", ".mp4"), ("h264", ".mkv"), ("vp9", ".webm"), ("mjpeg", ".avi")],
)
def test_decord_frames_identical_to_reference(video_factory, decord_decoder, codec, suffix):
    data = video_factory(suffix, codec=codec, **SMALL)
    opts = SamplingOptions(num_frames=6, start_time_s=0.2)
    got = decord_decoder.decode(data, opts)
    expected = simple_decoder.decode(data, opts)
    assert np.array_equal(got.frames, expected.frames)
    assert got.timestamps_s == expected.timestamps_s


def test_decord_applies_rotation(video_factory, decord_decoder):
    data = video_factory(".mp4", codec="h264", rotation_deg=90, **SMALL)
    opts = SamplingOptions(num_frames=3)
    assert np.array_equal(decord_decoder.decode(data, opts).frames, simple_decoder.decode(data, opts).frames)


def test_decord_refuses_what_it_cannot_decode(video_factory, decord_decoder):
    data = video_factory(".webm", codec="av1", **SMALL)
    with pytest.raises(MediaError, match="use the default PyAV backend"):
        decord_decoder.decode(data, SamplingOptions(num_frames=3))


def test_decord_hang_is_killed_and_backend_restarts(video_factory):
    data = video_factory(".mp4", codec="h264", **SMALL)
    with DecordDecoder(DecordConfig(timeout_s=0.001)) as dec:
        # The child cannot even start within 1 ms: it is treated as hung and killed.
        with pytest.raises(MediaError, match="did not answer within"):
            dec.decode(data, SamplingOptions(num_frames=3))
        assert dec.num_restarts == 1 and dec._proc is None
        dec.config = DecordConfig(timeout_s=60)
        got = dec.decode(data, SamplingOptions(num_frames=3))
    assert np.array_equal(got.frames, simple_decoder.decode(data, SamplingOptions(num_frames=3)).frames)
