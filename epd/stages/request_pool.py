"""A bounded pool of threads for per-request drivers that block (demuxing, waiting for decoded
frames), so neither the event loop nor the model thread ever waits on one request's media.

    await pool.run(drive)   # drive(cancel: threading.Event) -> T, on a pool thread

Admission: at most `max_running` drivers run at once; up to `max_waiting` more wait for a
thread, in arrival order or, under `--scheduling-policy priority`, by their `priority` first
(`epd.stages.scheduling`); beyond that `run` raises Busy (RESOURCE_EXHAUSTED, retry later) with the caller's message (which
names the flags that raise the limits), before any work starts.

Cancellation: when the awaiting task is cancelled (its client went away), `run` sets the
driver's `cancel` event and drops the driver if it is still waiting. A running driver polls the
event at its own safe points and stops there; it keeps its slot until it has actually returned,
so the bound counts the threads really busy, not the requests still wanted.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from epd.stages.errors import Busy
from epd.stages.scheduling import WaitingQueue

T = TypeVar("T")


class RequestPool:
    def __init__(
        self,
        max_running: int,
        max_waiting: int,
        refusal: Callable[[int, int], str],
        thread_name: str = "request",
        thread_initializer: Callable[[], None] | None = None,
        scheduling_policy: str = "fcfs",
    ) -> None:
        """`refusal(num_running, num_waiting)` is the message of the ResourceExhausted raised
        when the pool is full: it should say which flags raise the limits. `thread_initializer`
        runs first on each of the pool's threads."""
        if max_running < 1 or max_waiting < 0:
            raise ValueError(
                f"max_running must be >= 1 and max_waiting >= 0, got {max_running}, {max_waiting}"
            )
        self.max_running = max_running
        self.max_waiting = max_waiting
        self._refusal = refusal
        self._pool = ThreadPoolExecutor(
            max_workers=max_running, thread_name_prefix=thread_name, initializer=thread_initializer
        )
        self._lock = threading.Lock()
        self._num_admitted = 0  # running + waiting; a slot is freed when its driver returns
        self._num_running = 0  # drivers given a thread and not yet returned
        # Each waiter's turn: set (on whichever thread frees a slot) when it may take a thread.
        self._waiting: WaitingQueue[Future[None]] = WaitingQueue(scheduling_policy)
        self.num_cancelled = 0

    @property
    def num_admitted(self) -> int:
        with self._lock:
            return self._num_admitted

    async def run(self, drive: Callable[[threading.Event], T], priority: int = 0) -> T:
        turn: Future[None] = Future()
        with self._lock:
            if self._num_admitted >= self.max_running + self.max_waiting:
                running = min(self._num_admitted, self.max_running)
                raise Busy(self._refusal(running, self._num_admitted - running))
            self._num_admitted += 1
            if self._num_running < self.max_running:
                self._num_running += 1
                turn.set_running_or_notify_cancel()
                turn.set_result(None)
            else:
                self._waiting.push(turn, priority)
        cancel = threading.Event()
        try:
            await asyncio.wrap_future(turn)
        except BaseException:  # cancelled (the client left, or `close`) while waiting for a thread
            turn.cancel()
            if turn.cancelled():
                with self._lock:
                    self._waiting.remove(turn)
                    self._num_admitted -= 1
            else:  # its turn came in the same instant: the thread goes to the next waiter
                self._driver_returned()
            with self._lock:
                self.num_cancelled += 1
            raise
        call = functools.partial(contextvars.copy_context().run, drive, cancel)
        try:
            future = self._pool.submit(call)
        except BaseException:
            self._driver_returned()
            raise
        future.add_done_callback(lambda _: self._driver_returned())
        try:
            # wrap_future: cancelling this await also cancels `future` if it has not started.
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            cancel.set()
            future.cancel()
            with self._lock:
                self.num_cancelled += 1
            raise

    def _driver_returned(self) -> None:
        """A thread is free (its driver returned, or a turn given was not taken): the first waiter
        whose wait was not cancelled gets it. Any thread."""
        with self._lock:
            self._num_admitted -= 1
        while True:
            with self._lock:
                if not self._waiting:
                    self._num_running -= 1
                    return
                turn = self._waiting.pop()
            if turn.set_running_or_notify_cancel():  # False: cancelled, it leaves by itself
                turn.set_result(None)
                return

    def close(self) -> None:
        with self._lock:
            waiting = list(self._waiting)
        for turn in waiting:
            turn.cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)
