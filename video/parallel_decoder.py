"""Parallel keyframe-aligned video decoding with a reusable pool of decode threads.

A request's life:
  1. `iter_groups` gets the demux-only `VideoIndex` (cached per tenant and content hash; without a hash from
     the caller, the bytes are hashed beside the demux pass) and makes a `DecodePlan`:
     keyframe-aligned intervals dealt to `num_workers` shares by decode cost. Bad input and
     limits fail here, before any thread is involved. The result's shape is known now, so
     the returned `FrameGroupStream` carries the metadata (sampled_fps, timestamps) up front.
  2. Each share becomes one task on the pool's queue. A worker thread opens its own container
     (through `epd.video.media_open`, like every decode path; one codec context is not thread-safe)
     with `thread_count=1`, and for each interval seeks to its keyframe (or decodes forward when
     the keyframe is only a few frames ahead), decodes until it holds every target, charging
     every decoded frame to the request's `DecodeBudget`, and writes each target straight into
     the request's output array of distinct frames [U, H, W, 3] (U <= T: a frame picked for
     several slots, when the clip has fewer frames than slots, is stored once), at the size the
     caller's `frame_resizer` gives it (the model's: a 4K frame is not held at 24 MiB). Non-reference
     frames that are not targets are skipped (H.264/HEVC, per packet). PyAV releases the GIL in
     demux, decode and swscale, so threads run in parallel and nothing is pickled or copied
     between processes. A task that finishes its share while another still has intervals
     pending takes the last of them (work stealing): the plan balances frame counts, but a
     keyframe costs several times a skipped-through frame, and on a shared machine one core can
     run slower than the other for a while.
  3. The consumer iterates the stream: it waits for intervals in temporal order and yields a
     `FrameGroup` as soon as the frames of that group are ready, so the encoder can start on the
     first frames while later intervals are still decoding. A group's frames are a view of the
     output array, or, where slots repeat a frame, a copy of just that group's slots: the
     [T, H, W, 3] array of every slot exists only if the caller asks for it (`result()`).

Failure: any error fails the whole request with MediaError (decoder text goes to the log only).
A request past its `DecodeLimits.max_decode_s` (counted from the start of `iter_groups`, demux
included; checked at every decoded frame and by the waiting consumer) fails with MediaLimitError;
it, a worker that makes no progress for `stall_timeout_s`, or a request past `request_timeout_s`,
is cancelled: the stuck threads are retired and replaced by fresh ones, so the pool keeps its size;
a retired thread exits at its next frame. A thread stuck forever inside FFmpeg cannot be killed
from Python (use the decord backend's process isolation for decoders that hang while holding the
GIL); its container is closed when it returns. A segfault in FFmpeg kills the process: threads
trade that isolation for speed: the same plan on a process pool (bench/process_decoder.py) was
1.04-1.53x slower on every 300 s benchmark row (docs/benchmarks.md).

Exit: the threads are daemons (an idle pool must not hold the process open), and a pool still
open at interpreter exit is closed then (`_close_at_exit`), as `close()` does (every worker told to
stop first, then all waited for against one deadline, `CLOSE_WAIT_S`): a daemon thread
still inside a frame's resize (torchvision) or FFmpeg when the interpreter finalizes is ended by
pthread_exit as it asks for the GIL back, and the unwinding through torch's C++ frames aborts the
process ("terminate called without an active exception", `epd.stages.model_thread`).
"""

from __future__ import annotations

import atexit
import collections
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from epd.video.budget import DecodeBudget, decode_too_long
from epd.video.keyframe_index import KeyframeIndexCache, VideoIndex
from epd.video.media_open import ReadGuard, open_video, sniff_container
from epd.video.plan import DecodePlan, make_plan
from epd.video.simple_decoder import (
    _CORRUPT,
    check_size,
    decode_failure,
    decode_image,
    frame_to_rgb,
    gather_slots,
    in_presentation_order,
)
from epd.video.types import (
    DecodeCancelled,
    DecodedVideo,
    DecodeLimits,
    FrameResize,
    FrameResizer,
    MediaError,
    SamplingOptions,
)

log = logging.getLogger(__name__)

CLOSE_WAIT_S = 5.0
"""How long `close` (and interpreter exit) waits in all for the workers to end: a worker stops at
its next frame, which takes milliseconds; one that takes longer is stuck inside FFmpeg or a resize,
and the caller goes on without it."""


@dataclass(frozen=True)
class ParallelDecodeConfig:
    """Settings of one ParallelDecoder (one pool shared by all requests)."""

    num_workers: int = field(default_factory=lambda: os.cpu_count() or 1)
    """Decode threads; each decodes one share of a request at a time. Default: one per core."""
    request_timeout_s: float = 300.0
    """A request not finished after this long fails with MediaError and its workers are replaced."""
    stall_timeout_s: float = 30.0
    """A worker that decodes no frame for this long is treated as hung."""
    seek_cost_frames: float = 3.0
    """A seek (flush + keyframe) costs about this many decoded frames; neighbouring intervals
    closer than this are decoded through, and each interval's cost includes one seek."""
    index_cache_entries: int = 256
    """Keyframe indexes kept in memory, by content hash."""
    index_cache_bytes: int = 64 << 20
    """Memory the cached keyframe indexes may hold (16 bytes per frame each), in bytes
    (--index-cache-bytes); least recently used ones are evicted first."""
    skip_nonref_frames: bool = True
    """H.264/HEVC: frames that no other frame references and that are not targets are not decoded
    (FFmpeg's `skip_frame=NONREF`, switched per packet). Lossless: a skipped frame cannot change any
    other frame. With x264's default B-frames about 45% of frames are skipped, which is most of the
    gain where keyframes are far apart and most of a GOP must be decoded anyway."""

    def __post_init__(self) -> None:
        if self.num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {self.num_workers}")
        if self.request_timeout_s <= 0 or self.stall_timeout_s <= 0:
            raise ValueError("request_timeout_s and stall_timeout_s must be > 0")
        if self.index_cache_bytes < 0:
            raise ValueError(f"index_cache_bytes must be >= 0, got {self.index_cache_bytes}")


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


class _Cancelled(Exception):
    pass


class _Request:
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
        self.tasks: list[_Task] = []

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
            raise MediaError(_CORRUPT)
        kept = rgb if self.frame_resize is None else self.frame_resize(rgb)  # [h, w, 3]
        with self.cond:
            if self.out is None:
                self.out = np.empty((len(self.unique_of_pts), *kept.shape), np.uint8)
        if kept.shape != self.out.shape[1:]:
            raise MediaError(_CORRUPT)
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
class _Task:
    request: _Request
    share: int
    """Which of the plan's shares this task starts on (it may then steal from the others)."""
    started_at: float | None = None
    last_progress: float = 0.0
    """time.monotonic() of the last decoded frame (or of the start)."""
    worker: _Worker | None = None
    done: bool = False
    num_decoded_frames: int = 0


class _Worker(threading.Thread):
    def __init__(self, pool: ParallelDecoder, number: int):
        super().__init__(name=f"video-decode-{number}", daemon=True)
        self.pool = pool
        self.retired = threading.Event()

    def run(self) -> None:
        try:
            while not self.retired.is_set():
                task = self.pool._tasks.get()
                if task is None:  # shutdown
                    return
                self._run_task(task)
                # While this thread waits for the next task, it must not keep the last one alive:
                # the task holds its request, whose output holds every decoded frame.
                del task
        finally:
            self.pool._worker_exited(self)

    def _run_task(self, task: _Task) -> None:
        req = task.request
        if req.stopped():
            return
        task.worker = self
        task.started_at = task.last_progress = time.monotonic()
        try:
            _decode_share(task, self.retired, self.pool.config.skip_nonref_frames)
        except _Cancelled:
            pass
        except MediaError as exc:
            req.fail(exc)
        except Exception as exc:
            log.info("video decode worker failed: %r", exc)  # decoder text stays in the log
            req.fail(decode_failure(exc))
        except BaseException:
            req.fail(MediaError("a video decode worker crashed; send the request again"))
            raise  # the thread ends; _worker_exited replaces it
        finally:
            task.done = True


# Codecs whose FFmpeg decoders honour skip_frame=NONREF exactly (drop only frames no other frame
# references). Others (VP9, AV1, MPEG-4 Part 2, MJPEG) decode every frame.
_NONREF_SKIP_CODECS = frozenset({"h264", "hevc"})


def _decode_share(task: _Task, retired: threading.Event, skip_nonref: bool) -> None:
    """Decode the intervals of one share in order with one container; write targets to the output."""
    req = task.request
    budget = req.budget

    def check_read() -> None:  # also between the packets of other streams (`ReadGuard`)
        budget.check_time()
        if req.stopped() or retired.is_set():
            raise _Cancelled

    guard = ReadGuard(check_read)
    try:
        _decode_intervals(task, guard, retired, skip_nonref)
    except Exception:
        guard.raise_if_stopped()  # a limit or a cancel cut the file short: that is the reason
        raise
    finally:
        guard.release()


def _decode_intervals(task: _Task, guard: ReadGuard, retired: threading.Event, skip_nonref: bool) -> None:
    """The body of `_decode_share`: one container, opened through `guard`."""
    req = task.request
    index = req.index
    frame_pts = index.frame_pts
    budget = req.budget
    with open_video(req.data, req.limits, guard) as container:
        stream = container.streams.video[0]
        stream.codec_context.thread_count = 1  # parallelism is across workers, not inside one
        keep: frozenset[int] | None = None  # packets to decode in full; None: every packet
        # Frames matched by output order (decode-order pts) must all come out: no skipping.
        order_pts = frame_pts if index.frames.pts_in_decode_order else None
        if skip_nonref and order_pts is None and stream.codec_context.name in _NONREF_SKIP_CODECS:
            # Every target of the request, not only the current interval's: the decoder's reorder
            # delay means packets of the next interval are sent before this one's last frame is out.
            keep = req.target_pts
        frames: Iterator | None = None  # the live decode iterator
        last_pts = int(frame_pts[0]) - 1  # pts of the last frame taken from it
        while (position := req.take(task.share)) is not None:
            if req.stopped() or retired.is_set():
                raise _Cancelled
            interval = req.plan.intervals[position]
            wanted = set(interval.target_pts)
            first_target = interval.target_pts[0]
            if frames is None:
                if interval.keyframe_pts <= frame_pts[0]:
                    frames = _decode_iter(container, stream, keep, budget, order_pts)
                else:
                    frames = _seek(
                        container, stream, index, interval.keyframe_pts, first_target, keep, budget
                    )
            else:
                ahead = int(
                    np.searchsorted(frame_pts, interval.keyframe_pts)
                    - np.searchsorted(frame_pts, last_pts, "right")
                )
                if last_pts >= first_target or ahead > req.seek_cost_frames:
                    frames = _seek(
                        container, stream, index, interval.keyframe_pts, first_target, keep, budget
                    )
            for frame in frames:
                if req.stopped() or retired.is_set():
                    raise _Cancelled
                task.last_progress = time.monotonic()
                task.num_decoded_frames += 1
                last_pts = frame.pts
                if frame.pts in wanted:
                    req.put_frame(frame.pts, frame_to_rgb(frame, req.opts.max_pixels))  # [H, W, 3]
                    wanted.discard(frame.pts)
                    if not wanted:
                        break
            if wanted:  # the stream ended before a target: truncated or corrupt
                raise MediaError(_CORRUPT)
            req.finish_interval(position)


def _decode_iter(
    container, stream, keep: frozenset[int] | None, budget: DecodeBudget, order_pts: np.ndarray | None = None
) -> Iterator:
    """Decoded frames from the container's current position, each charged to `budget` (frames
    without a pts too). With `keep`, a packet whose pts is not in it is decoded with
    skip_frame=NONREF (FFmpeg decodes each packet as it is sent when frame threading is off, so
    the setting applies to exactly that packet). With `order_pts` (the index's [N] frame pts, for
    a stream whose packets carry decode-order pts), frames get their pts by output order."""
    frames = _decode_packets(container, stream, keep, budget)
    return frames if order_pts is None else in_presentation_order(frames, order_pts)


def _decode_packets(container, stream, keep: frozenset[int] | None, budget: DecodeBudget) -> Iterator:
    import av

    ctx = stream.codec_context
    for packet in container.demux(stream):
        if keep is not None:
            ctx.skip_frame = "DEFAULT" if packet.pts is None or packet.pts in keep else "NONREF"
        try:
            decoded = ctx.decode(packet if packet.size else None)
        except av.FFmpegError:
            budget.check_decoder_size(ctx)  # refused by FFmpeg's max_pixels guard?
            raise
        for frame in decoded:
            budget.charge(frame)
            if frame.pts is not None:
                yield frame


def _seek(
    container,
    stream,
    index: VideoIndex,
    keyframe_pts: int,
    first_target: int,
    keep: frozenset[int] | None,
    budget: DecodeBudget,
) -> Iterator:
    """Seek to the keyframe; if the demuxer lands after the first target, back off and retry."""
    keys = index.keyframe_pts
    k = int(np.searchsorted(keys, keyframe_pts, "right")) - 1
    tried = 0
    while True:
        if k < 0 or keys[k] <= index.frame_pts[0]:
            # The start. Not the first frame's own pts: FFmpeg's MPEG-TS seek (a binary search on
            # timestamps) lands a GOP later for it; a time before every frame lands at the start,
            # as the reference decoder's seek(0) does.
            k = -1
            key = min(0, int(index.frame_pts[0]))
        else:
            key = int(keys[k])
        container.seek(key, stream=stream, backward=True, any_frame=False)
        frames = _decode_iter(container, stream, keep, budget)  # never with decode-order pts: no seek
        first = next(frames, None)
        if first is not None and first.pts <= first_target:
            return itertools.chain([first], frames)
        if k < 0:  # landed after the target even from the start: the stream cannot be read
            raise MediaError(_CORRUPT)
        tried += 1
        # Back off: one keyframe earlier, then jump to the start.
        k = k - 1 if tried < 3 else -1


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
        request: _Request | None,
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


class ParallelDecoder:
    """A pool of decode threads, reused across requests. Thread-safe; `close()` when done."""

    def __init__(self, config: ParallelDecodeConfig | None = None):
        self.config = config or ParallelDecodeConfig()
        self.index_cache = KeyframeIndexCache(self.config.index_cache_entries, self.config.index_cache_bytes)
        self._tasks: queue.SimpleQueue[_Task | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._workers: set[_Worker] = set()
        self._closed = False
        self._num_started = 0
        self.num_replaced_workers = 0
        for _ in range(self.config.num_workers):
            self._start_worker()
        with _open_pools_lock:
            _open_pools.add(self)

    # -- public API -------------------------------------------------------------------------
    def decode(
        self,
        data: bytes,
        opts: SamplingOptions,
        limits: DecodeLimits = DecodeLimits(),
        sha256: str | None = None,
    ) -> DecodedVideo:
        """Same result as `simple_decoder.decode`, frame for frame."""
        with self.iter_groups(data, opts, limits, group_size=1 << 30, sha256=sha256) as stream:
            return stream.result()

    def iter_groups(
        self,
        data: bytes,
        opts: SamplingOptions,
        limits: DecodeLimits = DecodeLimits(),
        group_size: int = 2,
        sha256: str | None = None,
        cancel: threading.Event | None = None,
        merge_up_to: int = 0,
        merge_up_to_pixels: int = 1 << 62,
        cache_salt: str = "",
        frame_resizer: FrameResizer | None = None,
    ) -> FrameGroupStream:
        """Plan the request and start decoding; frames come back in groups of `group_size`
        (with `merge_up_to`, groups already decoded merge, up to that many frames and
        `merge_up_to_pixels` pixels: `FrameGroupStream`).

        `frame_resizer` is called once with the plan's frame count (the `num_frames` of the
        stream); the resize it returns ([H, W, 3] -> [h, w, 3] uint8, called on the decode threads,
        several at once) is applied to each distinct video frame as it is decoded, so the request's
        frames are held at the size it returns, not at the source size (the model's own resize: the
        encoder passes `VLMAdapter.frame_resizer`). Images are returned as decoded.

        Raises MediaError/MediaLimitError here for bad input or limits. Pass `sha256` (hex digest
        of `data`) when you already have it, to skip hashing. When `cancel` is set (from any
        thread), the demux pass stops within a few hundred packets or 32 KiB of the file, the
        workers at their next frame or read, and a consumer waiting for a group gets
        DecodeCancelled within 50 ms. `cache_salt`: the request's tenant; only its own cached
        keyframe indexes are reused (`KeyframeIndexCache`).
        """
        if self._closed:
            raise RuntimeError("ParallelDecoder is closed")
        started = time.monotonic()
        check_size(len(data), limits)
        opts.validate(limits.max_frames)
        if sniff_container(data).is_image:  # refuses what is neither an allowed video nor image
            image = decode_image(data, opts, limits)
            return FrameGroupStream(
                self,
                None,
                group_size,
                image.timestamps_s,
                image.sampled_fps,
                image.duration_s,
                image.source_fps,
                image=image,
                started=started,
            )
        index = self.index_cache.get_or_build(data, limits, sha256, cancel, cache_salt)
        plan = make_plan(index, opts, self.config.num_workers, self.config.seek_cost_frames)
        # The clip's frame count is the plan's (slots, repeats included), as the encoder's `preprocess` gets it.
        frame_resize = frame_resizer(len(plan.slot_pts)) if frame_resizer is not None else None
        req = _Request(
            data, index, plan, opts, self.config.seek_cost_frames, limits, cancel, started, frame_resize
        )
        pts_s = index.frames.pts_s
        first_pts = float(pts_s[0])
        positions = np.searchsorted(index.frame_pts, plan.slot_pts)
        timestamps = [float(pts_s[p] - first_pts) for p in positions.tolist()]
        stream = FrameGroupStream(
            self,
            req,
            group_size,
            timestamps,
            plan.sampled_fps,
            index.duration_s,
            index.source_fps,
            started=started,
            merge_up_to=merge_up_to,
            merge_up_to_pixels=merge_up_to_pixels,
        )
        for number, share in enumerate(plan.shares):
            if share:
                req.tasks.append(_Task(req, number, last_progress=started))
        for task in req.tasks:
            self._tasks.put(task)
        return stream

    def close(self, wait_s: float | None = None) -> None:
        """Stop the pool: running shares finish their current frame, threads exit. Every worker is
        told to stop first, then all are waited for together, for at most `wait_s` in all
        (default `CLOSE_WAIT_S`): a pool of N stuck workers costs one wait, not N. Idempotent."""
        self._join(self._stop(), time.monotonic() + (CLOSE_WAIT_S if wait_s is None else wait_s))

    def _stop(self) -> list[_Worker]:
        """Retire every worker and wake the idle ones; the workers to wait for (none if already closed)."""
        with self._lock:
            if self._closed:
                return []
            self._closed = True
            workers = list(self._workers)
        with _open_pools_lock:
            _open_pools.discard(self)
        for worker in workers:
            worker.retired.set()
            self._tasks.put(None)
        return workers

    @staticmethod
    def _join(workers: list[_Worker], deadline_s: float) -> None:
        """Wait until `deadline_s` (time.monotonic()) for `workers` to end. A thread cannot be
        killed from Python: one still inside FFmpeg or a resize then is left to end at its next
        frame (or with the process)."""
        me = threading.current_thread()
        for worker in workers:
            if worker is not me:
                worker.join(timeout=max(0.0, deadline_s - time.monotonic()))
        if running := [w.name for w in workers if w.is_alive() and w is not me]:
            log.warning("video decode threads %s still run after close", ", ".join(running))

    def __enter__(self) -> ParallelDecoder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def num_live_workers(self) -> int:
        with self._lock:
            return sum(1 for w in self._workers if not w.retired.is_set())

    # -- pool upkeep ------------------------------------------------------------------------
    def _start_worker(self) -> None:
        worker = _Worker(self, self._num_started)
        self._num_started += 1
        worker.start()
        self._workers.add(worker)

    def _replace(self, worker: _Worker) -> None:
        """Retire a stuck worker (it exits at its next frame) and start a fresh one."""
        with self._lock:
            if worker.retired.is_set() or self._closed:
                return
            worker.retired.set()
            self.num_replaced_workers += 1
            self._start_worker()

    def _worker_exited(self, worker: _Worker) -> None:
        with self._lock:
            self._workers.discard(worker)
            if not worker.retired.is_set() and not self._closed:
                # It died without being retired (a crash): keep the pool at full size.
                self.num_replaced_workers += 1
                self._start_worker()


_open_pools: set[ParallelDecoder] = set()
"""Pools not closed yet, which `_close_at_exit` closes (each one's threads hold it alive anyway)."""
_open_pools_lock = threading.Lock()


@atexit.register
def _close_at_exit() -> None:
    """Close the pools nobody closed (a script's, an embedded pipeline's never closed; the encoder
    service closes its own after its drain) before the interpreter finalizes; their running shares
    stop at their next frame (see the module docstring)."""
    with _open_pools_lock:
        pools = list(_open_pools)
    stopped = [pool._stop() for pool in pools]  # every pool's workers told first, then one wait for all
    deadline_s = time.monotonic() + CLOSE_WAIT_S
    for workers in stopped:
        ParallelDecoder._join(workers, deadline_s)
