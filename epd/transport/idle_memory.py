"""A serving process hands its allocator's free memory back to the system once it goes idle.

An allocator keeps freed memory for reuse: tcmalloc (`epd serve --allocator`, the default where it
is installed) keeps the spans of freed tensors in its page heap, glibc's malloc the free chunks of
its arenas. Under load that reuse is the point. After a large request it left the encoder 37%
above its idle size on tcmalloc (508 -> 696 MiB after a 64-frame 720p request,
tests/integration/test_memory_after_request.py), against the rule that memory returns to its idle
level after a request. So once the process has used under 5% of one core for a whole tick (0.5 s)
after a busier one, it releases its free memory once: tcmalloc's `MallocExtension_ReleaseFreeMemory`,
glibc's `malloc_trim(0)`. A busy process never does (no page faults added under load), nor does one
that serves requests back to back (no idle tick between them); one that sits idle does it once.

`IdleRelease` is the bookkeeping alone (unit-tested on made-up CPU times); `release_when_idle` runs
it on the event loop of every serving process (`epd.transport.server.serve_until_signal`).
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

TICK_S = 0.5
IDLE_CORE_FRACTION = 0.05
"""A tick whose process CPU time is under this fraction of one core is idle (the gateway's health
and load polls cost a few ms a second)."""


@dataclass
class IdleRelease:
    """Decides, tick by tick, when to release: at the first idle tick after a busy one."""

    tick_s: float = TICK_S
    idle_core_fraction: float = IDLE_CORE_FRACTION
    _last_cpu_s: float | None = None
    _busy_since_release: bool = False

    def observe(self, cpu_s: float) -> bool:
        """The process's CPU seconds so far, read once a tick; True: release now."""
        last, self._last_cpu_s = self._last_cpu_s, cpu_s
        if last is None:
            return False
        if cpu_s - last > self.idle_core_fraction * self.tick_s:
            self._busy_since_release = True
            return False
        released, self._busy_since_release = self._busy_since_release, False
        return released


def allocator_release() -> Callable[[], None] | None:
    """The running allocator's "give free memory back" call: tcmalloc's when it is loaded (preloaded
    into the global namespace), else glibc's; None if neither (another libc)."""
    process = ctypes.CDLL(None)
    for name in ("MallocExtension_ReleaseFreeMemory", "malloc_trim"):
        try:
            function = getattr(process, name)
        except AttributeError:
            continue
        if name == "malloc_trim":
            function.argtypes = [ctypes.c_size_t]
            return lambda: function(0)
        function.argtypes = []
        return function
    return None


async def release_when_idle(
    release: Callable[[], None] | None = None,
    tick_s: float = TICK_S,
    cpu_s: Callable[[], float] = time.process_time,
) -> None:
    """Until cancelled: every `tick_s`, release free memory if the process just went idle."""
    release = release or allocator_release()
    if release is None:
        return
    bookkeeping = IdleRelease(tick_s=tick_s)
    while True:
        await asyncio.sleep(tick_s)
        if bookkeeping.observe(cpu_s()):
            started = time.perf_counter()
            release()
            log.debug("idle: free memory released in %.1f ms", (time.perf_counter() - started) * 1e3)
