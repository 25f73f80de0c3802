"""The consumer's side of a parallel decode: `FrameGroupStream` yields a request's sampled frames
in temporal order, in `FrameGroup`s, each as soon as its intervals are decoded; it fails or cancels the
request on an error, a limit, a stall or its caller's cancel. A request's life:
`epd.video.parallel_decoder`."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from epd.video.budget import decode_too_long
from epd.video.decode_request import VideoDecodeRequest
from epd.video.types import DecodeCancelled, DecodedVideo, MediaError

if TYPE_CHECKING:
    from epd.video.parallel_decoder import ParallelDecoder


@dataclass
class FrameGroup:
    """Consecutive sampled frames, ready to encode."""

    frames: np.ndarray
    """[g, H, W, 3] uint8 RGB: a view of the request's output array, or a copy of these g slots
    where slots repeat a frame."""
    timestamps_s: list[float]
    """Presentation time of each frame, seconds from the first frame of the video."""
    first_index: int
    """Position of frames[0] among all sampled frames of the request."""


class FrameGroupStream(Iterator[FrameGroup]):
    """Iterator over the FrameGroups of one request, in temporal order.

    The metadata (`num_frames`, `timestamps_s`, `sampled_fps`, `duration_s`, `source_fps`,
    `is_image`) is known before the first group. Iterating to the end, or `result()`, gives the
    same frames as `simple_decoder.decode`. Breaking off early: call `close()` (or use `with`),
    which cancels the decode work still pending.

    Groups hold `group_size` frames (the last one fewer). With `merge_up_to` frames set, a group
    also takes the next whole groups that are already decoded when it is asked for, up to that many
    frames and `merge_up_to_pixels` pixels: while decoding runs ahead of the consumer (a short
    clip, a single keyframe interval, an idle machine) it gets fewer, larger groups; while the
    consumer is ahead it gets `group_size`.
    """

    def __init__(
        self,
        decoder: ParallelDecoder,
        request: VideoDecodeRequest | None,
        group_size: int,
        timestamps_s: list[float],
        sampled_fps: float,
        duration_s: float,
        source_fps: float,
        image: DecodedVideo | None = None,
        started: float = 0.0,
        merge_up_to: int = 0,
        merge_up_to_pixels: int = 1 << 62,
    ):
        self._decoder = decoder
        self._request = request
        self.group_size = max(1, group_size)
        self.merge_up_to = merge_up_to
        """Most frames of a group made of decoded groups (see the class docstring); 0: never merge."""
        self.merge_up_to_pixels = merge_up_to_pixels
        """Most pixels (frames x height x width) of a merged group."""
        self.timestamps_s = timestamps_s
        self.sampled_fps = sampled_fps
        self.duration_s = duration_s
        self.source_fps = source_fps
        self.is_image = image is not None
        self._image = image
        self._next_slot = 0
        self._started = started
        self.stats: dict[str, float] = {}

    @property
    def num_frames(self) -> int:
        return len(self.timestamps_s)

    def __iter__(self) -> FrameGroupStream:
        return self

    def __next__(self) -> FrameGroup:
        if self._next_slot >= self.num_frames:
            self._finish()
            raise StopIteration
        first = self._next_slot
        last = min(first + self.group_size, self.num_frames)  # exclusive
        if self._image is not None:
            frames = self._image.frames[first:last]
        else:
            self._wait_for_slots(first, last)
            req = self._request
            assert req is not None and req.out is not None  # [unique frames, height, width, 3]
            if self.merge_up_to:
                frame_pixels = max(1, req.out.shape[1] * req.out.shape[2])
                last = self._merge_decoded(
                    first, last, min(self.merge_up_to, self.merge_up_to_pixels // frame_pixels)
                )
            frames = req.frames_of_slots(first, last)  # [n, height, width, 3]
        self._next_slot = last
        return FrameGroup(frames, self.timestamps_s[first:last], first)

    def _merge_decoded(self, first: int, last: int, max_frames: int) -> int:
        """The end of the group [first, last) grown by the next whole groups already decoded, up
        to `max_frames` frames; it never waits."""
        req = self._request
        assert req is not None
        with req.cond:
            while last < self.num_frames:
                end = min(last + self.group_size, self.num_frames)
                if end - first > max_frames:
                    break
                intervals = {req.interval_of_pts[p] for p in req.plan.slot_pts[last:end].tolist()}
                if not all(req.interval_done[i] for i in intervals):
                    break
                last = end
        return last

    def _wait_for_slots(self, first: int, last: int) -> None:
        """Block until every interval holding a frame of slots [first, last) is decoded."""
        req = self._request
        assert req is not None
        positions = {req.interval_of_pts[p] for p in req.plan.slot_pts[first:last].tolist()}
        config = self._decoder.config
        deadline = self._started + config.request_timeout_s
        with req.cond:
            while True:
                if req.error is not None:
                    raise req.error
                if req.caller_cancel is not None and req.caller_cancel.is_set():
                    raise DecodeCancelled(f"cancelled while waiting for frames {first}..{last - 1}")
                if all(req.interval_done[p] for p in positions):
                    return
                now = time.monotonic()
                if now > req.budget.deadline_s:
                    # --max-decode-s, even while every worker is inside one slow frame (the
                    # workers check it only between frames).
                    self._fail_and_retire(decode_too_long(req.limits))
                if now > deadline:
                    self._fail_hung(f"did not finish within {config.request_timeout_s:g} s")
                stalled = [
                    t
                    for t in req.tasks
                    if t.started_at is not None
                    and not t.done
                    and now - t.last_progress > config.stall_timeout_s
                ]
                if stalled:
                    self._fail_hung(f"made no progress for {config.stall_timeout_s:g} s")
                # The caller's flag is a plain threading.Event (set from its event loop), which
                # cannot notify this condition: with one, look again every 50 ms.
                poll_s = 0.05 if req.caller_cancel is not None else 0.5
                wake_s = min(deadline, req.budget.deadline_s) - now
                req.cond.wait(timeout=min(poll_s, max(wake_s, 0.01)))

    def _fail_hung(self, why: str) -> None:
        self._fail_and_retire(
            MediaError(f"decoding the video {why}; the file may be corrupt, or send a shorter clip")
        )

    def _fail_and_retire(self, error: MediaError) -> None:
        """Fail the request and replace the workers still inside it (they stop at their next
        frame, or may never return): the pool keeps its size for the next requests."""
        req = self._request
        assert req is not None
        req.fail(error)
        for task in req.tasks:
            if task.started_at is not None and not task.done and task.worker is not None:
                self._decoder._replace(task.worker)
        raise req.error  # type: ignore[misc]

    def _finish(self) -> None:
        if self._request is not None and not self.stats:
            self.stats = {
                "decode_ms": (time.monotonic() - self._started) * 1e3,
                "num_decoded_frames": float(sum(t.num_decoded_frames for t in self._request.tasks)),
                "num_decoded_pixels": float(self._request.budget.num_decoded_pixels),
                "num_intervals": float(len(self._request.plan.intervals)),
                "num_planned_decode_frames": float(self._request.plan.num_decode_frames),
            }

    def close(self) -> None:
        """Cancel the work still pending for this request (running shares stop at their next
        frame; queued ones are skipped). Safe to call more than once."""
        req = self._request
        if req is not None and not all(req.interval_done):
            req.cancelled.set()

    def result(self) -> DecodedVideo:
        """Wait for the remaining frames and return them all as one DecodedVideo (same as
        simple_decoder.decode): [T, H, W, 3], with a repeated frame copied into each of its slots."""
        if self._image is not None:
            return self._image
        req = self._request
        assert req is not None
        if self._next_slot < self.num_frames:
            self._wait_for_slots(self._next_slot, self.num_frames)
            self._next_slot = self.num_frames
        self._finish()
        return DecodedVideo(
            frames=req.frames_of_slots(0, self.num_frames),
            timestamps_s=self.timestamps_s,
            sampled_fps=self.sampled_fps,
            duration_s=self.duration_s,
            source_fps=self.source_fps,
            stats=self.stats,
        )

    def __enter__(self) -> FrameGroupStream:
        return self

    def __exit__(self, *exc) -> None:
        if self._next_slot < self.num_frames:
            self.close()
        if self._request is not None:
            # A request and its tasks point at each other (req.tasks, task.request): left alone,
            # the pair, and with it every decoded frame (req.out, [U, H, W, 3] uint8), waits for
            # the cyclic GC, which can take many requests. Workers still inside a cancelled task
            # keep their own reference until they return.
            self._request.tasks = []
