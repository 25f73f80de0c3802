"""The one engine-core shape of every service: a scheduler, a model runner, explicit requests.

    core = EngineCore(scheduler, runner, model_thread)
    async for output in core.submit(request):   # from the service's event loop
        ...

- The **scheduler** (`Scheduler`) owns the waiting queue and the running batch. It is touched only
  on the event loop: `add` admits a request (or raises ResourceExhausted when a bounded queue is
  full, before any work starts), `schedule` picks what runs in the next step, `remove` forgets a
  finished or cancelled request and frees its room.
- The **runner** (`ModelRunner`) owns the model and every request's model state (cache rows,
  positions, samplers). It is touched only on the model thread: `execute(batch)` runs *one batched
  step* for everything scheduled and returns each request's output of that step; `release` frees
  a request's state.
- The **core** loop alternates the two (vLLM v1's `EngineCore.step()`, nano-vllm's
  `LLMEngine.step`): schedule, execute on the model thread, hand outputs to each request's
  queue, remove the finished. New requests are admitted while a step runs; they join at the
  next step. A request whose reader goes away (client gone, task cancelled) is removed at once
  when it is waiting, and before the next step when it is running: its room and state are freed
  then, never after garbage collection.

No gRPC here: servicers submit to a stage, the stage submits to its core.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from epd.stages.model_thread import ModelThread

log = logging.getLogger(__name__)

_END = object()


@dataclass(eq=False)
class CoreRequest:
    """Per-request bookkeeping every core shares. Services subclass it with their own state."""

    request_id: str
    arrival_s: float = field(default_factory=time.monotonic)
    priority: int = 0
    """vLLM's: lower is served earlier under `--scheduling-policy priority` (`epd.stages.scheduling`)."""
    first_scheduled_s: float | None = None
    finished: bool = False
    cancelled: bool = False
    released: bool = False
    """The runner has freed its state (set by the core, once)."""
    outputs: asyncio.Queue = field(default_factory=asyncio.Queue, repr=False)

    @property
    def queue_wait_s(self) -> float:
        return (self.first_scheduled_s or time.monotonic()) - self.arrival_s


R = TypeVar("R", bound=CoreRequest)


@dataclass(frozen=True)
class EngineLoad:
    """What a service's core is doing now (its /metrics gauges and the router's load signal)."""

    stage: str
    num_running: int = 0
    num_waiting: int = 0
    last_batch_size: int = 0
    """Requests in the most recent batched step."""
    num_steps: int = 0
    queue_wait_s_total: float = 0.0
    """Summed time requests waited before their first step."""
    num_requests: int = 0
    """Requests the core admitted since it started: a prefill core's prompts (a request's n choices
    are one there and n requests in the decode core); an encoder core's tower jobs (one per group
    of frames of a request's media)."""
    num_preemptions: int = 0
    memory_used_bytes: int = 0
    """Bytes reserved for running and admitted requests (decode: KV memory)."""
    memory_total_bytes: int = 0
    """The budget (0: not budgeted)."""
    prefix_cache_hits: int = 0
    """Prefill's prefix cache (0 elsewhere): prompts that reused a cached prefix (at least
    `prefix_cache.MIN_REUSE_TOKENS` tokens), since start."""
    prefix_cache_misses: int = 0
    """Prompts eligible for the prefix cache that found no usable prefix, since start."""
    prefix_cache_query_tokens: int = 0
    """Prompt tokens of the prompts looked up in the prefix cache, since start (vLLM's `prefix_cache_queries`)."""
    prefix_cache_hit_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache, since start (vLLM's `prefix_cache_hits`)."""
    prefix_cache_evictions: int = 0
    """Prefix-cache entries dropped for room (LRU) or age (TTL), since start."""
    prefix_cache_entries: int = 0
    prefix_cache_bytes: int = 0
    """Bytes of KV the prefix cache holds now."""
    kv_store_caches: int = 0
    """Prefill's KV store (0 elsewhere): caches held now for a decoder to pull."""
    kv_store_used_bytes: int = 0
    """Their bytes (decode's side of the handover is `memory_used_bytes`)."""
    kv_store_total_bytes: int = 0
    """The store's budget (--kv-store-bytes)."""
    kv_store_expired: int = 0
    """Caches dropped at their TTL (--kv-ttl) before a decoder confirmed them, since start."""
    kv_store_released: int = 0
    """Caches released (their request ended) before a decoder confirmed them, since start."""
    kv_store_refused: int = 0
    """Caches the store refused for want of room (--kv-store-bytes), since start."""
    decord_fallbacks: int = 0
    """The encoder's (0 elsewhere): requests the PyAV backend decoded after their decord child
    crashed (`--decode-backend decord`), since start."""


class Scheduler(ABC, Generic[R]):
    """Waiting queue + running batch. Event-loop only."""

    @abstractmethod
    def add(self, request: R) -> None:
        """Admit `request` (it waits until `schedule` picks it); ResourceExhausted when full."""

    @abstractmethod
    def schedule(self) -> list[R]:
        """The requests the next step runs ([]: nothing can run now)."""

    @abstractmethod
    def remove(self, request: R) -> None:
        """Forget a finished or cancelled request (waiting or running) and free its room."""

    @abstractmethod
    def requests(self) -> list[R]:
        """Every admitted request not yet removed, waiting or running."""

    @abstractmethod
    def load(self) -> EngineLoad: ...


class ModelRunner(ABC, Generic[R]):
    """The model and the per-request model state. Model-thread only."""

    admits_first: bool = False
    """True: a request scheduled for the first time goes through `admit` in a model-thread call of
    its own, and its outputs reach its reader before the batched step it then joins runs."""

    def admit(self, requests: Sequence[R]) -> list[tuple[R, Any]]:
        """Set up requests scheduled for the first time; each one's output that needs no batched
        step (decode: the prefill's token). Only called when `admits_first`."""
        return []

    @abstractmethod
    def execute(self, batch: Sequence[R]) -> list[tuple[R, Any]]:
        """One batched step; each request's output of this step (a request may have none, e.g.
        mid-way through a chunked prefill). Sets `request.finished` on the ones that are done.
        An exception fails the whole batch; `request_error` is the per-request way."""

    @abstractmethod
    def release(self, request: R) -> None:
        """Free the model state of a request that left (finished, cancelled or failed)."""


class RequestFailed:
    """An output that ends one request with an error (the others in the step go on)."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


class EngineCore(Generic[R]):
    def __init__(self, scheduler: Scheduler[R], runner: ModelRunner[R], model_thread: ModelThread) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.model_thread = model_thread
        self.lane = scheduler.load().stage  # this core's calls on a shared model thread
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self._to_release: list[R] = []  # left while running; released on the model thread
        self.num_steps = 0
        self.last_batch_size = 0
        self.queue_wait_s_total = 0.0
        self.num_requests = 0

    async def submit(self, request: R) -> AsyncGenerator[Any, None]:
        """Admit `request` and yield its outputs until it is finished. Raises ResourceExhausted
        (before anything runs) when the scheduler is full. Closing the iterator early, or
        cancelling its reader, removes the request."""
        self.scheduler.add(request)
        self.num_requests += 1
        self._ensure_loop()
        self._wake.set()
        try:
            while (item := await request.outputs.get()) is not _END:
                if isinstance(item, RequestFailed):
                    raise item.error
                yield item
        finally:
            if not request.finished:
                request.cancelled = True
                self._leave(request)

    def load(self) -> EngineLoad:
        base = self.scheduler.load()
        return EngineLoad(
            stage=base.stage,
            num_running=base.num_running,
            num_waiting=base.num_waiting,
            last_batch_size=self.last_batch_size,
            num_steps=self.num_steps,
            queue_wait_s_total=self.queue_wait_s_total,
            num_requests=self.num_requests,
            num_preemptions=base.num_preemptions,
            memory_used_bytes=base.memory_used_bytes,
            memory_total_bytes=base.memory_total_bytes,
        )

    async def close(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)

    # -- the loop ---------------------------------------------------------------------------

    def _ensure_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop_task is not None and self._loop_task.get_loop() is not loop:
            # A core built once and used under a new event loop (the embedded pipeline, one
            # asyncio.run per call): the old loop cancelled its task; its wake event is bound there.
            self._loop_task = None
            self._wake = asyncio.Event()
        if self._loop_task is None or self._loop_task.done():
            # In a context of its own: created from the first request's task, it would log every
            # later step under that request's id (tracing's context variables).
            self._loop_task = loop.create_task(self._run(), name="engine-core", context=contextvars.Context())

    def _leave(self, request: R) -> None:
        """The request is over for its reader: free its room now, its model state before the
        next step (the model thread may be running it right now)."""
        self.scheduler.remove(request)
        self._to_release.append(request)
        self._wake.set()

    async def _run(self) -> None:
        while True:
            self._wake.clear()  # before looking for work: a request added from now on wakes us
            batch = [r for r in self.scheduler.schedule() if not r.cancelled]
            if not batch:
                if self._to_release:
                    await self._release_left()  # nothing to step: free the leavers' state now
                else:
                    await self._wake.wait()
                continue
            now = time.monotonic()
            for r in batch:
                if r.first_scheduled_s is None:
                    r.first_scheduled_s = now
                    self.queue_wait_s_total += r.queue_wait_s
            new = [r for r in batch if r.first_scheduled_s == now]
            left = self._take_left()
            if new and self.runner.admits_first:
                # Their first outputs go out now, not after a batched step (decode: the prefill's
                # token reaches the client one forward pass earlier).
                await self._model_call(new, self._admit, left, new, first=True)
                left = []
                batch = [r for r in batch if not r.finished and not r.cancelled]
                if not batch:
                    continue
            self.last_batch_size = len(batch)
            self.num_steps += 1
            num_waiting = len(self.scheduler.requests()) - len(batch)
            # One model-thread call per step: free who left, step the batch, free who finished.
            calls = self.model_thread.call_threads
            single = calls is not None and calls.narrows(self.lane, len(batch))
            await self._model_call(batch, self._step, left, batch, num_waiting, single=single)

    async def _model_call(
        self,
        batch: list[R],
        fn: Callable[..., list[tuple[R, Any]]],
        *args: Any,
        first: bool = False,
        single: bool = False,
    ) -> None:
        """Run `fn(*args)` on the model thread and deliver the outputs it gives `batch`'s requests.
        first: ahead of the calls queued there (an admission: short, and a client waits for it).
        single: a step on one torch thread (`CallThreads.narrows`), on the last idle model thread."""
        thread = self.model_thread
        run = thread.run_first if first else thread.run_single if single else thread.run_in
        try:
            outputs = await run(self.lane, fn, *args)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - one failed step fails its batch, not the service
            log.exception(
                "a batched step of %d requests failed (request ids %s)",
                len(batch),
                ", ".join(r.request_id for r in batch),
            )
            outputs = [(r, RequestFailed(exc)) for r in batch]
            for r in batch:
                r.finished = True
            self._to_release += [r for r in batch if not r.released]
        # A finished request's state was freed (in `_step`) before its reader sees the end, so
        # a caller that has read everything finds the service's memory already given back.
        last: dict[R, Any] = {}
        for r, out in outputs:
            if r.cancelled:
                continue
            if r.finished:
                last[r] = out
            else:
                r.outputs.put_nowait(out)
        for r in batch:
            if r.finished and not r.cancelled:
                self._finish(r, last.get(r))

    def _admit(self, left: list[R], new: list[R]) -> list[tuple[R, Any]]:
        """On the model thread: release, admit the new requests, release any already finished."""
        self._release(left)
        outputs = self.runner.admit(new)
        for r, out in outputs:
            if isinstance(out, RequestFailed):
                r.finished = True
        self._release([r for r in new if r.finished])
        return outputs

    def _step(self, left: list[R], batch: list[R], num_waiting: int) -> list[tuple[R, Any]]:
        """On the model thread: release, execute, release the finished."""
        self._release(left)
        threads = self.model_thread.threads
        if threads is not None:
            threads.apply(len(batch), num_waiting)
        elif self.model_thread.call_threads is not None:
            self.model_thread.call_threads.narrow_step(self.lane, len(batch))
        try:
            outputs = self.runner.execute(batch)
        except BaseException:
            self._release(batch)  # failed: freed before its readers see the error, as if finished
            raise
        finally:
            if threads is not None:
                threads.done()
        for r, out in outputs:
            if isinstance(out, RequestFailed):
                r.finished = True
        self._release([r for r in batch if r.finished])
        return outputs

    def _release(self, requests: list[R]) -> None:
        for r in requests:
            if not r.released:
                r.released = True
                try:
                    self.runner.release(r)
                except Exception:  # noqa: BLE001 - raised out of the loop, it stopped the core for good
                    # extra: the loop runs under no request's context (the line's id field).
                    log.exception(
                        "freeing the state of request %s failed",
                        r.request_id,
                        extra={"request_id": r.request_id},
                    )

    def _take_left(self) -> list[R]:
        left, self._to_release = self._to_release, []
        return left

    def _finish(self, request: R, last: Any = None) -> None:
        """Deliver the request's last output and the end; its room and state are freed (now, or
        already by the caller)."""
        request.finished = True
        if last is not None:
            request.outputs.put_nowait(last)
        request.outputs.put_nowait(_END)
        self.scheduler.remove(request)
        if not request.released and request not in self._to_release:
            self._to_release.append(request)

    async def _release_left(self) -> None:
        left = [r for r in self._take_left() if not r.released]
        if left:
            await self.model_thread.run_in(self.lane, self._release, left)
