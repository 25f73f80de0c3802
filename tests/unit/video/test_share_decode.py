"""One worker's decode of its share (`epd.video.share_decode`), its seeks made directly."""

from __future__ import annotations

from epd.video.budget import DecodeBudget
from epd.video.keyframe_index import build_video_index
from epd.video.media_open import open_video
from epd.video.share_decode import seek_to_keyframe
from epd.video.types import DecodeLimits

# 3 s at 10 fps, a keyframe every 10 frames: 3 GOPs.
SMALL = dict(size=(96, 64), fps=10.0, seconds=3.0, gop=10)


def test_a_worker_seeking_back_to_the_first_interval_lands_at_the_start(video_factory):
    """A worker that took a later interval first (its own share, or one stolen from another) seeks
    back for the first one. Seeking to the first frame's own pts in MPEG-TS lands a GOP later, and
    the back-off "to the start" sought that same pts again: the request failed as corrupt (about
    1 decode in 1,500 of the auditor's MPEG-TS comparison, depending on which worker started
    first). Here the seek is made directly, after decoding a later GOP."""
    data = video_factory(".ts", container="mpegts", codec="h264", bframes=3, **SMALL)
    index = build_video_index(data)
    budget = DecodeBudget(DecodeLimits())
    first_pts, last_key = int(index.frame_pts[0]), int(index.keyframe_pts[-1])
    with open_video(data) as container:
        stream = container.streams.video[0]
        next(
            seek_to_keyframe(container, stream, index, last_key, last_key, None, budget)
        )  # a later GOP first
        frames = seek_to_keyframe(
            container, stream, index, int(index.keyframe_pts[0]), first_pts, None, budget
        )
        assert next(frames).pts == first_pts
