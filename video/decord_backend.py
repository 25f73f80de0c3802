"""Optional decord backend, run in a child process so that a hang can be killed.

The set-up pins `decord2` (the maintained fork; it installs the same `decord` module and bundles
FFmpeg 8); decord 0.6 (last released 2021, FFmpeg 4) works too. decord has open reports of
hangs that hold the GIL, so it never runs in the server's own process. Never `import decord`
there either: decord 0.6's bundled FFmpeg 4 libraries interpose on PyAV's (measured here: after
`import decord`, PyAV's libvpx-vp9 encoder fails to open and HEVC/rotation results change). So:
one long-lived child (spawned, not forked, since the parent has
decode threads) takes requests over a pipe and writes the frames into shared memory, which the
parent copies out. A request that takes longer than `timeout_s` kills the child; the next
request starts a fresh one. A child that dies while it works on a request (a crash in decord,
the OOM killer) is reaped and replaced, and the request fails with `DecoderCrashed`; the encoder
then decodes it with the PyAV backend instead (decord crashes on some damaged files every time:
`encoder_svc/engine.py`).

Untrusted bytes: decord probes the container itself (its FFmpeg, every demuxer, no whitelist),
so the parent first vets them with `epd.video.media_open.sniff_container` (only MP4/MOV, Matroska/
WebM, AVI and MPEG-TS reach the child) and builds the index through `open_video`. What runs
inside decord cannot be charged frame by frame: the decoded-pixel budget is checked up front
from the plan (keyframe to last target of each interval, at the index's frame size), and a frame
size change mid-stream is not seen by the parent; the child's timeout, the request's
`max_decode_s` (what is left of it when the child is asked: the child is killed at it) and the
process boundary are what bound it there. The PyAV backend enforces both while decoding.

Frames are chosen by the same rule as every backend: the parent builds the PyAV demux index and
plan, and asks decord for frames by their position in presentation order (each distinct frame
once; a frame picked for several slots is repeated in the parent). decord's own frame table must
agree with the index (same count, timestamps within half a frame); where it does not (e.g. AVI
with B-frames) the request fails with MediaError rather than return other frames.

Measured identical to PyAV (tests/unit/video/test_decord_backend.py) for H.264 (MP4, MKV), VP9
(WebM), MJPEG (AVI) and HEVC, rotation included (decord applies the display matrix itself), and
with decord2 for AV1 and MPEG-4 Part 2 too (decord 0.6 cannot open AV1, and its MPEG-4 Part 2
decoder differs from FFmpeg 8's by +-1 in some pixels). After a seek in an HEVC stream decord
(both) returns the frame after the one asked for (its keyframe table is off by one, and a target
on a keyframe comes back one late), so HEVC frames are read in order from the first
(`_NO_SEEK_CODECS`; the budget counts those frames), and a request that would decode more that way
than by seeking is handed to the PyAV backend (`hands_over`), which seeks exactly. With
`max_pixels`, decord decodes at the source size and the parent downscales the upright RGB frames
with swscale (`simple_decoder.downscale_rgb`): same shapes as PyAV's, pixels within rounding of
them (PyAV scales the YUV frame before turning it). decord's own
scaler (`VideoReader(width=, height=)`) is not used: it takes the size after rotation (a 90/270
degree clip came out transposed or failed) and fails outright for some widths (16, 24, 48 and 72
px: "from_size == to_size"), which the client saw as "cannot open AV1, and some AVI files".
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any

import numpy as np

from epd.video.budget import MIN_PIXELS_PER_FRAME, DecodeBudget, decode_too_long
from epd.video.keyframe_index import KeyframeIndexCache
from epd.video.media_open import sniff_container
from epd.video.plan import make_intervals
from epd.video.simple_decoder import (
    CORRUPT_MEDIA_MESSAGE,
    check_size,
    decode_image,
    downscale_rgb,
    select_frames,
)
from epd.video.types import (
    DecodedVideo,
    DecodeLimits,
    DecoderCrashed,
    MediaError,
    MediaLimitError,
    SamplingOptions,
)

log = logging.getLogger(__name__)

DECODER_CRASHED = "the decoder process failed; retry the request"
# Codecs whose frames decord reads in order from the first, never seeking (`_read_frames`).
_NO_SEEK_CODECS = frozenset({"hevc"})
_DECORD_FAILED = (
    "the decord backend could not decode this video (some AVI files, and AV1 with decord 0.6); "
    "use the default PyAV backend"
)


@dataclass(frozen=True)
class DecordConfig:
    timeout_s: float = 120.0
    """A request not answered by the child within this long kills it and fails with MediaError."""
    num_threads: int = 0
    """decord's decode threads (0: its default, one per core)."""


def decord_available() -> bool:
    """Whether decord is installed, without importing it (see the module docstring)."""
    import importlib.util

    return importlib.util.find_spec("decord") is not None


_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent_pid: int) -> None:
    """In the child: SIGKILL when the server that started it dies (SIGKILL, the OOM killer). It
    would notice the closed pipe only between requests, and a decode that hangs (why decord runs
    in a child) never: it was left running, orphaned, holding its memory and a core. The signal
    comes when the thread that started the child ends: the encoder's request drivers, which live
    as long as the server."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass
    if os.getppid() != parent_pid:  # the server died before the signal was armed
        os._exit(0)


def _child_main(conn, parent_pid: int) -> None:
    """Child loop: (data, positions, pts_s, shm name, num_threads, seek) -> ("ok", shape) | ("error", text)."""
    import io

    _die_with_parent(parent_pid)
    import decord

    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        data, positions, pts_s, shm_name, num_threads, seek = msg
        try:
            reader = decord.VideoReader(io.BytesIO(data), ctx=decord.cpu(0), num_threads=num_threads)
            if len(reader) != len(pts_s):
                raise RuntimeError(f"decord sees {len(reader)} frames, the index {len(pts_s)}")
            ts = reader.get_frame_timestamp(np.arange(len(reader)))[:, 0]
            tol = 0.5 * float(np.median(np.diff(pts_s))) if len(pts_s) > 1 else 1e-3
            if np.max(np.abs(ts - (np.asarray(pts_s) - pts_s[0]))) > tol:
                raise RuntimeError("decord's frame timestamps disagree with the demux index")
            shm = shared_memory.SharedMemory(name=shm_name)
            try:
                shape = _read_frames(reader, positions, shm.buf, seek)
            finally:
                shm.close()
            conn.send(("ok", shape))
        except Exception as exc:  # noqa: BLE001 - every failure goes back as text
            conn.send(("error", repr(exc)))


def _read_frames(reader, positions: list[int], buf, seek: bool) -> tuple[int, int, int, int]:
    """Decode `positions` (ascending, distinct) into `buf` as [U, H, W, 3] uint8; return that shape.

    `get_batch` where it works (5-20% faster than a frame at a time, docs/benchmarks.md). decord2
    3.4 (the maintained fork) gives a frame whose FFmpeg rows are padded past W x 3 bytes (96 px
    wide: 384-byte rows) the shape [H, W, row_bytes // W] (4 or more "channels"), and its
    `get_batch` then fails its own copy ("from_size == to_size"): such a video is read again a
    frame at a time, each frame's rows cut back to W x 3 bytes (the pixels are right, checked
    against PyAV). Common widths (1920, 1280, 640 px) have no padded rows; decord 0.6 gives
    [H, W, 3] for every width.

    `seek=False` reads every frame from the first to the last position in order: after a seek in
    an HEVC stream both decord 0.6 and decord2 3.4 return the frame after the one asked for."""
    import decord

    if seek:
        try:
            batch = reader.get_batch(positions).asnumpy()  # [U, H, W, 3]
        except decord.DECORDError as exc:
            if "from_size == to_size" not in str(exc):
                raise
        else:
            if batch.nbytes > len(buf):
                raise RuntimeError("frames larger than the shared buffer")
            np.ndarray(batch.shape, np.uint8, buffer=buf)[:] = batch
            return batch.shape
    frames = None
    wanted = iter(positions) if seek else iter(range(positions[-1] + 1))
    i = 0
    for position in wanted:
        frame = reader[position] if seek else reader.next()  # NDArray [H, W, C]
        if not seek and position != positions[i]:
            continue  # decoded on the way to the next wanted frame
        frame = frame.asnumpy()
        height, width = frame.shape[:2]
        if frame.shape[2] != 3:  # decord2's padded rows
            frame = frame.reshape(height, -1)[:, : width * 3].reshape(height, width, 3)
        if frames is None:
            if len(positions) * frame.nbytes > len(buf):
                raise RuntimeError("frames larger than the shared buffer")
            frames = np.ndarray((len(positions), height, width, 3), np.uint8, buffer=buf)
        if frame.shape != frames.shape[1:]:  # the index saw one size; decord went on at another
            raise RuntimeError(
                f"frame {position} is {width}x{height}, not {frames.shape[2]}x{frames.shape[1]}"
            )
        frames[i] = frame
        i += 1
    assert frames is not None
    return frames.shape


CLOSE_WAIT_S = 5.0
"""How long `close` waits for the child to end when asked, before it kills it."""
KILL_WAIT_S = 5.0
"""How long a killed child is waited for (SIGKILL: it ends at once, unless the machine is stuck)."""


class DecordDecoder:
    """`decode(data, opts, limits) -> DecodedVideo` through decord in a killable child process."""

    def __init__(self, config: DecordConfig | None = None, index_cache: KeyframeIndexCache | None = None):
        """`index_cache`: share the PyAV decoder's, so that a request handed over to it
        (`hands_over`) costs no second demux pass."""
        self.config = config or DecordConfig()
        self.index_cache = index_cache or KeyframeIndexCache()
        self._lock = threading.Lock()  # one request at a time per child
        self._proc: mp.process.BaseProcess | None = None
        self._conn: Any = None  # multiprocessing Connection to the child
        self.num_restarts = 0

    def _ensure_child(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            return
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        self._proc = ctx.Process(target=_child_main, args=(child, os.getpid()), daemon=True, name="decord")
        self._proc.start()
        child.close()
        self._conn = parent

    def _kill_child(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join(timeout=KILL_WAIT_S)
            self.num_restarts += 1
        if self._conn is not None:
            self._conn.close()
        self._proc, self._conn = None, None

    def hands_over(
        self,
        data: bytes,
        opts: SamplingOptions,
        limits: DecodeLimits = DecodeLimits(),
        sha256: str | None = None,
        cache_salt: str = "",
    ) -> bool:
        """Whether this request is the PyAV backend's to decode: a video decord cannot seek in
        (HEVC, `_NO_SEEK_CODECS`) whose frames read in order from the first would be more than
        those from each target's keyframe, which PyAV seeks to exactly (the same frames: tests/unit/
        video/test_decord_backend.py). Read in order, a long HEVC video asked about near its end
        decoded it all: past --max-decoded-pixels (refused) or --max-decode-s where PyAV decodes a
        few GOPs. Images and other codecs stay with decord. Errors of the demux pass (MediaError,
        MediaLimitError) are the request's, as in `decode`."""
        opts.validate(limits.max_frames)
        if sniff_container(data).is_image:
            return False
        index = self.index_cache.get_or_build(data, limits, sha256, cache_salt=cache_salt)
        if index.codec_name not in _NO_SEEK_CODECS:
            return False
        chosen_s, _ = select_frames(index.frames, opts)
        distinct = np.unique(np.searchsorted(index.frames.pts_s, chosen_s))  # [U] frame positions
        return _planned_frames(index, distinct, seek=True) < _planned_frames(index, distinct, seek=False)

    def decode(
        self,
        data: bytes,
        opts: SamplingOptions,
        limits: DecodeLimits = DecodeLimits(),
        sha256: str | None = None,
        cache_salt: str = "",
        started_s: float | None = None,
    ) -> DecodedVideo:
        """`cache_salt`: the request's tenant, whose keyframe indexes alone it may reuse.
        `started_s`: time.monotonic() when the request's decode began (its demux pass, which
        `hands_over` may have run; default: now): --max-decode-s counts from then."""
        started = time.perf_counter()
        budget = DecodeBudget(limits, started_s)  # --max-decode-s: the demux pass counts too
        check_size(len(data), limits)
        opts.validate(limits.max_frames)
        if sniff_container(data).is_image:  # nothing but an allowed container reaches decord
            return decode_image(data, opts, limits)
        index = self.index_cache.get_or_build(data, limits, sha256, cache_salt=cache_salt)
        if index.width <= 0 or index.height <= 0:
            # The shared buffer is sized from the header's frame size: a header that gives none (FFmpeg
            # opened the file but could not tell its size) would make an empty one.
            raise MediaError(CORRUPT_MEDIA_MESSAGE)
        chosen_s, sampled_fps = select_frames(index.frames, opts)
        slot_positions = np.searchsorted(index.frames.pts_s, chosen_s)  # [T] non-decreasing
        distinct = np.unique(slot_positions)  # [U]: decord decodes each once
        seek = index.codec_name not in _NO_SEEK_CODECS
        _check_planned_pixels(index, distinct, limits, seek)
        positions = distinct.tolist()
        # decord applies the display rotation itself (pixel-identical to frame_to_rgb's rot90), at
        # the source size: [U, H, W, 3] with H and W swapped by a 90/270 degree rotation.
        shm = shared_memory.SharedMemory(create=True, size=len(positions) * index.width * index.height * 3)
        try:
            with self._lock:
                budget.check_time()  # the index pass, or the wait for the child, took it all
                self._ensure_child()
                assert self._conn is not None
                # The request's decode wall-time limit binds here too: what is left of it (the
                # child decodes all at once, uncharged); past it the child is killed.
                remaining_s = budget.remaining_s()
                try:
                    self._conn.send(
                        (
                            data,
                            positions,
                            index.frames.pts_s.tolist(),
                            shm.name,
                            self.config.num_threads,
                            seek,
                        )
                    )
                    answered = self._conn.poll(min(self.config.timeout_s, remaining_s))
                    if answered:
                        status, payload = self._conn.recv()
                except (EOFError, OSError) as exc:
                    # The child died (a crash in decord, the OOM killer) before or while it worked
                    # on this request (BrokenPipeError on send, EOFError on recv): say nothing
                    # about the video, start a fresh child for the next request. INFO: the caller
                    # says what follows in its one WARNING line (the encoder decodes it with PyAV).
                    log.info("the decord child process died: %r", exc)
                    self._kill_child()
                    raise DecoderCrashed(DECODER_CRASHED) from None
                if not answered:
                    self._kill_child()
                    if remaining_s <= self.config.timeout_s:
                        raise decode_too_long(limits)
                    raise MediaError(
                        f"the decord backend did not answer within {self.config.timeout_s:.0f} s "
                        "and was restarted; use the default PyAV backend"
                    )
            if status != "ok":
                log.info("decord failed: %s", payload)
                raise MediaError(_DECORD_FAILED)
            unique = np.ndarray(payload, np.uint8, buffer=shm.buf)  # [U, H, W, 3] at the source size
            if opts.max_pixels:  # [U, h, w, 3], out of the shared buffer
                unique = np.stack([downscale_rgb(frame, opts.max_pixels) for frame in unique])
            frames = unique[np.searchsorted(distinct, slot_positions)]  # [T, h, w, 3], a copy
            del unique
        finally:
            shm.close()
            shm.unlink()
        return DecodedVideo(
            frames=frames,
            timestamps_s=[float(t - index.frames.pts_s[0]) for t in chosen_s],
            sampled_fps=sampled_fps,
            duration_s=index.duration_s,
            source_fps=index.source_fps,
            stats={"decode_ms": (time.perf_counter() - started) * 1e3},
        )

    def close(self, wait_s: float = CLOSE_WAIT_S) -> None:
        """Ask the child to end and wait for it for at most `wait_s` (the rest of its owner's
        close, `EncoderEngine.close`), then kill it. A decode still running in the child holds it
        (the lock) for up to `DecordConfig.timeout_s`: past `wait_s` the child is killed under it
        instead, and that decode fails as a crashed child (DecoderCrashed, which also reaps it).
        Idempotent."""
        deadline_s = time.monotonic() + wait_s
        if not self._lock.acquire(timeout=wait_s):
            proc = self._proc
            if proc is not None:
                proc.kill()  # the decode waiting on it sees the pipe close at once
            log.warning("the decord child was killed at close, in the middle of a decode")
            return
        try:
            if self._conn is not None and self._proc is not None and self._proc.is_alive():
                try:
                    self._conn.send(None)
                    self._proc.join(timeout=max(0.0, deadline_s - time.monotonic()))
                except OSError:
                    pass
            if self._proc is not None and self._proc.is_alive():
                self._proc.kill()
                self._proc.join(timeout=KILL_WAIT_S)
            if self._conn is not None:
                self._conn.close()
            self._proc, self._conn = None, None
        finally:
            self._lock.release()

    def __enter__(self) -> DecordDecoder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _planned_frames(index, positions: np.ndarray, seek: bool) -> int:
    """Frames decoded to reach `positions` ([U] ascending): from each target's keyframe to the
    target with `seek`, else every frame from the first."""
    if not seek:
        return int(positions[-1]) + 1
    targets = index.frame_pts[positions]
    return sum(iv.num_decode_frames for iv in make_intervals(index.frame_pts, index.keyframe_pts, targets))


def _check_planned_pixels(index, positions: np.ndarray, limits: DecodeLimits, seek: bool) -> None:
    """The decoded-pixel budget, from the plan: decord decodes from each target's keyframe to the
    target (at least; it is not charged while it runs), or from the first frame without `seek`."""
    planned = _planned_frames(index, positions, seek)
    if planned * max(index.width * index.height, MIN_PIXELS_PER_FRAME) > limits.max_decoded_pixels:
        raise MediaLimitError(
            f"decoding this request would take {planned} frames of {index.width}x{index.height}, over "
            f"this server's limit of {limits.max_decoded_pixels} decoded pixels (encoder flag "
            "--max-decoded-pixels); send a shorter clip, a lower resolution, or ask for fewer frames"
        )
