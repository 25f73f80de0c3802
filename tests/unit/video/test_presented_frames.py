"""Each returned frame is the one a player shows at its returned timestamp, in files whose packets
do not map one to one onto shown frames: an MP4 cut with an edit list (`ffmpeg -ss T -c copy`),
streams cut mid-GOP. Every frame shows its number (`frame_pattern(..., "number")`), so a frame
returned for the wrong time is caught even where both decoders agree."""

from __future__ import annotations

import pytest

from epd.video import simple_decoder
from epd.video.types import SamplingOptions
from tests.media import cut_with_edit_list, drop_first_packets, read_frame_number

FPS = 10.0
NUMBERED = dict(size=(96, 64), fps=FPS, gop=10, pattern="number")


def assert_shows_its_time(video, first_shown: int) -> None:
    """Frame k of the source is shown at (k - first_shown) / FPS s after the first shown frame."""
    shown = [read_frame_number(frame) for frame in video.frames]
    expected = [first_shown + round(t * FPS) for t in video.timestamps_s]
    assert shown == expected, f"timestamps {video.timestamps_s}"


def decode_both(decoder, data: bytes, opts: SamplingOptions):
    reference = simple_decoder.decode(data, opts)
    parallel = decoder.decode(data, opts)
    assert parallel.timestamps_s == reference.timestamps_s
    assert (parallel.frames == reference.frames).all()
    assert parallel.duration_s == pytest.approx(reference.duration_s)
    return reference


@pytest.mark.parametrize("bframes", [0, 3])
def test_mp4_cut_with_an_edit_list_starts_at_the_cut(video_factory, decoder, bframes):
    """Frames 10..39 kept (from the keyframe at 10), presentation from frame 15: the 5 frames
    before it are decoded as references but never shown. They used to be in the index, so a
    target on one failed the request as corrupt, and the timestamps and duration were 0.5 s long."""
    source = video_factory(".mkv", codec="h264", seconds=4.0, bframes=bframes, **NUMBERED)
    data = cut_with_edit_list(source, FPS, first_kept=10, first_shown=15)
    for opts in (SamplingOptions(num_frames=4), SamplingOptions(num_frames=25), SamplingOptions()):
        video = decode_both(decoder, data, opts)
        assert video.duration_s == pytest.approx(25 / FPS)  # frames 15..39
        assert_shows_its_time(video, first_shown=15)
    every = decode_both(decoder, data, SamplingOptions(num_frames=25))
    assert [read_frame_number(frame) for frame in every.frames] == list(range(15, 40))
    assert every.timestamps_s[0] == 0.0


@pytest.mark.parametrize("container", ["matroska", "mpegts"])
def test_stream_cut_mid_gop_starts_at_its_first_keyframe(video_factory, decoder, container):
    """The first 3 packets (decode order) are gone: frames 0..9 reference frames that are not
    there and no decoder outputs them; the video starts at the keyframe of frame 10."""
    source = video_factory(".mkv", codec="h264", seconds=4.0, bframes=2, **NUMBERED)
    data = drop_first_packets(source, 3, container)
    for opts in (
        SamplingOptions(num_frames=4),
        SamplingOptions(num_frames=16),
        SamplingOptions(num_frames=30),
    ):
        video = decode_both(decoder, data, opts)
        assert video.duration_s == pytest.approx(30 / FPS)  # frames 10..39
        assert_shows_its_time(video, first_shown=10)


@pytest.mark.parametrize("bframes,open_gop", [(3, False), (3, True), (0, False)])
def test_avi_with_b_frames_returns_each_frame_at_its_time(video_factory, decoder, bframes, open_gop):
    """AVI stores no presentation times: FFmpeg numbers its packets in file (decode) order, and
    gives each decoded frame the number of the packet that carried it, so matching frames on their
    pts paired B-frame content with the wrong timestamps (frames [4, 1, 5, 11, ...] for 16 of 40,
    in both decoders). A keyframe every 7 frames; with an open GOP, a decoder that seeks to a
    keyframe drops the B-frames shown before it, so no count from there is right."""
    data = video_factory(".avi", codec="h264", seconds=4.0, bframes=bframes, open_gop=open_gop,
                         **{**NUMBERED, "gop": 7})  # fmt: skip
    for opts in (
        SamplingOptions(num_frames=16),
        SamplingOptions(num_frames=40),
        SamplingOptions(num_frames=5),
    ):
        video = decode_both(decoder, data, opts)
        assert_shows_its_time(video, first_shown=0)
    every = decode_both(decoder, data, SamplingOptions(num_frames=40))
    assert [read_frame_number(frame) for frame in every.frames] == list(range(40))
    # Frames matched by output order: one sequential decode from the start (no seek) with B-frames.
    num_intervals = decoder.decode(data, SamplingOptions(num_frames=5)).stats["num_intervals"]
    assert num_intervals == 1 if bframes else num_intervals >= 2
