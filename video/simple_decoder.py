"""The reference decoder: one demux pass for timestamps, then one sequential decode.

It is correct by construction and is what every faster backend is checked against. It follows the
frame selection rule in `epd.video.types`. Images (JPEG, PNG, WebP) come back as one frame.

Media is opened only through `epd.video.media_open` (a sniffed, allow-listed container, no nested
I/O) and every decoded frame is charged to the request's `epd.video.budget.DecodeBudget`. A frame
picked for several slots (more slots than the clip has frames) is decoded and converted once;
only the returned [T, H, W, 3] array repeats it.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from array import array
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from epd.video.budget import DecodeBudget, DemuxDeadline, check_frame_size
from epd.video.media_open import SEND_SUPPORTED, ReadGuard, open_image, open_video, sniff_container
from epd.video.types import DecodedVideo, DecodeLimits, MediaError, MediaLimitError, SamplingOptions

log = logging.getLogger(__name__)

CORRUPT_MEDIA_MESSAGE = (
    "could not decode the media: the file is corrupt, truncated, or not a supported container "
    f"or codec ({SEND_SUPPORTED})"
)
_OUT_OF_MEMORY = (
    "the server ran out of memory decoding this video; ask for fewer or smaller frames (num_frames or "
    "max_frames, max_pixels), or retry later"
)


def decode_failure(exc: BaseException) -> MediaError:
    """What the client is told when FFmpeg or the decode loop fails on its file (the decoder's own
    text stays in the server's log): out of memory (FFmpeg's ENOMEM, or numpy's) is the server's
    limit, RESOURCE_EXHAUSTED; anything else is the file's fault."""
    if isinstance(exc, MemoryError):  # av.error.MemoryError is one too
        return MediaLimitError(_OUT_OF_MEMORY)
    return MediaError(CORRUPT_MEDIA_MESSAGE)


_DEMUX_CHECK_PACKETS = 256
"""The demux pass looks at the clock (and its stop callback) once per this many packets."""


@dataclass(frozen=True)
class FrameIndex:
    """Presentation timestamps of every frame, from a demux pass (no decoding)."""

    pts_s: np.ndarray  # [N] float64, sorted
    keyframe_pts_s: np.ndarray  # [K] float64, sorted
    source_fps: float
    pts_in_decode_order: bool = False
    """The packets' pts follow decode order though the codec reorders frames (H.264 with B-frames
    in AVI): decoded frames must be matched by output order (`in_presentation_order`)."""

    @property
    def duration_s(self) -> float:
        if len(self.pts_s) == 0:
            return 0.0
        return float(self.pts_s[-1] - self.pts_s[0]) + 1.0 / max(self.source_fps, 1e-6)


class DemuxedPts(NamedTuple):
    frame_pts: np.ndarray
    """[N] int64 sorted pts of every frame the decoder outputs."""
    keyframe_pts: np.ndarray
    """[K] int64 sorted pts of the keyframes among them."""
    in_decode_order: bool
    """The codec reorders frames (it has B-frames) but the packets' pts never go back: they are
    decode order (AVI has no presentation timestamps; FFmpeg numbers its packets in file order)."""


def demux_pts(container, stream, stop: Callable[[], bool] | None = None) -> DemuxedPts:
    """One pass over the packets of `stream`, decoding none: the pts of every frame the decoder
    outputs and of the keyframes among them. `stop` is called before the first packet
    and every 256 after it: when it returns True the pass ends with DemuxStopped; it may also raise
    (a DemuxDeadline).

    Two kinds of packet carry frames that no decoder outputs, and are left out:
      - packets flagged discard: an MP4 edit list starts presentation after them (what
        `ffmpeg -ss T -c copy` writes: the GOP from the keyframe before T, presented from T);
        the decoder decodes them as references but drops their frames.
      - frames presented before the first keyframe: a stream cut mid-GOP starts with frames whose
        references were cut away; decoders drop or garble them. Without any keyframe flag (some
        containers set none) every frame is kept: the start is the only place to begin.
    """
    pts, key = array("q"), array("q")
    num_backward = 0  # packets whose pts is below the one before: the container has real pts
    first_keyframe_pts: int | None = None  # of any packet, discard ones too (an edit list's keyframe)
    for num_packets, packet in enumerate(container.demux(stream)):
        if stop is not None and num_packets % _DEMUX_CHECK_PACKETS == 0 and stop():
            raise DemuxStopped
        p = packet.pts
        if p is None or packet.size == 0:
            continue
        if packet.is_keyframe and first_keyframe_pts is None:
            first_keyframe_pts = p
        if packet.is_discard:
            continue
        if pts and p < pts[-1]:
            num_backward += 1
        pts.append(p)
        if packet.is_keyframe:
            key.append(p)
    frame_pts = np.sort(np.frombuffer(pts, np.int64))
    if first_keyframe_pts is not None:
        frame_pts = frame_pts[frame_pts >= first_keyframe_pts]
    in_decode_order = bool(stream.codec_context.has_b_frames) and num_backward == 0
    return DemuxedPts(frame_pts, np.sort(np.frombuffer(key, np.int64)), in_decode_order)


def in_presentation_order(frames: Iterable, frame_pts: np.ndarray) -> Iterator:
    """Decoded frames from one (re)start of the decoder, each with `frame.pts` set to its
    presentation pts, for a stream whose packets carry decode-order pts (`DemuxedPts.in_decode_order`).

    The decoder gives each frame the pts of the packet that carried it, which there is the frame's
    place in decode order. But frames come out in presentation order, and `frame_pts` ([N] sorted)
    lists the presentation times in that order: the first frame out of the start of the stream is
    its first keyframe, first in decode and in presentation order, so its pts is right; each later
    frame takes the next pts of the index. Every frame must come out (no skip_frame), and only
    from the start: after a seek into an open GOP the decoder drops the B-frames shown before the
    keyframe, so a count from there is off (the keyframe index gives such streams no seek point).
    """
    position: int | None = None
    for frame in frames:
        if position is None:
            if frame.pts is None:
                yield frame
                continue
            position = int(np.searchsorted(frame_pts, frame.pts))
        else:
            position += 1
        if position < len(frame_pts):  # else a frame the index has not got: no target
            frame.pts = int(frame_pts[position])
            yield frame


class DemuxStopped(Exception):
    """The demux pass's `stop` callback asked it to end (the caller no longer needs the index)."""


def build_frame_index(
    container, limits: DecodeLimits = DecodeLimits(), cancel: threading.Event | None = None
) -> FrameIndex:
    """Demux every packet of the first video stream and record its presentation time, within
    `limits.max_demux_s` (DecodeCancelled once `cancel` is set)."""
    stream = container.streams.video[0]
    tb = float(stream.time_base)
    deadline = DemuxDeadline(limits, cancel)

    def past_deadline() -> bool:
        deadline.check()  # raises MediaLimitError
        return False

    frame_pts, keyframe_pts, in_decode_order = demux_pts(container, stream, past_deadline)
    if len(frame_pts) == 0:
        raise MediaError(CORRUPT_MEDIA_MESSAGE)
    # int * float per element: keyframe_index.build_video_index does the same, so floats compare equal.
    pts_arr = np.asarray([p * tb for p in frame_pts.tolist()], dtype=np.float64)
    rate = float(stream.average_rate) if stream.average_rate else 0.0
    if rate <= 0 and len(pts_arr) > 1:
        rate = (len(pts_arr) - 1) / max(pts_arr[-1] - pts_arr[0], 1e-6)
    keyframe_pts_s = np.asarray([p * tb for p in keyframe_pts.tolist()], dtype=np.float64)
    return FrameIndex(pts_arr, keyframe_pts_s, rate or 1.0, in_decode_order)


def select_frames(index: FrameIndex, opts: SamplingOptions) -> tuple[np.ndarray, float]:
    """Apply the frame selection rule. Returns (chosen pts [T] with repeats allowed, sampled fps)."""
    t0 = float(index.pts_s[0])
    start = t0 + opts.start_time_s
    end = t0 + index.duration_s if opts.end_time_s is None else t0 + opts.end_time_s
    end = min(end, t0 + index.duration_s)
    if end <= start:
        raise MediaError(
            f"start_time_s={opts.start_time_s} is past the end of the video "
            f"({index.duration_s:.2f} s); choose an earlier start"
        )
    span = end - start
    in_clip = int(np.count_nonzero((index.pts_s >= start) & (index.pts_s < end))) or 1
    if opts.num_frames is not None:
        n = opts.num_frames
    else:
        n = int(round(span * opts.fps))
        n = max(opts.min_frames, min(opts.max_frames, n, in_clip))
    targets = start + (np.arange(n) + 0.5) * span / n
    # Nearest at or before the target; the first frame when the target precedes every frame.
    idx = np.searchsorted(index.pts_s, targets + 1e-9, side="right") - 1
    idx = np.clip(idx, 0, len(index.pts_s) - 1)
    return index.pts_s[idx], n / span


def scaled_size(width: int, height: int, max_pixels: int | None) -> tuple[int, int]:
    """Largest (w, h) with the same aspect within `max_pixels`, both even (for swscale)."""
    if not max_pixels or width * height <= max_pixels:
        return width, height
    scale = math.sqrt(max_pixels / (width * height))
    return max(2, int(width * scale) // 2 * 2), max(2, int(height * scale) // 2 * 2)


_thread_state = threading.local()

SWSCALE_THREADS = 1
"""swscale's own threads per conversion. Its default (0) starts one per core for every converter,
and each thread that converts keeps one (`_reformatter`): an encoder's decode pool of one worker a
core held cores x cores idle swscale threads besides its workers. Parallelism is across the decode
workers, not inside one (`parallel_decoder`); a frame's conversion is the same either way."""


def _reformatter():
    """This thread's swscale converter. `frame.to_ndarray(format=...)` builds a new swscale
    context for every frame, and setting one up costs ~6 ms (measured on 112x112 to 1080p frames),
    far more than converting a small frame; one reused context per thread (a context is not
    thread-safe) gives the same pixels and is only re-initialised when the sizes or formats change."""
    from av.video.reformatter import VideoReformatter

    reformatter = getattr(_thread_state, "reformatter", None)
    if reformatter is None:
        reformatter = _thread_state.reformatter = VideoReformatter()
    return reformatter


def frame_to_rgb(frame, max_pixels: int | None) -> np.ndarray:
    """One decoded PyAV frame as [H, W, 3] uint8 RGB, downscaled to `max_pixels`, then turned
    upright by its display rotation (counter-clockwise degrees, as PyAV reports it).

    Every PyAV backend converts through here so that they return identical pixels.
    """
    w, h = scaled_size(frame.width, frame.height, max_pixels)
    rgb = (
        _reformatter()
        .reformat(frame, width=w, height=h, format="rgb24", threads=SWSCALE_THREADS)
        .to_ndarray()
    )
    rotation = int(round(frame.rotation)) % 360 if frame.rotation else 0
    if rotation in (90, 180, 270):
        rgb = np.ascontiguousarray(np.rot90(rgb, k=rotation // 90))
    return rgb


def downscale_rgb(rgb: np.ndarray, max_pixels: int | None) -> np.ndarray:
    """An upright RGB frame [H, W, 3] uint8 from another decoder, downscaled to `max_pixels` at the
    size `frame_to_rgb` gives (`scaled_size` is the same for (W, H) and (H, W), so turning the
    frame first does not change it), with the same swscale converter. The pixels differ a little
    from `frame_to_rgb`'s, which scales the YUV frame before turning it upright."""
    import av

    height, width = rgb.shape[:2]
    w, h = scaled_size(width, height, max_pixels)
    if (w, h) == (width, height):
        return rgb
    frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(rgb), format="rgb24")
    return (
        _reformatter()
        .reformat(frame, width=w, height=h, format="rgb24", threads=SWSCALE_THREADS)
        .to_ndarray()
    )


def check_size(num_bytes: int, limits: DecodeLimits) -> None:
    if num_bytes == 0:
        raise MediaError("the media is empty (0 bytes); send a video or image file")
    if num_bytes > limits.max_bytes:
        raise MediaLimitError(
            f"the media is {num_bytes} bytes but this server accepts at most {limits.max_bytes}; "
            "send a shorter or more compressed file"
        )


def decode_image(data: bytes, opts: SamplingOptions, limits: DecodeLimits) -> DecodedVideo:
    from PIL import Image

    try:
        with open_image(data, limits) as img:  # only its sniffed format, size checked
            rgb = _upright_rgb(img)
            w, h = scaled_size(rgb.width, rgb.height, opts.max_pixels)
            if (w, h) != rgb.size:
                rgb = rgb.resize((w, h), Image.Resampling.BICUBIC)
            frame = np.array(rgb, dtype=np.uint8)[None]  # writable (np.asarray of a PIL image is not)
    except MediaError:
        raise
    except Exception as exc:  # noqa: BLE001 - hostile bytes make Pillow raise struct.error, TypeError, ...
        log.info("image decode failed: %r", exc)  # detail stays in the server log
        raise MediaError(CORRUPT_MEDIA_MESSAGE) from None
    return DecodedVideo(frame, [0.0], sampled_fps=1.0, duration_s=0.0, source_fps=0.0, is_image=True)


_EXIF_ORIENTATION = 0x0112
# EXIF orientation -> the transpose that turns the stored pixels upright (as ImageOps.exif_transpose).
_UPRIGHT_TRANSPOSE = {2: "FLIP_LEFT_RIGHT", 3: "ROTATE_180", 4: "FLIP_TOP_BOTTOM", 5: "TRANSPOSE", 6: "ROTATE_270",
                      7: "TRANSVERSE", 8: "ROTATE_90"}  # fmt: skip
_SIXTEEN_BIT_MODES = frozenset({"I;16", "I;16L", "I;16B", "I;16N", "I"})
"""Pillow's modes of 16-bit greyscale (a 16-bit PNG): `convert("RGB")` clips their values at 255
instead of scaling them, so a mid-grey 32768 became white."""


def _upright_rgb(img):
    """8-bit RGB, turned upright as its EXIF orientation says (as a video's display matrix turns
    its frames: `epd.video.keyframe_index.probe_rotation`); 16-bit greyscale scaled to 8 bits (its top byte, as FFmpeg's
    gray16 -> rgb24 does)."""
    from PIL import Image

    # Not ImageOps.exif_transpose: it also rewrites the EXIF block, and malformed EXIF made that
    # raise struct.error or TypeError (an internal error) on an image whose pixels were fine.
    if (transpose := _UPRIGHT_TRANSPOSE.get(_exif_orientation(img))) is not None:
        img = img.transpose(getattr(Image.Transpose, transpose))
    if img.mode in _SIXTEEN_BIT_MODES:
        top_byte = (np.asarray(img, dtype=np.int64).clip(0, 65535) >> 8).astype(np.uint8)
        return Image.fromarray(top_byte).convert("RGB")
    return img.convert("RGB")


def _exif_orientation(img) -> int:
    """The image's EXIF orientation (1-8); 1 (as stored) when it has none or its EXIF is
    malformed: a bad orientation tag is no reason to refuse the pixels."""
    try:
        return int(img.getexif().get(_EXIF_ORIENTATION, 1))
    except Exception as exc:  # noqa: BLE001 - Pillow's EXIF parser raises many types on hostile bytes
        log.debug("unreadable EXIF orientation, using 1: %r", exc)
        return 1


def decode(
    data: bytes,
    opts: SamplingOptions,
    limits: DecodeLimits = DecodeLimits(),
    cancel: threading.Event | None = None,
) -> DecodedVideo:
    """Decode `data` (a whole file in memory) into sampled RGB frames. `cancel` (set from any
    thread: the caller went away) stops the demux pass and the decoding at their next check of the
    limits, with DecodeCancelled."""
    import av

    check_size(len(data), limits)
    opts.validate(limits.max_frames)
    if sniff_container(data).is_image:  # refuses what is neither an allowed video nor image
        return decode_image(data, opts, limits)
    started = time.perf_counter()
    budget = DecodeBudget(limits, cancel=cancel)
    # Every read of the file checks the cancel flag and the time limit of the phase it is in: av.open
    # and the demux pass --max-demux-s, the decode --max-decode-s (`ReadGuard`).
    guard = ReadGuard(DemuxDeadline(limits, cancel).check)
    try:
        with open_video(data, limits, guard) as container:
            if not container.streams.video:
                raise MediaError("the file has no video stream; send a video or an image")
            stream = container.streams.video[0]
            check_frame_size(stream.codec_context.width, stream.codec_context.height, limits)
            index = build_frame_index(container, limits, cancel)
            guard.raise_if_stopped()  # else the index ends where the guard cut the file short
            check_duration(index.duration_s, limits)
            chosen, sampled_fps = select_frames(index, opts)
            guard.check = budget.check_time
            frames = _decode_chosen(container, index, chosen, opts, budget)
    except (av.FFmpegError, ValueError, IndexError, EOFError, OSError, MemoryError) as exc:  # MediaError too
        guard.raise_if_stopped()  # the file was cut short by a limit: that is the reason
        if isinstance(exc, MediaError):
            raise
        log.info("video decode failed: %r", exc)  # never forwarded to the client
        raise decode_failure(exc) from None
    finally:
        guard.release()
    return DecodedVideo(
        frames=frames,
        timestamps_s=[float(t - index.pts_s[0]) for t in chosen],
        sampled_fps=sampled_fps,
        duration_s=index.duration_s,
        source_fps=index.source_fps,
        stats={
            "decode_ms": (time.perf_counter() - started) * 1e3,
            "num_decoded_frames": float(budget.num_decoded_frames),
            "num_decoded_pixels": float(budget.num_decoded_pixels),
        },
    )


def check_duration(duration_s: float, limits: DecodeLimits) -> None:
    if duration_s > limits.max_duration_s:
        raise MediaLimitError(
            f"the video lasts {duration_s:.0f} s, over this server's limit of "
            f"{limits.max_duration_s:.0f} s (encoder flag --max-duration-s); cut the file shorter (the limit is "
            "on the whole file, whatever part start/end times ask for)"
        )


def gather_slots(unique: np.ndarray, unique_of_slot: np.ndarray) -> np.ndarray:
    """unique[unique_of_slot] ([S, H, W, 3] from [U, H, W, 3]): a view of `unique` when the slots
    are consecutive distinct frames, else a copy of just these S slots. `unique_of_slot` is
    non-decreasing (slots are in time order), so a slot repeats the frame of the one before it
    exactly when the clip has fewer frames than slots there."""
    u = unique_of_slot
    if len(u) == 1 or (len(u) > 1 and bool(np.all(np.diff(u) == 1))):
        return unique[int(u[0]) : int(u[-1]) + 1]
    return unique[u]


def _decode_chosen(
    container, index: FrameIndex, chosen_pts: np.ndarray, opts: SamplingOptions, budget: DecodeBudget
) -> np.ndarray:
    """Decode every frame in order, charging each to `budget`, and keep those whose pts was
    chosen: each distinct one converted once, then repeated per slot. [T, H, W, 3]."""
    import av

    distinct = np.unique(chosen_pts)  # [U] sorted; chosen_pts holds elements of the index
    wanted = set(distinct.tolist())
    stream = container.streams.video[0]
    stream.thread_type = "AUTO"
    container.seek(0, stream=stream)
    tb = float(stream.time_base)
    kept: dict[float, np.ndarray] = {}
    last_needed = float(distinct[-1])
    frames = container.decode(stream)
    if index.pts_in_decode_order:
        # [N] int64 stream pts of the index (index.pts_s are p * tb: rint gives p back).
        frames = in_presentation_order(frames, np.rint(index.pts_s / tb).astype(np.int64))
    try:
        for frame in frames:
            budget.charge(frame)
            if frame.pts is None:
                continue
            t = frame.pts * tb
            if t in wanted and t not in kept:
                kept[t] = frame_to_rgb(frame, opts.max_pixels)
            if t >= last_needed and len(kept) == len(wanted):
                break
    except av.FFmpegError:
        budget.check_decoder_size(stream.codec_context)  # refused by FFmpeg's max_pixels guard?
        raise
    if len(kept) != len(wanted):
        raise MediaError(CORRUPT_MEDIA_MESSAGE)
    unique = np.stack([kept[t] for t in distinct.tolist()])  # [U, H, W, 3]
    return gather_slots(unique, np.searchsorted(distinct, chosen_pts))
