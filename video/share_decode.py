"""One worker's decode of its share of a request (`decode_share`): one container for all the
share's intervals, a seek to each interval's keyframe or a decode forward through a short gap,
non-reference frames that are not targets skipped (H.264/HEVC), each target written into the
request's output. `bench/process_decoder.py` runs these pieces (`seek_to_keyframe`, `decode_frames`) in
processes instead. A request's life: `epd.video.parallel_decoder`."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator

import numpy as np

from epd.video.budget import DecodeBudget
from epd.video.decode_request import ShareStopped, ShareTask
from epd.video.keyframe_index import VideoIndex
from epd.video.media_open import ReadGuard, open_video
from epd.video.simple_decoder import CORRUPT_MEDIA_MESSAGE, frame_to_rgb, in_presentation_order
from epd.video.types import MediaError

# Codecs whose FFmpeg decoders honour skip_frame=NONREF exactly (drop only frames no other frame
# references). Others (VP9, AV1, MPEG-4 Part 2, MJPEG) decode every frame.
NONREF_SKIP_CODECS = frozenset({"h264", "hevc"})


def decode_share(task: ShareTask, retired: threading.Event, skip_nonref: bool) -> None:
    """Decode the intervals of one share in order with one container; write targets to the output."""
    req = task.request
    budget = req.budget

    def check_read() -> None:  # also between the packets of other streams (`ReadGuard`)
        budget.check_time()
        if req.stopped() or retired.is_set():
            raise ShareStopped

    guard = ReadGuard(check_read)
    try:
        _decode_intervals(task, guard, retired, skip_nonref)
    except Exception:
        guard.raise_if_stopped()  # a limit or a cancel cut the file short: that is the reason
        raise
    finally:
        guard.release()


def _decode_intervals(task: ShareTask, guard: ReadGuard, retired: threading.Event, skip_nonref: bool) -> None:
    """The body of `decode_share`: one container, opened through `guard`."""
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
        if skip_nonref and order_pts is None and stream.codec_context.name in NONREF_SKIP_CODECS:
            # Every target of the request, not only the current interval's: the decoder's reorder
            # delay means packets of the next interval are sent before this one's last frame is out.
            keep = req.target_pts
        frames: Iterator | None = None  # the live decode iterator
        last_pts = int(frame_pts[0]) - 1  # pts of the last frame taken from it
        while (position := req.take(task.share)) is not None:
            if req.stopped() or retired.is_set():
                raise ShareStopped
            interval = req.plan.intervals[position]
            wanted = set(interval.target_pts)
            first_target = interval.target_pts[0]
            if frames is None:
                if interval.keyframe_pts <= frame_pts[0]:
                    frames = decode_frames(container, stream, keep, budget, order_pts)
                else:
                    frames = seek_to_keyframe(
                        container, stream, index, interval.keyframe_pts, first_target, keep, budget
                    )
            else:
                ahead = int(
                    np.searchsorted(frame_pts, interval.keyframe_pts)
                    - np.searchsorted(frame_pts, last_pts, "right")
                )
                if last_pts >= first_target or ahead > req.seek_cost_frames:
                    frames = seek_to_keyframe(
                        container, stream, index, interval.keyframe_pts, first_target, keep, budget
                    )
            for frame in frames:
                if req.stopped() or retired.is_set():
                    raise ShareStopped
                task.last_progress = time.monotonic()
                task.num_decoded_frames += 1
                last_pts = frame.pts
                if frame.pts in wanted:
                    req.put_frame(frame.pts, frame_to_rgb(frame, req.opts.max_pixels))  # [H, W, 3]
                    wanted.discard(frame.pts)
                    if not wanted:
                        break
            if wanted:  # the stream ended before a target: truncated or corrupt
                raise MediaError(CORRUPT_MEDIA_MESSAGE)
            req.finish_interval(position)


def decode_frames(
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


def seek_to_keyframe(
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
        frames = decode_frames(container, stream, keep, budget)  # never with decode-order pts: no seek
        first = next(frames, None)
        if first is not None and first.pts <= first_target:
            return itertools.chain([first], frames)
        if k < 0:  # landed after the target even from the start: the stream cannot be read
            raise MediaError(CORRUPT_MEDIA_MESSAGE)
        tried += 1
        # Back off: one keyframe earlier, then jump to the start.
        k = k - 1 if tried < 3 else -1
