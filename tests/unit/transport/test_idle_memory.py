"""A serving process's free memory back to the system once idle (epd/transport/idle_memory.py): the
tick bookkeeping on made-up CPU times, and the release call of each allocator on a real process.
The servers themselves: tests/integration/test_memory_after_request.py."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from epd.cli.allocator import find_tcmalloc
from epd.transport.idle_memory import IdleRelease, release_when_idle
from tests.stack import ROOT, child_env

TICK_S = 0.5
BUSY = 0.2  # CPU seconds in one tick: 40% of a core
QUIET = 0.01  # 2% of a core: health checks


def ticks(*cpu_per_tick: float) -> list[bool]:
    bookkeeping, total, out = IdleRelease(tick_s=TICK_S), 0.0, []
    bookkeeping.observe(total)
    for used in cpu_per_tick:
        total += used
        out.append(bookkeeping.observe(total))
    return out


def test_released_once_at_the_first_idle_tick_after_work():
    assert ticks(BUSY, BUSY, QUIET, QUIET, QUIET) == [False, False, True, False, False]


def test_never_while_busy_nor_while_idle_without_work_in_between():
    assert ticks(BUSY, BUSY, BUSY, BUSY) == [False] * 4
    assert ticks(QUIET, 0.0, QUIET) == [False] * 3
    assert ticks(BUSY, QUIET, QUIET, BUSY, 0.0) == [False, True, False, False, True]


def test_the_idle_line_is_a_fraction_of_one_core():
    line = 0.05 * TICK_S
    assert ticks(BUSY, line * 0.9) == [False, True]
    assert ticks(BUSY, line * 1.1) == [False, False]


def test_the_loop_releases_through_the_given_call():
    """Counted in ticks, not seconds: the scenario ends after the loop's sixth CPU reading (its
    first, a busy tick, then four idle ones). A wall-clock wait (0.2 s for ticks of 10 ms) lost
    under load: a process scheduled out past both deadlines woke to the test's before the loop's
    third tick, and the loop was cancelled before it had seen an idle tick."""
    readings = [0.0, *[1.0] * 5]  # busy for the first tick (0 -> 1 s), idle (no more CPU) from then on

    async def scenario() -> int:
        released: list[int] = []
        read_all = asyncio.Event()

        def cpu_s() -> float:
            reading = readings.pop(0)
            if not readings:
                read_all.set()  # this tick still completes: the loop sees the event at its next wait
            return reading

        task = asyncio.ensure_future(release_when_idle(lambda: released.append(1), tick_s=0.001, cpu_s=cpu_s))
        # a guard against a broken loop that never reads, not a timing assertion
        await asyncio.wait_for(read_all.wait(), timeout=60)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert task.cancelled(), "the loop ended on its own"
        return len(released)

    assert asyncio.run(scenario()) == 1  # busy, then idle for four ticks: released once


FREED_MB = 192
CODE = f"""
import torch
from epd.transport.idle_memory import allocator_release

def rss_mb():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) // 1024 for line in f if line.startswith("VmRSS:"))

warm = torch.ones(4 << 20)  # 16 MB; freed, it raises glibc's mmap threshold to its size
del warm
blocks = [torch.ones(4 << 20) for _ in range({FREED_MB} // 16 + 1)]
last = blocks.pop()  # kept: glibc's heap cannot shrink from its top
del blocks
held = rss_mb()
allocator_release()()
print(held - rss_mb())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and glibc are Linux's")
@pytest.mark.parametrize("allocator", ["glibc", "tcmalloc"])
def test_the_release_call_gives_freed_tensors_back(allocator):
    """The allocator keeps 192 MB of freed tensors (glibc: heap chunks below a live one; tcmalloc:
    its page heap); the release call returns most of them."""
    env = child_env()
    env.pop("LD_PRELOAD", None)
    if allocator == "tcmalloc":
        if (library := find_tcmalloc()) is None:
            pytest.skip("no tcmalloc on this machine (libtcmalloc-minimal4)")
        env["LD_PRELOAD"] = library
    proc = subprocess.run(
        [sys.executable, "-c", CODE], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stdout.split()[-1]) >= FREED_MB // 2, proc.stdout
