"""A demux-only index of a video: every frame's pts, the keyframes, rate and size.

The parallel decoder plans from this index (which keyframe to seek to for each target), so it is
built once per content hash and cached: a second request for the same bytes skips the demux pass.
The frame timestamps come from the same `build_frame_index` the reference decoder uses, so the
frame selection rule picks the same frames in every backend.

Display rotation is not in the index: PyAV exposes the display matrix only on decoded frames, and
decoding the first frames (a keyframe plus the decoder's reorder delay) made the index pass up to
twice as long as demuxing alone. The decoders turn every frame upright from its own `rotation`;
`probe_rotation` reads it for callers that need it before decoding.

The demux pass is bounded by `DecodeLimits.max_demux_s`, and the cache by bytes as well as
entries: an index costs 16 bytes per frame, and a file of millions of tiny packets is cheap to send.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from epd.video.budget import DecodeBudget, DemuxDeadline, check_frame_size
from epd.video.media_open import ReadGuard, open_video
from epd.video.simple_decoder import (
    CORRUPT_MEDIA_MESSAGE,
    DemuxStopped,
    FrameIndex,
    check_duration,
    check_size,
    decode_failure,
    demux_pts,
)
from epd.video.types import DecodeCancelled, DecodeLimits, MediaError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class VideoIndex:
    """What the planner needs to know about one video, without decoding it."""

    content_sha256: str
    """sha256 hex digest of the file bytes; the cache key."""
    frames: FrameIndex
    """Presentation time of every frame and keyframe in seconds, as the reference decoder sees it."""
    frame_pts: np.ndarray
    """[N] int64 stream pts of every frame, sorted; frame_pts[i] * time_base == frames.pts_s[i]."""
    keyframe_pts: np.ndarray
    """[K] int64 stream pts of the keyframes (seek points), sorted; may be just the first frame."""
    time_base: float
    """Seconds per pts unit."""
    width: int
    height: int
    """Coded size of the frames, before rotation."""
    codec_name: str
    container_format: str

    @property
    def duration_s(self) -> float:
        return self.frames.duration_s

    @property
    def source_fps(self) -> float:
        return self.frames.source_fps

    @property
    def num_frames(self) -> int:
        return int(len(self.frame_pts))

    @property
    def num_keyframes(self) -> int:
        return int(len(self.keyframe_pts))

    @property
    def num_bytes(self) -> int:
        """Memory held by the index's arrays (what the cache budgets), plus a fixed overhead."""
        arrays = (self.frame_pts, self.keyframe_pts, self.frames.pts_s, self.frames.keyframe_pts_s)
        return sum(a.nbytes for a in arrays) + _INDEX_OVERHEAD_BYTES


_INDEX_OVERHEAD_BYTES = 1024
"""Python objects around the arrays of one VideoIndex (dataclasses, strings, array headers)."""


def content_sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def build_video_index(
    data: bytes,
    limits: DecodeLimits = DecodeLimits(),
    sha256: str | None = None,
    stop: Callable[[], bool] | None = None,
) -> VideoIndex:
    """Demux every packet of the first video stream of `data`; raise MediaError if unusable.
    stop: checked every few hundred video packets and before every read of the file (32 KiB,
    whatever streams it holds; `ReadGuard`); when it returns True the pass ends with DemuxStopped.
    The pass, av.open's probe included, ends with MediaLimitError after `limits.max_demux_s`."""
    import av

    check_size(len(data), limits)
    deadline = DemuxDeadline(limits)

    def stop_or_deadline() -> bool:
        deadline.check()  # raises MediaLimitError
        return stop is not None and stop()

    def check_read() -> None:
        if stop_or_deadline():
            raise DemuxStopped

    guard = ReadGuard(check_read)
    try:
        with open_video(data, limits, guard) as container:
            if not container.streams.video:
                raise MediaError("the file has no video stream; send a video or an image")
            stream = container.streams.video[0]
            width, height = stream.codec_context.width, stream.codec_context.height
            check_frame_size(width, height, limits)
            try:
                frame_pts, keyframe_pts, in_decode_order = demux_pts(container, stream, stop_or_deadline)
            except av.error.MemoryError as exc:
                # Reading packets copies the file's own bytes: FFmpeg's ENOMEM here is a packet the
                # file declares larger than it can hold (a 5 KB MP4 whose sample table gives one
                # sample 512 MB), the file's fault, not the server's memory (`decode_failure`).
                guard.raise_if_stopped()
                log.info("video index failed: %r", exc)
                raise MediaError(CORRUPT_MEDIA_MESSAGE) from None
            guard.raise_if_stopped()  # else the pass ended where the guard cut the file short
            tb = float(stream.time_base)  # type: ignore[arg-type]  # set for every demuxed stream
            codec_name = stream.codec_context.name
            container_format = container.format.name
            rate = float(stream.average_rate) if stream.average_rate else 0.0
    except MediaError:
        raise
    except (av.FFmpegError, ValueError, IndexError, EOFError, OSError, MemoryError) as exc:
        guard.raise_if_stopped()  # FFmpeg failed on a file the guard cut short
        log.info("video index failed: %r", exc)  # decoder text stays in the server log
        raise decode_failure(exc) from None
    finally:
        guard.release()
    if len(frame_pts) == 0:
        raise MediaError(CORRUPT_MEDIA_MESSAGE)
    # Same arithmetic as simple_decoder.build_frame_index (int * float), so floats compare equal.
    pts_s = np.asarray([int(p) * tb for p in frame_pts], dtype=np.float64)
    if rate <= 0 and len(pts_s) > 1:
        rate = (len(pts_s) - 1) / max(pts_s[-1] - pts_s[0], 1e-6)
    if len(keyframe_pts) == 0 or keyframe_pts[0] > frame_pts[0]:
        # No index, or leading frames before the first flagged keyframe: the start of the stream
        # is always a valid place to begin decoding.
        keyframe_pts = np.concatenate([frame_pts[:1], keyframe_pts])
    if in_decode_order:
        # Frames are matched by output order (`in_presentation_order`), which only holds from
        # the start: after a seek into an open GOP the decoder drops the leading frames of the
        # keyframe's GOP, and where the count starts cannot be told (an AVI packet's pts is its
        # place in decode order). One seek point, the start: the plan is one sequential decode,
        # the reference decoder's.
        keyframe_pts = frame_pts[:1]
    frames = FrameIndex(pts_s, np.asarray([int(p) * tb for p in keyframe_pts]), rate or 1.0, in_decode_order)
    check_duration(frames.duration_s, limits)
    return VideoIndex(
        content_sha256=sha256 or content_sha256(data),
        frames=frames,
        frame_pts=frame_pts,
        keyframe_pts=keyframe_pts,
        time_base=tb,
        width=width,
        height=height,
        codec_name=codec_name,
        container_format=container_format,
    )


def probe_rotation(data: bytes, limits: DecodeLimits = DecodeLimits()) -> int:
    """Counter-clockwise display rotation (0, 90, 180 or 270) of the first decodable frame of
    `data`'s first video stream (0 when none decodes in its first 64 packets)."""
    import av

    budget = DecodeBudget(limits)
    with open_video(data, limits) as container:
        stream = container.streams.video[0]
        stream.codec_context.thread_count = 1  # frame threading would delay the first frame
        for num_packets, packet in enumerate(container.demux(stream)):
            if num_packets >= 64:
                break
            try:
                for frame in packet.decode():
                    budget.charge(frame)
                    rotation = int(round(frame.rotation)) % 360 if frame.rotation else 0
                    return rotation if rotation in (90, 180, 270) else 0
            except av.FFmpegError as exc:  # a bad first packet: try the next ones
                log.debug("decoding for the rotation failed: %r", exc)
    return 0


class KeyframeIndexCache:
    """LRU of VideoIndex by (cache salt, content hash), bounded in entries and in bytes
    (`VideoIndex.num_bytes`); thread-safe. An index larger than the whole byte budget is used but
    not kept. Two racing builds of one file both run.

    The salt is the request's tenant (`cache_salt`, as in the token cache's key): a hit skips the
    demux pass, which shows in the decode time a client is told, so one tenant's index must not
    serve another's request, or its timing would tell that another tenant sent the same file."""

    def __init__(self, max_entries: int = 256, max_bytes: int = 64 << 20) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[str, str], VideoIndex] = OrderedDict()  # (cache salt, sha256)
        self._lock = threading.Lock()
        self.num_bytes = 0
        """Sum of num_bytes of the cached indexes."""
        self.num_hits = 0
        self.num_misses = 0

    def get_or_build(
        self,
        data: bytes,
        limits: DecodeLimits,
        sha256: str | None = None,
        cancel: threading.Event | None = None,
        cache_salt: str = "",
    ) -> VideoIndex:
        """The index of `data`, from the cache or built now. Without `sha256`, the bytes are
        hashed on a helper thread while this one demuxes (hashlib and FFmpeg's demuxer release
        the GIL): on a miss the hash (~20 ms for 50 MB) costs no wall time, and on a hit the
        demux pass stops as soon as the hash names a cached index. When `cancel` is set during the
        demux pass, the pass stops within a few hundred packets or 32 KiB of the file with
        DecodeCancelled. `cache_salt`: the request's tenant; only its own indexes are found."""
        if sha256 is None:
            return self._build_while_hashing(data, limits, cancel, cache_salt)
        index = self._lookup((cache_salt, sha256))
        if index is not None:
            # Limits may differ between callers; re-check the cheap ones.
            check_size(len(data), limits)
            _check_limits(index, limits)
            return index
        try:
            return self._insert(
                build_video_index(data, limits, sha256, stop=cancel.is_set if cancel else None), cache_salt
            )
        except DemuxStopped:
            raise DecodeCancelled("cancelled during the demux pass") from None

    def _lookup(self, key: tuple[str, str]) -> VideoIndex | None:
        with self._lock:
            index = self._entries.get(key)
            if index is not None:
                self._entries.move_to_end(key)
                self.num_hits += 1
        return index

    def _build_while_hashing(
        self, data: bytes, limits: DecodeLimits, cancel: threading.Event | None, cache_salt: str
    ) -> VideoIndex:
        check_size(len(data), limits)
        digest: list[str] = []
        hasher = threading.Thread(target=lambda: digest.append(content_sha256(data)), name="video-index-hash")
        hasher.start()

        def known() -> bool:  # between packets: is the file's index cached after all?
            if cancel is not None and cancel.is_set():
                return True
            with self._lock:
                return bool(digest) and (cache_salt, digest[0]) in self._entries

        try:
            index = build_video_index(data, limits, sha256="-", stop=known)
        except DemuxStopped:
            index = None
        finally:
            hasher.join()
        if cancel is not None and cancel.is_set():
            raise DecodeCancelled("cancelled during the demux pass")
        cached = self._lookup((cache_salt, digest[0]))
        if cached is not None:
            _check_limits(cached, limits)
            return cached
        if index is None:  # stopped for an entry evicted since: build it again
            return self._insert(build_video_index(data, limits, digest[0]), cache_salt)
        return self._insert(dataclasses.replace(index, content_sha256=digest[0]), cache_salt)

    def _insert(self, index: VideoIndex, cache_salt: str) -> VideoIndex:
        key = (cache_salt, index.content_sha256)
        size = index.num_bytes
        with self._lock:
            self.num_misses += 1
            if size > self.max_bytes:
                return index
            old = self._entries.pop(key, None)
            if old is not None:  # a racing build of the same file got here first
                self.num_bytes -= old.num_bytes
            self._entries[key] = index
            self.num_bytes += size
            while len(self._entries) > self.max_entries or self.num_bytes > self.max_bytes:
                _, evicted = self._entries.popitem(last=False)
                self.num_bytes -= evicted.num_bytes
        return index


def _check_limits(index: VideoIndex, limits: DecodeLimits) -> None:
    check_frame_size(index.width, index.height, limits)
    check_duration(index.duration_s, limits)
