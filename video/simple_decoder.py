"""The reference decoder: one demux pass for timestamps, then one sequential decode.

It is correct by construction and is what every faster backend is checked against. It follows the
frame selection rule in `video.types`. Images (JPEG, PNG, WebP) come back as one frame.
"""

from __future__ import annotations

import io
import logging
import math
import threading
import time
from dataclasses import dataclass

import numpy as np

from video.types import DecodedVideo, DecodeLimits, MediaError, MediaLimitError, SamplingOptions

log = logging.getLogger(__name__)

_IMAGE_MAGIC = (b"\xff\xd8\xff", b"\x89PNG\r\n\x1a\n")
_CORRUPT = (
    "could not decode the media: the file is corrupt, truncated, or not a supported container "
    "or codec (send MP4, MKV, WebM, MOV or AVI video, or a JPEG, PNG or WebP image)"
)


def is_image(data: bytes) -> bool:
    return data.startswith(_IMAGE_MAGIC) or (data[:4] == b"RIFF" and data[8:12] == b"WEBP")


@dataclass(frozen=True)
class FrameIndex:
    """Presentation timestamps of every frame, from a demux pass (no decoding)."""

    pts_s: np.ndarray  # [N] float64, sorted
    keyframe_pts_s: np.ndarray  # [K] float64, sorted
    source_fps: float

    @property
    def duration_s(self) -> float:
        if len(self.pts_s) == 0:
            return 0.0
        return float(self.pts_s[-1] - self.pts_s[0]) + 1.0 / max(self.source_fps, 1e-6)


def build_frame_index(container) -> FrameIndex:
    """Demux every packet of the first video stream and record its presentation time."""
    stream = container.streams.video[0]
    tb = float(stream.time_base)
    pts, key = [], []
    for packet in container.demux(stream):
        if packet.pts is None or packet.size == 0:
            continue
        t = packet.pts * tb
        pts.append(t)
        if packet.is_keyframe:
            key.append(t)
    if not pts:
        raise MediaError(_CORRUPT)
    pts_arr = np.sort(np.asarray(pts, dtype=np.float64))
    rate = float(stream.average_rate) if stream.average_rate else 0.0
    if rate <= 0 and len(pts_arr) > 1:
        rate = (len(pts_arr) - 1) / max(pts_arr[-1] - pts_arr[0], 1e-6)
    return FrameIndex(pts_arr, np.sort(np.asarray(key, dtype=np.float64)), rate or 1.0)


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
    rgb = _reformatter().reformat(frame, width=w, height=h, format="rgb24").to_ndarray()
    rotation = int(round(frame.rotation)) % 360 if frame.rotation else 0
    if rotation in (90, 180, 270):
        rgb = np.ascontiguousarray(np.rot90(rgb, k=rotation // 90))
    return rgb


def check_size(num_bytes: int, limits: DecodeLimits) -> None:
    if num_bytes == 0:
        raise MediaError("the media is empty (0 bytes); send a video or image file")
    if num_bytes > limits.max_bytes:
        raise MediaLimitError(
            f"the media is {num_bytes} bytes but this server accepts at most {limits.max_bytes}; "
            "send a shorter or more compressed file"
        )


def decode_image(data: bytes, opts: SamplingOptions, limits: DecodeLimits) -> DecodedVideo:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as img:
            if img.width * img.height > limits.max_source_pixels:
                raise MediaLimitError(
                    f"the image is {img.width}x{img.height}, over this server's limit of "
                    f"{limits.max_source_pixels} pixels; send a smaller image"
                )
            w, h = scaled_size(img.width, img.height, opts.max_pixels)
            rgb = img.convert("RGB")
            if (w, h) != rgb.size:
                rgb = rgb.resize((w, h), Image.Resampling.BICUBIC)
            frame = np.asarray(rgb, dtype=np.uint8)[None]
    except MediaError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
        log.info("image decode failed: %r", exc)  # detail stays in the server log
        raise MediaError(_CORRUPT) from None
    return DecodedVideo(frame, [0.0], sampled_fps=1.0, duration_s=0.0, source_fps=0.0, is_image=True)


def decode(data: bytes, opts: SamplingOptions, limits: DecodeLimits = DecodeLimits()) -> DecodedVideo:
    """Decode `data` (a whole file in memory) into sampled RGB frames."""
    import av

    check_size(len(data), limits)
    opts.validate(limits.max_frames)
    if is_image(data):
        return decode_image(data, opts, limits)
    started = time.perf_counter()
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.video:
                raise MediaError("the file has no video stream; send a video or an image")
            stream = container.streams.video[0]
            _check_stream(stream, limits)
            index = build_frame_index(container)
            if index.duration_s > limits.max_duration_s:
                raise MediaLimitError(
                    f"the video lasts {index.duration_s:.0f} s, over this server's limit of "
                    f"{limits.max_duration_s:.0f} s; trim it or send a clip with start/end times"
                )
            chosen, sampled_fps = select_frames(index, opts)
            frames = _decode_chosen(container, chosen, opts)
    except MediaError:
        raise
    except (av.FFmpegError, ValueError, IndexError, EOFError, OSError) as exc:
        log.info("video decode failed: %r", exc)  # never forwarded to the client
        raise MediaError(_CORRUPT) from None
    return DecodedVideo(
        frames=frames,
        timestamps_s=[float(t - index.pts_s[0]) for t in chosen],
        sampled_fps=sampled_fps,
        duration_s=index.duration_s,
        source_fps=index.source_fps,
        stats={"decode_ms": (time.perf_counter() - started) * 1e3},
    )


def _check_stream(stream, limits: DecodeLimits) -> None:
    w, h = stream.codec_context.width, stream.codec_context.height
    if w * h > limits.max_source_pixels:
        raise MediaLimitError(
            f"the video is {w}x{h}, over this server's limit of {limits.max_source_pixels} "
            "pixels per frame; downscale it before sending"
        )


def _decode_chosen(container, chosen_pts: np.ndarray, opts: SamplingOptions) -> np.ndarray:
    """Decode every frame in order and keep those whose pts was chosen (repeats kept in order)."""
    wanted = {float(t) for t in chosen_pts}
    stream = container.streams.video[0]
    stream.thread_type = "AUTO"
    container.seek(0, stream=stream)
    tb = float(stream.time_base)
    kept: dict[float, np.ndarray] = {}
    last_needed = float(chosen_pts.max())
    for frame in container.decode(stream):
        if frame.pts is None:
            continue
        t = frame.pts * tb
        if t in wanted and t not in kept:
            kept[t] = frame_to_rgb(frame, opts.max_pixels)
        if t >= last_needed and len(kept) == len(wanted):
            break
    if len(kept) != len(wanted):
        raise MediaError(_CORRUPT)
    return np.stack([kept[float(t)] for t in chosen_pts])
