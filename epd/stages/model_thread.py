"""One thread per process runs every model call, so asyncio code never blocks on torch and
requests interleave call by call (torch itself uses `num_threads` inside each call).

Two ways in, one FIFO queue: `await run(fn, ...)` from the event loop, and `call(fn, ...)` from
a request's own driver thread (the encoder's per-request decode driver, `epd.stages.request_pool`),
which blocks that thread, never the loop. A call whose caller was cancelled before the thread
reached it is dropped from the queue, so a gone client costs no further model time.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from epd.model_runtime.threads import StepThreads

T = TypeVar("T")


class ModelThread:
    def __init__(self, threads: StepThreads | None = None) -> None:
        """threads: the torch-threads policy the engine cores apply before each batched step
        (`--num-threads auto` in a service process); None: keep what the loader set."""
        self.threads = threads
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
        self._thread_ident: int | None = None
        self._pool.submit(self._remember_thread).result()

    def _remember_thread(self) -> None:
        self._thread_ident = threading.get_ident()

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run `fn` on the model thread; cancelling the await drops the call if it has not started."""
        loop = asyncio.get_running_loop()
        call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
        return await loop.run_in_executor(self._pool, call)

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run `fn` on the model thread and wait for it, from any other (non-loop) thread."""
        if threading.get_ident() == self._thread_ident:
            raise RuntimeError("ModelThread.call from the model thread itself would wait forever")
        call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
        return self._pool.submit(call).result()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
