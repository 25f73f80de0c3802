"""Work budgets of one decode request, charged while the decoder runs (not from headers).

A header says little that binds the frames after it: an H.264 stream may switch to 8192x8192
in-band, a 7 KB file may hold one 1080p frame or a million 16x16 ones. So:
  - `DecodeBudget.charge(frame)` is called on every frame a decoder outputs, target or not, before
    it is converted: the frame must be within `max_source_pixels`, and the request's running total
    of decoded pixels (each frame counted as at least MIN_PIXELS_PER_FRAME) within
    `max_decoded_pixels`. `check_decoder_size` turns an FFmpeg error
    raised because a frame was over FFmpeg's own `max_pixels` guard (epd.video.media_open) into the
    same MediaLimitError.
  - `DemuxDeadline` bounds the demux (index) pass in wall time: `max_demux_s`; `DecodeBudget`
    bounds the request's whole decode in wall time too: `max_decode_s`, from the start of that
    request's decode (before its demux pass; `started_s`) to its last frame converted, over all
    its decode workers. It is checked at every decoded frame (`charge`), and by whoever waits for
    the frames (`check_time`; the parallel decoder's consumer, the decord backend's parent), so a
    worker stuck inside one frame does not hold the request past it either.
Every message names the limit and the encoder flag that tunes it. A caller's cancel flag, given to
either, is looked at wherever the time is: DecodeCancelled once it is set.
"""

from __future__ import annotations

import threading
import time

from epd.video.types import DecodeCancelled, DecodeLimits, MediaLimitError

MIN_PIXELS_PER_FRAME = 1 << 16
"""Each decoded frame is charged at least this many pixels (256x256): a frame has a fixed cost
however small it is (25-80 us for a 16x16 H.264 frame here, what ~10-30 K pixels of a large
frame cost), so a million tiny frames cannot hide under the pixel budget."""


def frame_too_large(
    width: int, height: int, limits: DecodeLimits, what: str = "the video"
) -> MediaLimitError:
    return MediaLimitError(
        f"{what} is {width}x{height}, over this server's limit of {limits.max_source_pixels} "
        "pixels per frame (encoder flag --max-source-pixels); downscale it before sending"
    )


def check_frame_size(width: int, height: int, limits: DecodeLimits, what: str = "the video") -> None:
    if width * height > limits.max_source_pixels:
        raise frame_too_large(width, height, limits, what)


def decode_too_long(limits: DecodeLimits) -> MediaLimitError:
    return MediaLimitError(
        f"decoding this video took longer than this server's limit of {limits.max_decode_s:g} s "
        "(encoder flag --max-decode-s); send a shorter clip, a lower resolution, or ask for fewer frames"
    )


class DecodeBudget:
    """Decoded frames and pixels of one request. Thread-safe: the parallel decoder's workers all
    charge the budget of the request they work on."""

    def __init__(
        self, limits: DecodeLimits, started_s: float | None = None, cancel: threading.Event | None = None
    ) -> None:
        """`started_s`: time.monotonic() when the request's decode began (default: now).
        `cancel`: the caller's flag (its client went away), looked at with the time."""
        self.limits = limits
        self.cancel = cancel
        self.deadline_s = (time.monotonic() if started_s is None else started_s) + limits.max_decode_s
        """time.monotonic() past which the request fails (`max_decode_s` after it started)."""
        self.num_decoded_frames = 0
        self.num_decoded_pixels = 0
        """Pixels charged so far: width x height of each frame, at least MIN_PIXELS_PER_FRAME."""
        self._lock = threading.Lock()

    def charge(self, frame) -> None:
        """Account one decoded frame (a PyAV VideoFrame); MediaLimitError when it is over the
        per-frame limit or takes the request over its decoded-pixel budget."""
        width, height = frame.width, frame.height
        check_frame_size(width, height, self.limits, "a frame of the video")
        with self._lock:
            self.num_decoded_frames += 1
            self.num_decoded_pixels += max(width * height, MIN_PIXELS_PER_FRAME)
            total = self.num_decoded_pixels
        if total > self.limits.max_decoded_pixels:
            raise MediaLimitError(
                f"decoding this request took more than this server's limit of "
                f"{self.limits.max_decoded_pixels} decoded pixels (every frame decoded, targets and "
                "the frames on the way to them; encoder flag --max-decoded-pixels); send a shorter "
                "clip, a lower resolution, or ask for fewer frames"
            )
        self.check_time()

    def check_time(self) -> None:
        """MediaLimitError when the request's decode has run past `max_decode_s`;
        DecodeCancelled once the caller's cancel flag is set."""
        if self.cancel is not None and self.cancel.is_set():
            raise DecodeCancelled(f"cancelled after {self.num_decoded_frames} decoded frames")
        if time.monotonic() > self.deadline_s:
            raise decode_too_long(self.limits)

    def remaining_s(self) -> float:
        """Seconds left before `max_decode_s` is reached (0 when past it)."""
        return max(self.deadline_s - time.monotonic(), 0.0)

    def check_decoder_size(self, codec_context) -> None:
        """After an FFmpeg decode error: raise the size MediaLimitError if the decoder had
        switched to a frame size over the limit (FFmpeg's `max_pixels` guard refused it; the
        context holds the new size), else return so that the caller reports a corrupt file."""
        check_frame_size(codec_context.width, codec_context.height, self.limits, "a frame of the video")


class DemuxDeadline:
    """Wall-time bound of one demux pass; `check()` every few hundred packets and before every
    read of the file (`epd.video.media_open.ReadGuard`); DecodeCancelled once `cancel` is set."""

    def __init__(self, limits: DecodeLimits, cancel: threading.Event | None = None) -> None:
        self.limits = limits
        self.cancel = cancel
        self._deadline = time.monotonic() + limits.max_demux_s

    def check(self) -> None:
        if self.cancel is not None and self.cancel.is_set():
            raise DecodeCancelled("cancelled during the demux pass")
        if time.monotonic() > self._deadline:
            raise MediaLimitError(
                f"reading the video's packets took longer than this server's limit of "
                f"{self.limits.max_demux_s:g} s (encoder flag --max-demux-s); the file holds too many "
                "packets: send a shorter clip or re-encode it"
            )
