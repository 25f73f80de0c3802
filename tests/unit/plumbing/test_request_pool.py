"""`RequestPool` admission: up to `max_running` drivers run at once, up to `max_waiting` more
wait for a thread, and the next request is refused with ResourceExhausted before any of its
work starts; slots come back when drivers return, however they end.

(test_request_pool_bounds_running_and_waiting_and_names_the_flags covers 1 running + 1 waiting
and cancelling a waiter.)
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from epd.stages.errors import ResourceExhausted
from epd.stages.request_pool import RequestPool

HANG_GUARD_S = 30.0


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, HANG_GUARD_S))


class Drivers:
    """Drivers that report when they start and hold their thread until released."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.started: list[str] = []
        self.num_running = 0
        self.max_seen_running = 0
        self.release = threading.Event()
        self.changed = threading.Condition(self.lock)

    def make(self, name: str):
        def drive(cancel: threading.Event) -> str:
            with self.lock:
                self.started.append(name)
                self.num_running += 1
                self.max_seen_running = max(self.max_seen_running, self.num_running)
                self.changed.notify_all()
            try:
                assert self.release.wait(HANG_GUARD_S), "never released"
                return name
            finally:
                with self.lock:
                    self.num_running -= 1

        return drive

    def _wait_started(self, n: int) -> bool:
        with self.changed:
            return self.changed.wait_for(lambda: len(self.started) >= n, HANG_GUARD_S)

    async def wait_started(self, n: int) -> None:
        assert await asyncio.to_thread(self._wait_started, n), f"{n} drivers never started"


@pytest.mark.parametrize(("max_running", "max_waiting"), [(1, 0), (2, 0), (2, 3)])
def test_admits_up_to_running_plus_waiting_and_refuses_the_next(max_running, max_waiting):
    refusals: list[tuple[int, int]] = []

    def refusal(running: int, waiting: int) -> str:
        refusals.append((running, waiting))
        return f"busy ({running} running, {waiting} waiting): raise --max-running"

    pool = RequestPool(max_running, max_waiting, refusal)
    drivers = Drivers()
    capacity = max_running + max_waiting
    refused_ran: list[bool] = []

    async def scenario():
        admitted = [asyncio.ensure_future(pool.run(drivers.make(f"r{i}"))) for i in range(capacity)]
        await asyncio.sleep(0)  # admission happens before the first await inside run
        assert pool.num_admitted == capacity
        await drivers.wait_started(max_running)
        with pytest.raises(ResourceExhausted, match=r"raise --max-running"):
            await pool.run(lambda cancel: refused_ran.append(True))
        assert pool.num_admitted == capacity, "a refusal takes no slot"
        drivers.release.set()
        return await asyncio.gather(*admitted)

    results = _run(scenario())
    assert results == [f"r{i}" for i in range(capacity)]
    assert refusals == [(max_running, max_waiting)]
    assert sorted(drivers.started) == sorted(results)
    assert set(drivers.started[:max_running]) == {f"r{i}" for i in range(max_running)}, (
        "no waiter jumped ahead"
    )
    assert drivers.max_seen_running == max_running
    assert refused_ran == [], "the refused driver never ran"
    assert pool.num_admitted == 0
    pool.close()


def test_a_failing_driver_raises_in_its_caller_and_frees_its_slot():
    pool = RequestPool(1, 0, lambda r, w: "full")

    def failing(cancel: threading.Event) -> None:
        raise OSError("demux failed")

    async def scenario():
        with pytest.raises(OSError, match="demux failed"):
            await pool.run(failing)
        assert pool.num_admitted == 0
        return await pool.run(lambda cancel: "next")

    assert _run(scenario()) == "next"
    pool.close()


def test_a_cancelled_running_driver_is_told_and_keeps_its_slot_until_it_returns():
    pool = RequestPool(1, 0, lambda r, w: "full: raise --max-running")
    saw_cancel = threading.Event()
    started = threading.Event()
    finish = threading.Event()

    def drive(cancel: threading.Event) -> str:
        started.set()
        if cancel.wait(HANG_GUARD_S):
            saw_cancel.set()
        assert finish.wait(HANG_GUARD_S)
        return "stopped"

    async def scenario():
        task = asyncio.ensure_future(pool.run(drive))
        assert await asyncio.to_thread(started.wait, HANG_GUARD_S)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await asyncio.to_thread(saw_cancel.wait, HANG_GUARD_S), "the driver saw its cancel flag"
        # Still running on its thread: the bound counts it.
        with pytest.raises(ResourceExhausted, match="raise --max-running"):
            await pool.run(lambda cancel: "too early")
        finish.set()
        while pool.num_admitted:  # the slot is freed from the driver's thread when it returns
            await asyncio.sleep(0.01)
        return await pool.run(lambda cancel: "after")

    assert _run(scenario()) == "after"
    assert pool.num_cancelled == 1
    pool.close()


@pytest.mark.parametrize(("max_running", "max_waiting"), [(0, 1), (1, -1)])
def test_impossible_limits_are_refused(max_running, max_waiting):
    with pytest.raises(ValueError, match="max_running must be >= 1"):
        RequestPool(max_running, max_waiting, lambda r, w: "")


def test_request_pool_bounds_running_and_waiting_and_names_the_flags():
    pool = RequestPool(1, 1, lambda running, waiting: f"{running} running, {waiting} waiting: raise --max-x")
    release = threading.Event()
    ran: list[str] = []

    def driver(name: str):
        def drive(cancel: threading.Event) -> str:
            ran.append(name)
            assert release.wait(HANG_GUARD_S)
            return name

        return drive

    async def scenario():
        first = asyncio.ensure_future(pool.run(driver("first")))
        waiting = asyncio.ensure_future(pool.run(driver("waiting")))
        await asyncio.sleep(0)  # both admitted
        with pytest.raises(ResourceExhausted, match="1 running, 1 waiting: raise --max-x"):
            await pool.run(driver("refused"))
        waiting.cancel()  # its client went away while it waited: it never runs
        with pytest.raises(asyncio.CancelledError):
            await waiting
        release.set()
        assert await first == "first"
        assert await pool.run(driver("after")) == "after"

    asyncio.run(scenario())
    assert ran == ["first", "after"]
    assert pool.num_admitted == 0 and pool.num_cancelled == 1
    pool.close()
