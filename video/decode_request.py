"""The shared state of one parallel decode (`VideoDecodeRequest`), between the consumer that waits for its
frames (`FrameGroupStream`) and the worker tasks (`ShareTask`, one per share of the plan) that decode them:
the output array of distinct frames, which intervals are done, the intervals still pending per share
(work stealing: `take`), and the first failure. A request's life: `epd.video.parallel_decoder`."""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from epd.video.budget import DecodeBudget
from epd.video.keyframe_index import VideoIndex
from epd.video.plan import DecodePlan
from epd.video.simple_decoder import CORRUPT_MEDIA_MESSAGE, gather_slots
from epd.video.types import DecodeLimits, FrameResize, MediaError, SamplingOptions

if TYPE_CHECKING:
    from epd.video.parallel_decoder import DecodeWorker


class ShareStopped(Exception):
    """Raised inside `decode_share` when the request stopped (failed, cancelled) or the worker was
    retired: the worker leaves its share quietly, as the request's outcome is already decided."""


class VideoDecodeRequest:
    """Shared state of one decode between the consumer and the worker tasks."""

    def __init__(
        self,
        data: bytes,
        index: VideoIndex,
        plan: DecodePlan,
        opts: SamplingOptions,
        seek_cost_frames: float,
        limits: DecodeLimits = DecodeLimits(),
        caller_cancel: threading.Event | None = None,
        started_s: float | None = None,
        frame_resize: FrameResize | None = None,
    ):
        self.data = data
        self.frame_resize = frame_resize
        """Applied to each target frame before it is stored (`iter_groups`)."""
        self.decoded_shape: tuple[int, ...] | None = None
        """[H, W, 3] of the first target frame as decoded, before `frame_resize`."""
        self.index = index
        self.plan = plan
        self.opts = opts
        self.seek_cost_frames = seek_cost_frames
        self.limits = limits
        # --max-decode-s counts from the start of the request's decode (`started_s`, before
        # its demux pass), not from here.
        self.budget = DecodeBudget(limits, started_s)
        distinct = np.unique(plan.slot_pts)  # [U] sorted: the frames to decode
        self.unique_of_pts = {pts: u for u, pts in enumerate(distinct.tolist())}
        self.unique_of_slot = np.searchsorted(distinct, plan.slot_pts)  # [T] non-decreasing
        self.interval_of_pts = {pts: iv.position for iv in plan.intervals for pts in iv.target_pts}
        self.out: np.ndarray | None = None  # [U, H, W, 3], allocated at the first frame
        self.interval_done = [False] * len(plan.intervals)
        # Intervals not yet started, per share: a task takes from the front of its own and, when
        # that is empty, from the back of the share with the most planned frames left.
        self.pending = [collections.deque(share) for share in plan.shares]
        # Targets of the whole request: packets with these pts are always decoded in full.
        self.target_pts = frozenset(plan.slot_pts.tolist())
        self.cond = threading.Condition()
        self.error: MediaError | None = None
        self.cancelled = threading.Event()
        """Set when the request failed or its consumer left: workers stop at the next frame."""
        self.caller_cancel = caller_cancel
        """The caller's own flag (its client went away), set from another thread."""
        self.tasks: list[ShareTask] = []

    def stopped(self) -> bool:
        return self.cancelled.is_set() or (self.caller_cancel is not None and self.caller_cancel.is_set())

    def put_frame(self, pts: int, rgb: np.ndarray) -> None:
        """Store the target frame `rgb` [H, W, 3] as decoded, resized by `frame_resize` (on the
        calling worker: only its one frame is ever held at the source size)."""
        with self.cond:
            if self.decoded_shape is None:
                self.decoded_shape = rgb.shape
        # Compared as decoded, not as resized: two sizes may resize to one (a fixed-size resize
        # always does), and the reference decoder fails the same way (np.stack of unequal frames).
        if rgb.shape != self.decoded_shape:
            raise MediaError(CORRUPT_MEDIA_MESSAGE)
        kept = rgb if self.frame_resize is None else self.frame_resize(rgb)  # [h, w, 3]
        with self.cond:
            if self.out is None:
                self.out = np.empty((len(self.unique_of_pts), *kept.shape), np.uint8)
        if kept.shape != self.out.shape[1:]:
            raise MediaError(CORRUPT_MEDIA_MESSAGE)
        self.out[self.unique_of_pts[pts]] = kept

    def frames_of_slots(self, first: int, last: int) -> np.ndarray:
        """[last - first, H, W, 3] frames of slots [first, last), once their intervals are done."""
        assert self.out is not None
        return gather_slots(self.out, self.unique_of_slot[first:last])

    def take(self, share: int) -> int | None:
        """The next interval position for the task of `share`, or None when none is left."""
        with self.cond:
            if self.pending[share]:
                return self.pending[share].popleft()
            cost = [sum(self.plan.intervals[p].num_decode_frames for p in q) for q in self.pending]
            busiest = max(range(len(cost)), key=cost.__getitem__)
            return self.pending[busiest].pop() if self.pending[busiest] else None

    def finish_interval(self, position: int) -> None:
        with self.cond:
            self.interval_done[position] = True
            self.cond.notify_all()

    def fail(self, error: MediaError) -> None:
        with self.cond:
            if self.error is None:
                self.error = error
            self.cancelled.set()
            self.cond.notify_all()


@dataclass
class ShareTask:
    request: VideoDecodeRequest
    share: int
    """Which of the plan's shares this task starts on (it may then steal from the others)."""
    started_at: float | None = None
    last_progress: float = 0.0
    """time.monotonic() of the last decoded frame (or of the start)."""
    worker: DecodeWorker | None = None
    done: bool = False
    num_decoded_frames: int = 0
