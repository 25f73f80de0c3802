"""What every video decoder takes and returns, and the errors it may raise.

Every backend (the simple sequential decoder, the parallel keyframe-aligned one, decord) follows
the same frame selection rule, so they return identical frames for the same request:

    The clip [start_time_s, end_time_s) is cut into `n` equal slots; the target timestamp of slot
    i is its midpoint, start + (i + 0.5) * span / n. The frame chosen for a target is the one whose
    presentation timestamp is nearest at or before the target (the first frame if none is).

`n` is `num_frames` when given, else round(span * fps) clamped to [min_frames, max_frames] and
to the number of frames the clip holds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the `epd` command line reads SamplingOptions and DecodeLimits without numpy
    import numpy as np

FrameResize = Callable[["np.ndarray"], "np.ndarray"]
"""One decoded RGB frame [H, W, 3] uint8 -> the frame the caller keeps [h, w, 3] uint8. Must give
every frame of a request the same size when given frames of one size."""

FrameResizer = Callable[[int], "FrameResize | None"]
"""The number of frames of a request's clip -> the `FrameResize` for each of them, or None to keep
them as decoded (`VLMAdapter.frame_resizer`: Qwen3-VL sizes frames by the whole clip's t x h x w)."""


class MediaError(ValueError):
    """The media cannot be used as sent (corrupt, truncated, unsupported). Maps to INVALID_ARGUMENT.

    The message is written for the client: it never contains decoder text, paths or addresses.
    """


class MediaLimitError(MediaError):
    """The media is valid but exceeds a configured limit. Maps to RESOURCE_EXHAUSTED."""


class DecoderCrashed(Exception):
    """The decoder's process died while it worked on the request (a crash inside the decoder, the
    OOM killer) and has been restarted. The encoder decodes such a request with the PyAV backend
    instead; what reaches a client (the encoder closing under it) maps to UNAVAILABLE (retry)."""


class DecodeCancelled(Exception):
    """The caller set its cancel flag (its client went away): the decode stopped early. Not a
    MediaError: nothing is wrong with the media."""


ONE_FRAME_CHOICE = (
    "send num_frames (exactly that many frames) or fps (frames per second, at most max_frames), not both"
)
"""A request that names both is refused at the front doors: vLLM's loaders take the smaller
count and transformers' video processors refuse the pair, so neither reading is what every
client expects."""


@dataclass(frozen=True)
class SamplingOptions:
    """How frames are chosen from a video and how large they may be."""

    fps: float = 2.0
    """Frames sampled per second of video, when `num_frames` is not given."""
    max_frames: int = 32
    """Upper bound on sampled frames."""
    min_frames: int = 2
    """Lower bound on sampled frames (a short clip still yields this many, repeated if needed)."""
    num_frames: int | None = None
    """Exactly this many frames, spread uniformly; overrides `fps`."""
    start_time_s: float = 0.0
    """Start of the clip to sample, in seconds from the first frame."""
    end_time_s: float | None = None
    """End of the clip to sample (exclusive); None means the end of the video."""
    max_pixels: int | None = None
    """Frames larger than this (H*W) are downscaled, keeping aspect; None keeps decoded size."""

    def validate(self, max_frames_limit: int) -> None:
        """Raise MediaError/MediaLimitError naming the option to change."""
        if self.num_frames is not None and self.num_frames < 1:
            raise MediaError(f"num_frames must be >= 1, got {self.num_frames}")
        if self.fps <= 0:
            raise MediaError(f"fps must be > 0, got {self.fps}")
        if self.min_frames < 1 or self.max_frames < 1:
            raise MediaError("min_frames and max_frames must be >= 1")
        if self.min_frames > self.max_frames:
            raise MediaError(
                f"min_frames ({self.min_frames}) is larger than max_frames ({self.max_frames}); "
                "lower min_frames or raise max_frames"
            )
        wanted = self.num_frames if self.num_frames is not None else self.max_frames
        if wanted > max_frames_limit:
            raise MediaLimitError(
                f"{wanted} frames requested but this server allows at most {max_frames_limit}; "
                f"set max_frames (or num_frames) to {max_frames_limit} or fewer"
            )
        if self.start_time_s < 0 or (self.end_time_s is not None and self.end_time_s <= self.start_time_s):
            raise MediaError(
                f"clip [{self.start_time_s}, {self.end_time_s}) is empty or negative; "
                "use 0 <= start_time_s < end_time_s"
            )


@dataclass(frozen=True)
class DecodeLimits:
    """Operator-set caps that every decode path enforces before and while decoding.

    The header-level ones (bytes, duration, frame size) are checked before any frame is decoded;
    the work budgets (`max_source_pixels` again, on every decoded frame; `max_decoded_pixels`;
    `max_demux_s`; `max_decode_s`) are charged while the decoder runs, since a header says nothing binding about
    the frames that follow it. Each message that refuses a request names its flag.
    """

    max_bytes: int = 256 * 1024 * 1024
    """Largest upload, in bytes (--max-upload-bytes)."""
    max_duration_s: float = 3600.0
    """Longest video, in seconds of presentation time (first to last frame)."""
    max_source_pixels: int = 3840 * 2160
    """Largest decoded frame, width x height before any downscaling (--max-source-pixels).
    Checked on the stream header and on every decoded frame (a stream may change resolution
    mid-file); FFmpeg's own `max_pixels` guard (twice this, to allow for its row alignment)
    refuses larger frames before allocating them."""
    max_frames: int = 256
    """Most sampled frames one request may ask for."""
    max_decoded_pixels: int = 1 << 36
    """Pixels (width x height, summed over every frame the decoder outputs for one request:
    targets and the frames decoded on the way to them; a frame counts at least 256x256) after
    which the request fails (--max-decoded-pixels). 2^36 is about 68.7 G: 33,000 1080p frames,
    a sequential decode of 18 min of 1080p at 30 fps, or 1 M frames of any small size; a 300 s
    1080p video sampled to 64 frames takes at most 18.7 G (9,000 frames, decoded sequentially)."""
    max_demux_s: float = 10.0
    """Wall time the demux (index) pass may take, in seconds (--max-demux-s). A legitimate
    one-hour file demuxes in about a second; a file of millions of tiny packets would not."""
    max_decode_s: float = 120.0
    """Wall time one request's video decoding may take, in seconds (--max-decode-s): from the
    start of its decode (its demux pass included) to its last frame converted, over all its
    decode workers at once (elapsed time, not their sum). What bounds a decode the pixel budget
    allows but the machine makes slow (many requests at once, a slow codec, a frame that takes
    FFmpeg long)."""

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_duration_s", "max_source_pixels", "max_frames",
                     "max_decoded_pixels", "max_demux_s", "max_decode_s"):  # fmt: skip
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


@dataclass
class DecodedVideo:
    """Sampled frames of one video (or one image, as a single frame)."""

    frames: np.ndarray
    """[T, H, W, 3] uint8 RGB."""
    timestamps_s: list[float]
    """Presentation time of each returned frame."""
    sampled_fps: float
    """Frames per second of the sample (T / span); drives Qwen's temporal positions."""
    duration_s: float
    source_fps: float
    is_image: bool = False
    stats: dict[str, float] = field(default_factory=dict)
    """Decoder accounting, e.g. {"decode_ms": ..., "num_decoded_frames": ...}."""

    @property
    def num_frames(self) -> int:
        return int(self.frames.shape[0])
