"""The encode stage in this process: `EncoderEngine` behind the `EncodeStage` contract.

Used by the encoder's gRPC servicer and by the embedded mode (`epd ask` without --endpoint).
The per-request driver (demux, waiting for frames, preprocessing, token cache) runs on a bounded
`RequestPool` thread. Its frame groups go to the stage's engine core as tower jobs, which encodes
the waiting groups of several requests in one tower call per step on the `ModelThread`
(`encoder_svc/scheduler.py`, `encoder_svc/runner.py`); the driver waits for its group's result
while the decode threads go on decoding. Encode-stage pruning stays a per-request model call.

Cancelling `encode` (the client went away) sets the driver's cancel flag, so decoding stops at
the next frame group, and takes the request's queued tower job out of the core's queue at once;
unless other requests wait on this request's encode of the same media (`single_flight`): then
its driver goes on with the work, tower jobs and all, for them, and only the cancelled call ends.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import threading
from collections.abc import Callable
from dataclasses import replace

from epd.encoder_svc.driver import PendingFeatures
from epd.encoder_svc.engine import EncoderEngine
from epd.encoder_svc.runner import EncodeRunner
from epd.encoder_svc.scheduler import EncodeScheduler, TowerJob
from epd.encoder_svc.single_flight import Interest
from epd.model_runtime.adapter import VisionInputs, VisualFeatures
from epd.model_runtime.threads import pin_torch_threads
from epd.stages.contracts import (
    EncodedMedia,
    EncodeStage,
    EventSink,
    MediaInput,
    RequestCancelled,
    StageEvent,
    check_request_priority,
)
from epd.stages.engine_core import EngineCore, EngineLoad
from epd.stages.model_thread import ModelThread
from epd.stages.request_pool import RequestPool
from epd.token_pruning import PruningConfig
from epd.video.types import SamplingOptions

log = logging.getLogger(__name__)


def _decodes_full(num_running: int, num_waiting: int) -> str:
    return (
        f"the encoder is decoding {num_running} videos and {num_waiting} more requests are waiting; "
        "retry shortly, or start the encoder with a larger --max-concurrent-decodes or "
        "--max-queued-decodes"
    )


def build_encode_core(engine: EncoderEngine, model_thread: ModelThread) -> EngineCore[TowerJob]:
    """The encoder's engine core: tower jobs, batched up to `max_tower_patches_per_step`."""
    config = engine.config
    # Each running driver has at most `max_tower_jobs_per_request` tower jobs queued: the queue
    # never refuses one.
    scheduler = EncodeScheduler(
        config.max_tower_patches_per_step,
        config.max_concurrent_decodes * config.max_tower_jobs_per_request,
        config.scheduling_policy,
    )
    return EngineCore(scheduler, EncodeRunner(engine.adapter), model_thread)


class LocalEncodeStage(EncodeStage):
    def __init__(
        self, engine: EncoderEngine, model_thread: ModelThread, core: EngineCore[TowerJob] | None = None
    ) -> None:
        """`core`: the encoder core on `model_thread` (`build_encode_core`; built here when None)."""
        config = engine.config
        self.engine = engine
        self.model_thread = model_thread
        self.drivers = RequestPool(
            config.max_concurrent_decodes,
            config.max_queued_decodes,
            _decodes_full,
            thread_name="encode-driver",
            # A driver preprocesses its frame groups on one torch thread: the model thread keeps
            # the process's one OpenMP team (epd.model_runtime.threads).
            thread_initializer=functools.partial(pin_torch_threads, 1),
            scheduling_policy=config.scheduling_policy,
        )
        self.core = core or build_encode_core(engine, model_thread)
        assert isinstance(self.core.scheduler, EncodeScheduler) and isinstance(self.core.runner, EncodeRunner)
        self.scheduler: EncodeScheduler = self.core.scheduler
        self.runner: EncodeRunner = self.core.runner

    def load(self) -> EngineLoad:
        """What the encoder core is doing now, and the requests its decord backend handed to PyAV
        after a crash."""
        return replace(self.core.load(), decord_fallbacks=self.engine.num_decord_fallbacks)

    def close(self, wait_s: float | None = None) -> None:
        """Stop the request drivers and the decode workers (not the model thread: its owner's),
        waiting for the workers for at most `wait_s` (`EncoderEngine.close`)."""
        self.drivers.close()
        self.engine.close(wait_s)

    async def encode(
        self,
        media: MediaInput,
        sampling: SamplingOptions,
        on_event: EventSink,
        request_id: str,
        pruning: PruningConfig = PruningConfig(),
        cache_salt: str = "",
        priority: int = 0,
    ) -> EncodedMedia:
        check_request_priority(priority, self.engine.config.scheduling_policy)
        loop = asyncio.get_running_loop()
        towers = _TowerJobs(self.core, self.scheduler, request_id, loop, priority)
        # Work this request leads runs for whoever wants it: its tower jobs follow their best
        # priority (`single_flight`), which may change once it leaves or others wait on it.
        interest = Interest(request_id, priority, on_change=lambda: towers.run_for(interest.runs_for))

        # The pool's own cancel flag is set in the same instant as `interest.leave()` below; the
        # engine watches the interest, which knows whether others wait on this request's work.
        def drive(_: threading.Event) -> EncodedMedia:  # on a request-pool thread
            def threadsafe(event: StageEvent) -> None:
                if not interest.cancel.is_set():  # nobody listens any more (and the loop may be gone)
                    loop.call_soon_threadsafe(on_event, event)

            try:
                return self.engine.encode(
                    media,
                    sampling,
                    threadsafe,
                    pruning,
                    run_model=self.model_thread.call,
                    run_tower=towers.submit,
                    interest=interest,
                    cache_salt=cache_salt,
                )
            except RequestCancelled as exc:
                log.info("encode of request %s stopped: %s", request_id, exc)
                raise

        try:
            return await self.drivers.run(drive, priority)
        except asyncio.CancelledError:
            if interest.leave():
                # Its tower jobs stay queued: they are the waiting requests' now.
                log.info(
                    "encode of request %s cancelled by its caller; its decode and encode go on for "
                    "the requests waiting on the same media",
                    request_id,
                )
                raise
            await towers.cancel()  # its queued tower job has left the queue when this returns
            log.info("encode of request %s cancelled by its caller; its decoding stops", request_id)
            raise


class _TowerJobs:
    """One media request's way into the core from its driver thread: `submit` queues a frame group
    as a tower job on the event loop and returns at once (the driver goes on preprocessing);
    `cancel` (on the loop) takes its queued jobs out of the queue and refuses later ones;
    `run_for` moves its jobs, queued and to come, to another request id and priority (the work is
    shared, `single_flight`)."""

    def __init__(
        self,
        core: EngineCore[TowerJob],
        scheduler: EncodeScheduler,
        request_id: str,
        loop: asyncio.AbstractEventLoop,
        priority: int = 0,
    ) -> None:
        self.core = core
        self.scheduler = scheduler
        self.request_id = request_id  # loop only, as `priority`
        self.priority = priority
        self.loop = loop
        self._tasks: set[asyncio.Task] = set()  # loop only
        self._jobs: set[TowerJob] = set()  # submitted and not yet encoded; loop only
        self._cancelled = False  # loop only

    def run_for(self, runs_for: Callable[[], tuple[str, int]]) -> None:  # any thread
        """The jobs are for the request id and priority `runs_for()` gives, read on the loop (the
        latest, whatever order the calls from several threads run in): those queued move to their
        place at that priority (`EncodeScheduler.reprioritize`), later ones are made so."""
        with contextlib.suppress(RuntimeError):  # the loop closed: the stage is stopping
            self.loop.call_soon_threadsafe(self._run_for, runs_for)

    def _run_for(self, runs_for: Callable[[], tuple[str, int]]) -> None:
        request_id, priority = runs_for()
        self.request_id, self.priority = request_id, priority
        for job in self._jobs:
            job.request_id = request_id
            self.scheduler.reprioritize(job, priority)

    def submit(self, inputs: VisionInputs, group_index: int) -> PendingFeatures:  # driver thread
        try:
            future = asyncio.run_coroutine_threadsafe(self._run(inputs, group_index), self.loop)
        except RuntimeError:  # the loop closed: the stage is stopping
            if not self.loop.is_closed():
                raise
            raise RequestCancelled(f"cancelled before frame group {group_index} reached the tower") from None
        return _PendingGroup(future, group_index, self.loop)

    async def _run(self, inputs: VisionInputs, group_index: int) -> VisualFeatures:
        if self._cancelled:
            raise RequestCancelled(f"cancelled before frame group {group_index} reached the tower")
        job = TowerJob(
            request_id=self.request_id,
            priority=self.priority,
            num_patches=int(inputs.pixel_values.shape[0]),
            group_index=group_index,
            inputs=inputs,
        )
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._jobs.add(job)
        try:
            # Closing the submission (this task cancelled) removes the job from the queue at once.
            return [embeds async for embeds in self.core.submit(job)][0]
        finally:
            self._tasks.discard(task)
            self._jobs.discard(job)

    async def cancel(self) -> None:
        self._cancelled = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class _PendingGroup:
    """A submitted frame group's features, waited for on the driver thread."""

    def __init__(
        self,
        future: concurrent.futures.Future[VisualFeatures],
        group_index: int,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.future = future
        self.group_index = group_index
        self.loop = loop

    def result(self, timeout_s: float | None = None) -> VisualFeatures:
        try:
            return self.future.result(timeout_s)
        except (concurrent.futures.CancelledError, RuntimeError) as exc:  # RuntimeError: the loop closed
            if isinstance(exc, RuntimeError) and not self.loop.is_closed():
                raise
            raise RequestCancelled(
                f"cancelled while frame group {self.group_index} waited for the tower"
            ) from None

    def cancel(self) -> None:
        self.future.cancel()  # cancels its task on the loop, which takes the job out of the queue
