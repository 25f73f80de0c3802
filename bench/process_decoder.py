"""The parallel decoder's algorithm on worker *processes* instead of threads (benchmark only).

Issue #3 asks whether decode workers should be threads or processes. The served decoder
(`epd.video.parallel_decoder`) uses threads; this runs the same plan and the same per-share decode
loop (`seek_to_keyframe` / `decode_frames` of `epd.video.share_decode`, non-reference skipping included) in a
pool of spawned processes, in the best case for processes: the video bytes go to the workers once
through shared memory, and each worker writes its frames straight into a shared output array
(nothing is pickled but the plan). The pool is created once and reused, as the thread pool is, so
process start-up is not counted; what is counted is the index, the plan, the two shared-memory
copies and the decoding.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
from multiprocessing import shared_memory

import numpy as np

from epd.video.budget import DecodeBudget
from epd.video.keyframe_index import VideoIndex, build_video_index, probe_rotation
from epd.video.media_open import open_video
from epd.video.plan import make_plan
from epd.video.share_decode import NONREF_SKIP_CODECS, decode_frames, seek_to_keyframe
from epd.video.simple_decoder import frame_to_rgb, scaled_size
from epd.video.types import DecodeLimits, SamplingOptions


def _decode_share_in_process(
    data_name: str,
    data_size: int,
    out_name: str,
    out_shape: tuple[int, ...],
    index: VideoIndex,
    intervals: list[tuple[int, tuple[int, ...]]],
    slots_of_pts: dict[int, list[int]],
    max_pixels: int | None,
    seek_cost_frames: float,
    skip_nonref: bool,
) -> int:
    """Decode one share's intervals into the shared output; returns frames decoded."""
    data_shm = shared_memory.SharedMemory(name=data_name)
    out_shm = shared_memory.SharedMemory(name=out_name)
    try:
        out = np.ndarray(out_shape, np.uint8, buffer=out_shm.buf)  # [T, H, W, 3]
        decoded = 0
        budget = DecodeBudget(DecodeLimits())  # this share's frames only (one per process)
        assert data_shm.buf is not None  # typeshed: None only once closed
        with open_video(bytes(data_shm.buf[:data_size])) as container:
            stream = container.streams.video[0]
            stream.codec_context.thread_count = 1
            keep = None
            if skip_nonref and stream.codec_context.name in NONREF_SKIP_CODECS:
                keep = frozenset(p for _, targets in intervals for p in targets)
            frame_pts = index.frame_pts
            frames = None
            last_pts = int(frame_pts[0]) - 1
            for keyframe_pts, targets in intervals:
                wanted = set(targets)
                if frames is None:
                    frames = (
                        decode_frames(container, stream, keep, budget)
                        if keyframe_pts <= frame_pts[0]
                        else seek_to_keyframe(
                            container, stream, index, keyframe_pts, targets[0], keep, budget
                        )
                    )
                else:
                    ahead = int(
                        np.searchsorted(frame_pts, keyframe_pts)
                        - np.searchsorted(frame_pts, last_pts, "right")
                    )
                    if last_pts >= targets[0] or ahead > seek_cost_frames:
                        frames = seek_to_keyframe(
                            container, stream, index, keyframe_pts, targets[0], keep, budget
                        )
                for frame in frames:
                    decoded += 1
                    last_pts = frame.pts
                    if frame.pts in wanted:
                        rgb = frame_to_rgb(frame, max_pixels)
                        for slot in slots_of_pts[frame.pts]:
                            out[slot] = rgb
                        wanted.discard(frame.pts)
                        if not wanted:
                            break
                if wanted:
                    raise RuntimeError("stream ended before a target")
            del out
        return decoded
    finally:
        data_shm.close()
        out_shm.close()


class ProcessShareDecoder:
    """A reusable pool of `num_workers` spawned processes running the threads' decode loop."""

    def __init__(self, num_workers: int, seek_cost_frames: float = 3.0, skip_nonref: bool = True):
        self.num_workers = num_workers
        self.seek_cost_frames = seek_cost_frames
        self.skip_nonref = skip_nonref
        self.pool = concurrent.futures.ProcessPoolExecutor(
            num_workers, mp_context=multiprocessing.get_context("spawn")
        )
        # Start every worker now (imports included), so timing sees a warm pool.
        list(self.pool.map(_warm, range(num_workers)))

    def decode(self, data: bytes, opts: SamplingOptions) -> np.ndarray:
        """[T, H, W, 3] uint8, the same frames as simple_decoder.decode(data, opts).frames."""
        index = build_video_index(data)
        plan = make_plan(index, opts, self.num_workers, self.seek_cost_frames)
        w, h = scaled_size(index.width, index.height, opts.max_pixels)
        if probe_rotation(data) in (90, 270):
            w, h = h, w
        shape = (len(plan.slot_pts), h, w, 3)
        slots_of_pts: dict[int, list[int]] = {}
        for slot, pts in enumerate(plan.slot_pts.tolist()):
            slots_of_pts.setdefault(pts, []).append(slot)
        data_shm = shared_memory.SharedMemory(create=True, size=len(data))
        out_shm = shared_memory.SharedMemory(create=True, size=int(np.prod(shape)))
        try:
            assert data_shm.buf is not None  # typeshed: None only once closed
            data_shm.buf[: len(data)] = data
            futures = []
            for share in plan.shares:
                intervals = [(plan.intervals[p].keyframe_pts, plan.intervals[p].target_pts) for p in share]
                if intervals:
                    futures.append(
                        self.pool.submit(
                            _decode_share_in_process,
                            data_shm.name,
                            len(data),
                            out_shm.name,
                            shape,
                            index,
                            intervals,
                            slots_of_pts,
                            opts.max_pixels,
                            self.seek_cost_frames,
                            self.skip_nonref,
                        )
                    )
            for f in futures:
                f.result()
            return np.ndarray(shape, np.uint8, buffer=out_shm.buf).copy()
        finally:
            data_shm.close()
            data_shm.unlink()
            out_shm.close()
            out_shm.unlink()

    def close(self) -> None:
        self.pool.shutdown()


def _warm(_: int) -> int:
    import av  # noqa: F401

    return 0
