"""A parallel decode's shared state (`epd.video.decode_request.VideoDecodeRequest`) on its own, without the pool:
work stealing, failure and cancel bookkeeping."""

from __future__ import annotations

import threading

from epd.video.decode_request import VideoDecodeRequest
from epd.video.keyframe_index import build_video_index
from epd.video.plan import make_plan
from epd.video.types import MediaError, SamplingOptions


def make_request(video_factory, caller_cancel: threading.Event | None = None) -> VideoDecodeRequest:
    """A request of 6 frames from 6 GOPs, planned for 2 workers (3 intervals each)."""
    data = video_factory(".mp4", codec="h264", size=(96, 64), fps=10.0, seconds=6.0, gop=10)
    index = build_video_index(data)
    opts = SamplingOptions(num_frames=6)
    plan = make_plan(index, opts, 2, 0.0)
    assert [len(s) for s in plan.shares] == [3, 3]
    return VideoDecodeRequest(data, index, plan, opts, 0.0, caller_cancel=caller_cancel)


def test_tasks_take_their_share_in_order_then_steal_from_the_back(video_factory):
    """Work stealing bookkeeping: a task takes its own share front to back, then the pending
    intervals of the other shares from the back; every interval is handed out exactly once."""
    req = make_request(video_factory)
    plan = req.plan
    first = req.take(1)
    assert first == plan.shares[1][0]
    order = []
    while (position := req.take(0)) is not None:
        order.append(position)
    assert order == plan.shares[0] + plan.shares[1][1:][::-1]
    assert req.take(1) is None


def test_the_first_failure_is_the_one_the_consumer_gets(video_factory):
    """A failing worker cancels the request; what the other workers raise after that (a read the
    cancel cut short, a second bad frame) must not replace the reason the consumer reports."""
    req = make_request(video_factory)
    assert not req.stopped()
    first, later = MediaError("the first reason"), MediaError("a later one")
    req.fail(first)
    req.fail(later)
    assert req.error is first
    assert req.cancelled.is_set() and req.stopped()


def test_the_callers_flag_stops_the_workers(video_factory):
    """The caller's own flag (its client went away) stops the workers at their next frame, though
    the request itself has not failed."""
    caller_cancel = threading.Event()
    req = make_request(video_factory, caller_cancel)
    assert not req.stopped()
    caller_cancel.set()
    assert req.stopped() and not req.cancelled.is_set() and req.error is None
