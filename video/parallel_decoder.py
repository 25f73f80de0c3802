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
import logging
import queue
import threading
import time

import numpy as np

from epd.video.decode_request import ShareStopped, ShareTask, VideoDecodeRequest
from epd.video.frame_group_stream import FrameGroupStream
from epd.video.keyframe_index import KeyframeIndexCache
from epd.video.media_open import sniff_container
from epd.video.parallel_decode_config import ParallelDecodeConfig
from epd.video.plan import make_plan
from epd.video.share_decode import decode_share
from epd.video.simple_decoder import check_size, decode_failure, decode_image
from epd.video.types import DecodedVideo, DecodeLimits, FrameResizer, MediaError, SamplingOptions

log = logging.getLogger(__name__)

CLOSE_WAIT_S = 5.0
"""How long `close` (and interpreter exit) waits in all for the workers to end: a worker stops at
its next frame, which takes milliseconds; one that takes longer is stuck inside FFmpeg or a resize,
and the caller goes on without it."""


class DecodeWorker(threading.Thread):
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

    def _run_task(self, task: ShareTask) -> None:
        req = task.request
        if req.stopped():
            return
        task.worker = self
        task.started_at = task.last_progress = time.monotonic()
        try:
            decode_share(task, self.retired, self.pool.config.skip_nonref_frames)
        except ShareStopped:
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


class ParallelDecoder:
    """A pool of decode threads, reused across requests. Thread-safe; `close()` when done."""

    def __init__(self, config: ParallelDecodeConfig | None = None):
        self.config = config or ParallelDecodeConfig()
        self.index_cache = KeyframeIndexCache(self.config.index_cache_entries, self.config.index_cache_bytes)
        self._tasks: queue.SimpleQueue[ShareTask | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._workers: set[DecodeWorker] = set()
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
        decode_started_s: float | None = None,
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
        keyframe indexes are reused (`KeyframeIndexCache`). `decode_started_s`: time.monotonic()
        when the request's decode began, where another backend tried it first (the encoder's
        decord fallback): --max-decode-s counts from then, so the request gets what is left of it
        (MediaLimitError here when nothing is); default: now.
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
        budget_started = started if decode_started_s is None else decode_started_s
        req = VideoDecodeRequest(
            data,
            index,
            plan,
            opts,
            self.config.seek_cost_frames,
            limits,
            cancel,
            budget_started,
            frame_resize,
        )
        req.budget.check_time()  # a budget another backend spent: refused before any thread works on it
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
                req.tasks.append(ShareTask(req, number, last_progress=started))
        for task in req.tasks:
            self._tasks.put(task)
        return stream

    @property
    def closed(self) -> bool:
        """Whether `close` was called: `iter_groups` refuses work from then on."""
        return self._closed

    def close(self, wait_s: float | None = None) -> None:
        """Stop the pool: running shares finish their current frame, threads exit. Every worker is
        told to stop first, then all are waited for together, for at most `wait_s` in all
        (default `CLOSE_WAIT_S`): a pool of N stuck workers costs one wait, not N. Idempotent."""
        self._join(self._stop(), time.monotonic() + (CLOSE_WAIT_S if wait_s is None else wait_s))

    def _stop(self) -> list[DecodeWorker]:
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
    def _join(workers: list[DecodeWorker], deadline_s: float) -> None:
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
        worker = DecodeWorker(self, self._num_started)
        self._num_started += 1
        worker.start()
        self._workers.add(worker)

    def _replace(self, worker: DecodeWorker) -> None:
        """Retire a stuck worker (it exits at its next frame) and start a fresh one."""
        with self._lock:
            if worker.retired.is_set() or self._closed:
                return
            worker.retired.set()
            self.num_replaced_workers += 1
            self._start_worker()

    def _worker_exited(self, worker: DecodeWorker) -> None:
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
