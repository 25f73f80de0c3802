"""The thread that compiles structured-output constraints (`GrammarCompiler` in
`epd.model_runtime.structured_output` makes them: a new one when a compile runs past its deadline,
since xgrammar's compile cannot be stopped)."""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")

COMPILE_THREAD_NAME = "grammar_compile"
"""The thread that compiles constraints (py-spy and thread dumps show it)."""


class CompileThread:
    """One daemon thread that runs the compiles submitted to it in turn (what this compiler took
    from a `ThreadPoolExecutor(1)`: `submit`, `shutdown`). A daemon, as the model threads are: a
    compile cannot be stopped, and a `ThreadPoolExecutor`'s thread is joined at interpreter exit
    for as long as its compile runs (`epd ask` with a pathological regex waited minutes to exit
    after its error); a compiler's close waits for its compiles within its owner's deadline, and
    an open compiler's compiles are waited for at exit for at most `EXIT_WAIT_S` (`_close_at_exit`)."""

    def __init__(self) -> None:
        self.name = f"{COMPILE_THREAD_NAME}_{next(_thread_numbers)}"
        self._queue: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._shut = False
        self._thread: threading.Thread | None = None  # started at the first submit

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        future: Future[T] = Future()
        with self._lock:
            if self._shut:
                raise RuntimeError("cannot compile after the compiler closed")
            self._queue.put((future, fn))
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name=self.name, daemon=True)
                self._thread.start()
        return future

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            future, fn = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn()
            except BaseException as exc:  # noqa: BLE001 - the caller's, through its future
                future.set_exception(exc)
            else:
                future.set_result(result)

    def shutdown(self) -> None:
        """Take nothing more; the compiles queued are cancelled, the running one goes on to its end
        (the thread then ends). It does not wait (`join`)."""
        with self._lock:
            self._shut = True
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].cancel()
        self._queue.put(None)

    @property
    def running(self) -> bool:
        """Started and not ended (a compile, or waiting for the next)."""
        return self._thread is not None and self._thread.is_alive()

    def join(self, timeout_s: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout_s)


_thread_numbers = itertools.count()
