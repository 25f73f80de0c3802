"""A chat request's `media` object over the server's frame-sampling defaults
(`epd.gateway.media_options.parse_sampling`)."""

from __future__ import annotations

from epd.gateway.media_options import parse_sampling
from epd.video.types import SamplingOptions


def test_each_media_option_lands_in_its_field_and_none_keeps_the_servers():
    defaults = SamplingOptions(fps=2.0, max_frames=32, min_frames=2, max_pixels=4096)
    assert parse_sampling(None, defaults) is defaults
    asked = {
        "fps": 1,
        "max_frames": 16,
        "min_frames": 4,
        "max_pixels": 1000,
        "start_time_s": 1.5,
        "end_time_s": 3,
    }
    assert parse_sampling(asked, defaults) == SamplingOptions(
        fps=1.0, max_frames=16, min_frames=4, max_pixels=1000, start_time_s=1.5, end_time_s=3.0
    )
    assert parse_sampling({"num_frames": 8}, defaults) == SamplingOptions(
        fps=2.0, max_frames=32, min_frames=2, num_frames=8, max_pixels=4096
    )


def test_a_max_frames_under_the_servers_min_frames_lowers_it():
    """{"max_frames": 1} over the default min_frames 2 asks for one frame: the minimum follows it
    down (min_frames over max_frames is no sampling at all), unless the request names its own."""
    assert parse_sampling({"max_frames": 1}, SamplingOptions(min_frames=2)).min_frames == 1
    assert parse_sampling({"max_frames": 8}, SamplingOptions(min_frames=2)).min_frames == 2
    assert parse_sampling({"max_frames": 4, "min_frames": 3}, SamplingOptions(min_frames=6)).min_frames == 3
