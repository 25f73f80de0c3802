"""The consumer's side of a parallel decode (`epd.video.frame_group_stream`) over a request whose
intervals are marked decoded by hand: which groups merge, without a worker's timing in the way."""

from __future__ import annotations

import time

import numpy as np

from epd.video.decode_request import VideoDecodeRequest
from epd.video.frame_group_stream import FrameGroupStream
from epd.video.keyframe_index import build_video_index
from epd.video.plan import make_plan
from epd.video.types import SamplingOptions


def test_a_merged_group_stops_at_the_first_group_not_yet_decoded(video_factory, decoder):
    """With `merge_up_to`, a group takes the next whole groups only while every one of their
    intervals is decoded: it stops at the first group that waits for an interval, even where later
    intervals are done, and it does not wait for it; the next group, asked for once that interval
    is done, takes all the rest. 12 frames from 3 GOPs: intervals 0 and 2 done, then 1."""
    data = video_factory(".mp4", codec="h264", size=(96, 64), fps=10.0, seconds=3.0, gop=10)
    index = build_video_index(data)
    opts = SamplingOptions(num_frames=12)
    plan = make_plan(index, opts, 1, 0.0)
    req = VideoDecodeRequest(data, index, plan, opts, 0.0)
    interval_of_slot = [req.interval_of_pts[pts] for pts in plan.slot_pts.tolist()]
    assert sorted(set(interval_of_slot)) == [0, 1, 2]
    num_first = interval_of_slot.count(0)
    assert num_first >= 2
    for pts, u in req.unique_of_pts.items():  # frame u is all u: [H, W, 3]
        req.put_frame(pts, np.full((64, 96, 3), u, np.uint8))
    req.finish_interval(0)
    req.finish_interval(2)
    stream = FrameGroupStream(
        decoder,
        req,
        group_size=2,
        timestamps_s=[0.1 * slot for slot in range(12)],
        sampled_fps=plan.sampled_fps,
        duration_s=index.duration_s,
        source_fps=index.source_fps,
        started=time.monotonic(),
        merge_up_to=12,
    )
    first = next(stream)
    end = num_first - num_first % 2  # whole groups of 2 holding only interval 0's frames
    assert (first.first_index, len(first.frames)) == (0, end)
    req.finish_interval(1)
    rest = next(stream)
    assert (rest.first_index, len(rest.frames)) == (end, 12 - end)
    frames = np.concatenate([first.frames, rest.frames])  # [12, 64, 96, 3]
    assert np.array_equal(frames[:, 0, 0, 0], req.unique_of_slot)
    assert rest.timestamps_s == [0.1 * slot for slot in range(end, 12)]
    assert next(stream, None) is None
