"""The model threads of a process: they run every model call, so asyncio code never blocks on
torch and requests interleave call by call (torch itself uses `num_threads` inside each call).

Two ways in, one queue: `await run(fn, ...)` from the event loop, and `call(fn, ...)` from a
request's own driver thread (the encoder's per-request decode driver, `epd.stages.request_pool`),
which blocks that thread, never the loop. A call whose caller was cancelled before a thread
reached it is dropped from the queue, so a gone client costs no further model time.

A service process has one model thread: its one engine core's steps run one after another. One
model serving all three stages (`epd serve --colocate`) has `workers` threads taking calls from
the one queue (`--concurrent-steps`, 2 by default): each engine core awaits its own call before it
asks for the next, so a stage never runs two steps at once, but an encode or prefill step and a
decode step of different requests run side by side. A decode step of a few rows keeps one core
busy with small operations while a prefill step's matrix products want both
(docs/benchmarks.md, "Two steps at once"). A call goes to the first idle worker, the only one
whose calls use more than one torch thread (one OpenMP team a process, `epd.model_runtime.threads`);
a step that runs on one thread (`run_single`) goes to the last. Module hooks that one call registers
on the shared model act only in the thread that registered them (`epd.model_runtime.thread_hooks`).

Calls start in the order they were asked for, unless the owner chose a schedule that favours first
tokens (the colocated server's `--schedule ttft-first`): then a call asked for with `run_first`
(short and urgent: the decode core's admission of a request whose prefill is done, which starts its
decoding, and delivers its first token when prefill's answer could not) goes ahead of every queued
call (`first_calls_ahead`), and a call in a deferred lane (`deferred_lanes`: decode steps) waits
while calls of other lanes are queued, for at most its lane's limit, and then goes ahead of them:
first tokens come sooner and each decode step waits at most the limit — the trade vLLM and SGLang
expose as a scheduling policy. With N requests in flight, time a request does not spend waiting for
its first token it spends decoding, so the time per token rises by as much (docs/benchmarks.md, "The
load's two latencies").

`close()` returns once the threads have ended (the calls they were running done, for up to
`CLOSE_WAIT_S`), and a pool never closed is closed so at interpreter exit (`_close_at_exit`). The
threads are daemons (an idle pool that nobody closed must not hold the process open), and a daemon
thread that asks for the GIL back after the interpreter has begun to finalize is ended by
pthread_exit there; inside a torch call the unwinding runs through torch's C++ frames, whose GIL
guard's destructor may not throw, and the process aborts ("terminate called without an active
exception", SIGABRT). A script that left an answer while its prefill ran and then exited aborted
34 times in 50, `epd ask ... | head` 3 in 10, and one that closed an idle pool and exited at once
2 in 20 (the stopped thread was still on its way out).
"""

from __future__ import annotations

import asyncio
import atexit
import contextvars
import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from epd.model_runtime.threads import CallThreads, StepThreads

T = TypeVar("T")

log = logging.getLogger(__name__)

THREAD_NAME = "model_{}"
"""Worker i is named model_i (py-spy and thread dumps show which call runs where)."""

CLOSE_WAIT_S = 30.0
"""How long `close` (and interpreter exit) waits for the calls still running by default: a model
step takes seconds at most; a call that runs longer is stuck, and the caller goes on without it.
A service's whole close after its drain gets the same by default, its own setting
(`ServerConfig.close_timeout_s`, `--close-timeout-s`)."""


def close_in_turn(closers: Sequence[Callable[[float], object]], wait_s: float = CLOSE_WAIT_S) -> None:
    """Close the parts of one owner (an embedded pipeline, a stage server after its drain) in
    order, each `close(wait_s)` given what is left of one deadline `wait_s` from now: the whole
    close takes at most `wait_s`, where each part's own bound one after another added up (an
    embedded pipeline's encoder 5 s, tokenizer threads 30 s and model threads 30 s: 65 s). A part
    reached with nothing left is still stopped (`close(0)`: queued work cancelled, nothing waited
    for), and each part names its threads still running in a warning. It joins threads: not on
    the event loop."""
    deadline_s = time.monotonic() + wait_s
    for close in closers:
        close(max(0.0, deadline_s - time.monotonic()))


_open_pools: set[ModelThread] = set()
"""Pools not closed yet, which `_close_at_exit` closes (the threads hold their pool alive anyway)."""
_open_pools_lock = threading.Lock()


@dataclass
class _Call:
    fn: Callable[[], Any]
    future: Future
    lane: str
    first: bool = False
    """Goes ahead of every queued call that is not `first` (`run_first` under `first_calls_ahead`)."""
    queued_s: float = field(default_factory=time.monotonic)


class ModelThread:
    def __init__(
        self,
        threads: StepThreads | None = None,
        deferred_lanes: Mapping[str, float] | None = None,
        first_calls_ahead: bool = False,
        workers: int = 1,
        call_threads: CallThreads | None = None,
    ) -> None:
        """threads: the torch-threads policy the engine cores apply before each batched step
        (`--num-threads auto` in a service process); None: keep what the loader set.
        deferred_lanes: lane -> longest seconds a call of that lane lets other lanes' calls go
        first (see the module docstring); empty: none is deferred.
        first_calls_ahead: `run_first` calls go ahead of the queued calls; False: they take their
        place in the arrival order like any other call.
        workers: threads taking calls from the queue; more than one only where the callers are
        engine cores of different stages sharing one model (see the module docstring).
        call_threads: torch threads set before every call, from the calls running at once (the
        colocated server under `--num-threads auto`); None: the engine cores' `threads`, or the
        loader's setting."""
        if workers < 1:
            raise ValueError(f"a model thread pool needs at least one worker, got {workers}")
        self.threads = threads
        self.deferred_lanes = dict(deferred_lanes or {})
        self.first_calls_ahead = first_calls_ahead
        self.call_threads = call_threads
        self._queue: list[_Call] = []
        """Calls that came while every worker was busy; the next worker to finish takes one."""
        self._lock = threading.Lock()
        self._idle: dict[int, threading.Condition] = {}
        """Idle workers' wake-ups by worker index: a new call is handed to the lowest, so a call
        that runs alone runs on the first worker (and its warm OpenMP team: the only one that runs
        calls on more than one thread, `CallThreads`); a `run_single` call to the highest."""
        self._handed: dict[int, _Call] = {}
        """Calls handed to an idle worker, by its index: only that worker takes it. A shared queue
        alone let another worker that had just finished a call, and was not yet waiting, take the
        call meant for the first worker: a call that ran alone then ran on one torch thread."""
        self._closed = False
        self._workers = [
            threading.Thread(target=self._work, args=(i,), name=THREAD_NAME.format(i), daemon=True)
            for i in range(workers)
        ]
        self._started = threading.Semaphore(0)
        self._start_error: BaseException | None = None
        with _open_pools_lock:
            _open_pools.add(self)
        for worker in self._workers:
            worker.start()
        for _ in self._workers:  # every worker idle (its torch threads set): the first call goes to the first
            self._started.acquire()
        if self._start_error is not None:
            self.close()
            raise RuntimeError(
                f"a model thread failed to start: {self._start_error!r}"
            ) from self._start_error

    @property
    def num_workers(self) -> int:
        return len(self._workers)

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run `fn` on the model thread; cancelling the await drops the call if it has not started."""
        return await self.run_in("", fn, *args, **kwargs)

    async def run_in(self, lane: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`run`, as a call of `lane` (an engine core's stage name)."""
        future = self._submit(lane, fn, args, kwargs)
        return await asyncio.wrap_future(future)

    async def run_first(self, lane: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`run_in`, and under `first_calls_ahead` ahead of every queued call (after the one running
        and any other `run_first` calls), whatever the lanes' deferral: for calls of a few
        milliseconds whose result a client is waiting for (a first token), never for a model step."""
        future = self._submit(lane, fn, args, kwargs, first=self.first_calls_ahead)
        return await asyncio.wrap_future(future)

    async def run_single(self, lane: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`run_in`, for a call that runs on one torch thread (`CallThreads.narrows`): it takes the
        last idle model thread, which leaves the first free for a call that uses more."""
        future = self._submit(lane, fn, args, kwargs, last_worker=True)
        return await asyncio.wrap_future(future)

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run `fn` on a model thread and wait for it, from any other (non-loop) thread."""
        if any(threading.get_ident() == worker.ident for worker in self._workers):
            raise RuntimeError("ModelThread.call from a model thread itself would wait forever")
        return self._submit("", fn, args, kwargs).result()

    def close(self, wait_s: float = CLOSE_WAIT_S) -> None:
        """Stop the threads after the calls they are running, and wait for them to end, for at most
        `wait_s` (0: do not wait); calls still queued are cancelled, and threads still running a
        call then are named in a warning. Idempotent. From the event loop it blocks the loop while a
        call runs: `EmbeddedPipeline.aclose` calls it off the loop."""
        self._stop()
        self._join(time.monotonic() + wait_s)

    def _stop(self) -> None:
        with _open_pools_lock:
            _open_pools.discard(self)
        with self._lock:
            self._closed = True
            dropped, self._queue = [*self._queue, *self._handed.values()], []
            self._handed.clear()
            for wake in self._idle.values():
                wake.notify()
        for c in dropped:
            c.future.cancel()

    def _join(self, deadline_s: float) -> None:
        """Wait until `deadline_s` (time.monotonic()) for the workers to end; a worker closing its
        own pool (from a call) is not waited for."""
        me = threading.current_thread()
        for worker in self._workers:
            if worker is not me and worker.ident is not None:
                worker.join(max(0.0, deadline_s - time.monotonic()))
        with self._lock:  # an idle worker told to stop but not yet awake runs no call (a 0 s close)
            running = [
                w.name
                for i, w in enumerate(self._workers)
                if w.is_alive() and w is not me and i not in self._idle
            ]
        if running:
            log.warning(
                "model threads %s still run a call after close; a process that exits now may abort",
                ", ".join(running),
            )

    # -- the thread --------------------------------------------------------------------------

    def _submit(
        self,
        lane: str,
        fn: Callable[..., T],
        args: tuple,
        kwargs: dict,
        first: bool = False,
        last_worker: bool = False,
    ) -> Future:
        future: Future = Future()
        call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
        with self._lock:
            if self._closed:
                raise RuntimeError("the model thread is closed")
            if self._idle:  # the queue is empty: a worker is idle only while there is no call
                index = max(self._idle) if last_worker else min(self._idle)
                self._handed[index] = _Call(call, future, lane, first=first)
                self._idle.pop(index).notify()
            elif first:  # behind the other first calls, ahead of the rest
                at = next((i for i, c in enumerate(self._queue) if not c.first), len(self._queue))
                self._queue.insert(at, _Call(call, future, lane, first=True))
            else:
                self._queue.append(_Call(call, future, lane))
        return future

    def _next(self) -> _Call | None:
        """The call to run now (under the lock): a first call, else the oldest not deferred, else the oldest."""
        if not self.deferred_lanes or self._queue[0].first:
            return self._queue.pop(0)
        now = time.monotonic()
        for i, c in enumerate(self._queue):
            limit_s = self.deferred_lanes.get(c.lane)
            if limit_s is None or now - c.queued_s >= limit_s:
                return self._queue.pop(i)
        return self._queue.pop(0)

    def _work(self, index: int) -> None:
        policy = self.call_threads or self.threads
        try:
            if policy is not None:
                policy.worker_started(index)
        except BaseException as exc:  # noqa: BLE001 - the constructor raises it; no call may wait for this thread
            self._start_error = exc
            self._started.release()
            return
        wake = threading.Condition(self._lock)
        with self._lock:
            self._idle[index] = wake
        self._started.release()
        while True:
            with self._lock:
                while index not in self._handed and not self._queue and not self._closed:
                    self._idle[index] = wake
                    wake.wait()
                self._idle.pop(index, None)
                if self._closed:
                    return
                call = self._handed.pop(index, None) or self._next()
            if call is None or not call.future.set_running_or_notify_cancel():
                continue  # its caller was cancelled while it waited
            if self.call_threads is not None:
                self.call_threads.enter(index)
            try:
                result, error = call.fn(), None
            except BaseException as exc:  # noqa: BLE001 - the caller gets it; the thread serves on
                result, error = None, exc
            if self.call_threads is not None:
                self.call_threads.exit()  # before the caller learns the call is over
            with self._lock:
                # Idle before the caller learns the call is over (unless calls are queued: this
                # thread takes the next), so that the caller's next call, submitted at once, is
                # handed to this thread. If it comes before this thread waits, its wake-up finds no
                # waiter, but the thread sees the handed call when it takes the lock again.
                if not self._queue:
                    self._idle[index] = wake
            if error is None:
                call.future.set_result(result)
            else:
                call.future.set_exception(error)


@atexit.register
def _close_at_exit() -> None:
    """Close every pool nobody closed (the embedded pipeline of `epd ask`, a script's), all at
    once, and wait for their running calls together: `CLOSE_WAIT_S` in all. atexit handlers run
    before the interpreter finalizes, while the threads can still finish their calls and return."""
    with _open_pools_lock:
        pools = list(_open_pools)
    for pool in pools:
        pool._stop()
    deadline_s = time.monotonic() + CLOSE_WAIT_S
    for pool in pools:
        pool._join(deadline_s)
