"""`ModelThread`: one thread runs every call, in the order they were asked for; a call's error
reaches its own caller and the thread serves on; a caller cancelled before its call started
drops the call; `close` stops the thread, drops what was still queued and waits for the call
running. The schedules' orders (deferred lanes, first calls ahead). With several workers (the colocated server's
`--concurrent-steps`): calls run side by side, a further one waits for a free worker, and one call
at a time stays on one worker.

To hold calls in the queue deterministically, a first call blocks the thread on a
threading.Event until the test opens it. Waits carry a hang guard only.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

import pytest

from epd.stages.model_thread import ModelThread, close_in_turn

HANG_GUARD_S = 30.0


@pytest.fixture
def thread():
    model_thread = ModelThread()
    yield model_thread
    model_thread.close()


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, HANG_GUARD_S))


class Blocker:
    """A call that holds the model thread until `release` is set."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()
        self.returned = threading.Event()

    def __call__(self) -> str:
        self.started.set()
        assert self.release.wait(HANG_GUARD_S), "the blocker was never released"
        self.returned.set()
        return "blocker"

    async def wait_started(self) -> None:
        assert await asyncio.to_thread(self.started.wait, HANG_GUARD_S)


def test_calls_run_in_order_on_one_thread_off_the_loop(thread):
    ran: list[tuple[int, int]] = []

    def record(i: int, *, scale: int) -> int:
        ran.append((i, threading.get_ident()))
        return i * scale

    async def scenario():
        blocker = Blocker()
        held = asyncio.ensure_future(thread.run(blocker))
        await blocker.wait_started()
        calls = [asyncio.ensure_future(thread.run(record, i, scale=10)) for i in range(8)]
        await asyncio.sleep(0)  # all queued behind the blocker
        blocker.release.set()
        return await held, await asyncio.gather(*calls), threading.get_ident()

    held, results, loop_thread = _run(scenario())
    assert held == "blocker"
    assert results == [i * 10 for i in range(8)], "each caller gets its own call's result"
    assert [i for i, _ in ran] == list(range(8)), "FIFO"
    idents = {ident for _, ident in ran}
    assert len(idents) == 1 and loop_thread not in idents


def test_run_and_call_share_the_thread_and_the_queue(thread):
    async def scenario():
        on_loop = await thread.run(threading.get_ident)
        from_driver = await asyncio.to_thread(thread.call, threading.get_ident)
        return on_loop, from_driver

    on_loop, from_driver = _run(scenario())
    assert on_loop == from_driver


def test_a_calls_error_reaches_its_caller_and_the_thread_serves_on(thread):
    def boom(what: str) -> None:
        raise ValueError(f"bad {what}")

    async def scenario():
        ident = await thread.run(threading.get_ident)
        with pytest.raises(ValueError, match="bad tensor"):
            await thread.run(boom, "tensor")
        # Two concurrent callers: only the failing one sees the error.
        results = await asyncio.gather(
            thread.run(boom, "x"), thread.run(lambda: "ok"), return_exceptions=True
        )
        return ident, results, await thread.run(threading.get_ident)

    before, results, after = _run(scenario())
    assert isinstance(results[0], ValueError) and results[1] == "ok"
    assert before == after, "the same thread keeps serving after a failed call"
    with pytest.raises(ValueError, match="bad y"):
        thread.call(boom, "y")  # the blocking entry raises the same way
    assert thread.call(lambda: 7) == 7


def test_cancelling_a_waiting_caller_drops_its_queued_call(thread):
    ran: list[str] = []

    async def scenario():
        blocker = Blocker()
        held = asyncio.ensure_future(thread.run(blocker))
        await blocker.wait_started()
        gone = asyncio.ensure_future(thread.run(ran.append, "gone"))
        kept = asyncio.ensure_future(thread.run(ran.append, "kept"))
        await asyncio.sleep(0)  # both queued behind the blocker
        gone.cancel()  # its client went away before the thread reached its call
        with pytest.raises(asyncio.CancelledError):
            await gone
        blocker.release.set()
        await held
        await kept
        await thread.run(ran.append, "after")

    _run(scenario())
    assert ran == ["kept", "after"]


def test_cancelling_a_running_call_lets_it_finish_and_the_thread_serves_on(thread):
    """A started call cannot be interrupted: the caller stops waiting, the call completes, and
    the next call runs after it (never alongside it)."""
    order: list[str] = []

    async def scenario():
        blocker = Blocker()
        running = asyncio.ensure_future(thread.run(blocker))
        await blocker.wait_started()
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running
        following = asyncio.ensure_future(thread.run(order.append, "next"))
        await asyncio.sleep(0)
        order.append("blocker released")
        blocker.release.set()
        await following

    _run(scenario())
    assert order == ["blocker released", "next"]


def test_close_drops_queued_calls_and_returns_once_the_running_call_and_the_thread_are_done():
    """`close` waits for the running call (a daemon model thread still in a torch call when the
    interpreter finalizes aborts the process: tests/integration/test_clean_exit.py)."""
    thread = ModelThread()
    ran: list[str] = []

    def close_and_look(worker: threading.Thread, blocker: Blocker) -> tuple[bool, bool]:
        thread.close()
        return blocker.returned.is_set(), worker.is_alive()

    async def scenario():
        worker = await thread.run(threading.current_thread)
        blocker = Blocker()
        held = asyncio.ensure_future(thread.run(blocker))
        await blocker.wait_started()
        queued = asyncio.ensure_future(thread.run(ran.append, "queued"))
        await asyncio.sleep(0)
        closing = asyncio.ensure_future(asyncio.to_thread(close_and_look, worker, blocker))
        with pytest.raises(asyncio.CancelledError):
            await queued  # close dropped it, and now waits for the running call
        with pytest.raises(RuntimeError):
            await thread.run(ran.append, "after close")
        blocker.release.set()
        assert await held == "blocker", "the running call still completes"
        return await closing

    call_returned, worker_alive = _run(scenario())
    assert call_returned and not worker_alive, "close returned before the model thread ended"
    assert ran == []
    with pytest.raises(RuntimeError):
        thread.call(ran.append, "after close")


def test_close_without_waiting_and_from_a_call_of_its_own():
    """`close(wait_s=0)` returns at once, the running call finishing after it; a call that closes
    its own pool does not wait for itself."""
    thread = ModelThread()
    blocker = Blocker()
    held = thread._submit("", blocker, (), {})
    assert blocker.started.wait(HANG_GUARD_S)
    thread.close(wait_s=0)
    assert not held.done()
    blocker.release.set()
    assert held.result(HANG_GUARD_S) == "blocker"

    own = ModelThread()
    assert _run(own.run(own.close)) is None
    for worker in own._workers:
        worker.join(HANG_GUARD_S)
        assert not worker.is_alive()


def test_parts_closed_in_turn_share_one_deadline(caplog):
    """`close_in_turn` (an embedded pipeline's and a stage server's close): each part is closed with
    what is left of one bound, so two stuck pools cost one wait, not two; the second, reached with
    nothing left, is still stopped (no further call) and named in a warning. The waits given are
    recorded, not timed."""
    import logging

    pools, blockers = [ModelThread(), ModelThread()], [Blocker(), Blocker()]
    given: list[float] = []

    def closer(pool: ModelThread):
        def close(wait_s: float) -> None:
            given.append(wait_s)
            pool.close(wait_s)

        return close

    try:
        for pool, blocker in zip(pools, blockers, strict=True):
            pool._submit("", blocker, (), {})
            assert blocker.started.wait(HANG_GUARD_S)
        with caplog.at_level(logging.WARNING, logger="epd.stages.model_thread"):
            close_in_turn([closer(p) for p in pools], wait_s=0.2)
        still_held = [not b.returned.is_set() for b in blockers]
    finally:
        for blocker in blockers:
            blocker.release.set()
    assert still_held == [True, True]
    assert 0 < given[0] <= 0.2 and given[1] == 0.0  # the first's wait took all of the bound
    assert sum("still run a call after close" in r.getMessage() for r in caplog.records) == 2
    with pytest.raises(RuntimeError, match="closed"):
        pools[1].call(print)


def _queued_order(
    deferred_lanes: dict[str, float], calls: list[tuple[str, str]], first_calls_ahead: bool = False
) -> list[str]:
    """The order in which `calls` ((lane, label); a label starting "first" goes by `run_first`)
    run when all are queued behind a running call."""
    thread = ModelThread(deferred_lanes=deferred_lanes, first_calls_ahead=first_calls_ahead)
    ran: list[str] = []

    async def scenario():
        blocker = Blocker()
        held = asyncio.ensure_future(thread.run_in("prefill", blocker))
        await blocker.wait_started()
        futures = [
            asyncio.ensure_future(
                (thread.run_first if label.startswith("first") else thread.run_in)(lane, ran.append, label)
            )
            for lane, label in calls
        ]
        await asyncio.sleep(0)  # all queued behind the blocker
        blocker.release.set()
        await held
        await asyncio.gather(*futures)

    try:
        _run(scenario())
    finally:
        thread.close()
    return ran


def test_a_deferred_lane_lets_other_lanes_go_first_until_its_wait_runs_out():
    """`deferred_lanes` (the colocated server's ttft-first schedule): a decode call queued before
    an encode and a prefill call runs after them; with a wait limit already used up (0 s) it
    keeps its place in the arrival order; without deferred lanes the order is strict FIFO."""
    calls = [(lane, lane) for lane in ("decode", "encode", "prefill", "decode")]
    assert _queued_order({"decode": HANG_GUARD_S}, calls) == ["encode", "prefill", "decode", "decode"]
    assert _queued_order({"decode": 0.0}, calls) == ["decode", "encode", "prefill", "decode"]
    assert _queued_order({}, calls) == ["decode", "encode", "prefill", "decode"]


def test_a_deferred_call_alone_in_the_queue_runs_at_once():
    thread = ModelThread(deferred_lanes={"decode": HANG_GUARD_S})
    try:
        assert _run(thread.run_in("decode", lambda: "stepped")) == "stepped"
    finally:
        thread.close()


def test_a_run_first_call_goes_ahead_of_the_queued_calls_whatever_their_lanes():
    """`run_first` (the decode core's admission, which delivers a first token) under
    `first_calls_ahead` (ttft-first): queued after other calls, it runs right after the call that
    is running, behind earlier `run_first` calls only, and a deferred lane does not hold it back;
    the other calls keep their order."""
    calls = [
        ("encode", "encode"),
        ("decode", "first admit"),
        ("prefill", "prefill"),
        ("decode", "first admit 2"),
        ("decode", "decode step"),
    ]
    want = ["first admit", "first admit 2", "encode", "prefill", "decode step"]
    assert _queued_order({}, calls, first_calls_ahead=True) == want
    assert _queued_order({"decode": HANG_GUARD_S}, calls, first_calls_ahead=True) == want


def test_without_first_calls_ahead_a_run_first_call_keeps_its_place_in_the_arrival_order():
    """fifo (the default schedule): an admission waits behind the steps queued before it."""
    calls = [
        ("encode", "encode"),
        ("decode", "first admit"),
        ("prefill", "prefill"),
        ("decode", "decode step"),
    ]
    assert _queued_order({}, calls) == ["encode", "first admit", "prefill", "decode step"]


# -- several workers: calls of different stages side by side (`epd serve --colocate --concurrent-steps`)


def test_two_workers_run_two_calls_at_once_and_a_third_waits_for_a_free_worker():
    pool = ModelThread(workers=2)
    try:

        async def scenario():
            first, second = Blocker(), Blocker()
            a = asyncio.ensure_future(pool.run_in("decode", first))
            b = asyncio.ensure_future(pool.run_in("prefill", second))
            await first.wait_started()
            await second.wait_started()  # both started while neither has returned: side by side
            third = asyncio.ensure_future(pool.run_in("encode", threading.get_ident))
            await asyncio.sleep(0.05)
            assert not third.done(), "a third call ran while both workers were busy"
            second.release.set()
            worker = await third  # it takes the worker the second call left
            first.release.set()
            assert await a == await b == "blocker"
            return worker

        worker = _run(scenario())
        assert worker != threading.get_ident()
    finally:
        pool.close()


def test_with_one_worker_a_second_call_waits_for_the_first():
    pool = ModelThread(workers=1)
    try:

        async def scenario():
            blocker = Blocker()
            held = asyncio.ensure_future(pool.run(blocker))
            await blocker.wait_started()
            other = asyncio.ensure_future(pool.run(lambda: "other"))
            await asyncio.sleep(0.05)
            assert not other.done()
            blocker.release.set()
            return await held, await other

        assert _run(scenario()) == ("blocker", "other")
    finally:
        pool.close()


def test_call_from_any_worker_is_refused_and_close_stops_every_worker():
    pool = ModelThread(workers=2)

    async def scenario():
        return await pool.run(lambda: pool.call(lambda: None))

    with pytest.raises(RuntimeError, match="from a model thread itself would wait forever"):
        _run(scenario())
    pool.close()
    for worker in pool._workers:
        worker.join(HANG_GUARD_S)
        assert not worker.is_alive()


def test_a_pool_needs_a_worker():
    with pytest.raises(ValueError, match="at least one worker"):
        ModelThread(workers=0)


def test_at_low_load_calls_stay_on_the_most_recently_idle_worker():
    """One call at a time (one request in flight): each call wakes the worker that ran the last
    one, not the one idle longest, so torch's thread team of that worker stays warm."""
    pool = ModelThread(workers=3)
    try:

        async def scenario():
            return [await pool.run(threading.get_ident) for _ in range(12)]

        ran_on = _run(scenario())
        assert len(set(ran_on[1:])) == 1, f"sequential calls moved between workers: {ran_on}"
    finally:
        pool.close()


def test_a_call_goes_to_the_first_idle_worker_though_another_worker_comes_back_first():
    """Between setting a call's result and waiting again, a worker is already idle. A call
    submitted then belongs to the first idle worker, not to whichever worker takes the lock first:
    with one shared queue, the second worker, coming back from its own call, took it, and a call
    that ran alone ran on one torch thread beside an idle first worker (`CallThreads`)."""
    pool = ModelThread(workers=2)
    name = lambda: threading.current_thread().name  # noqa: E731
    back = {0: threading.Event(), 1: threading.Event()}  # set: worker i may go back to its loop
    blocker, registered = Blocker(), threading.Event()

    def held_back(worker: int):
        return lambda _future: back[worker].wait(HANG_GUARD_S)  # runs on the worker, after set_result

    try:
        first = pool._submit("", blocker, (), {})
        assert blocker.started.wait(HANG_GUARD_S)
        second = pool._submit("", lambda: (registered.wait(HANG_GUARD_S), name())[1], (), {})
        second.add_done_callback(held_back(1))
        first.add_done_callback(held_back(0))
        registered.set()
        assert second.result(HANG_GUARD_S) == "model_1"
        blocker.release.set()
        assert first.result(HANG_GUARD_S) == "blocker"  # both workers now idle, neither waiting yet
        third = pool._submit("", name, (), {})
        back[1].set()  # the second worker comes back first; it must leave the call alone
        concurrent.futures.wait([third], timeout=0.5)  # time to take it (it did, with one queue)
        back[0].set()
        assert third.result(HANG_GUARD_S) == "model_0"
    finally:
        for event in back.values():
            event.set()
        blocker.release.set()
        pool.close()


def test_a_worker_that_fails_to_start_fails_the_pool_instead_of_hanging_it():
    from epd.model_runtime.threads import CallThreads

    class Broken(CallThreads):
        def worker_started(self, index: int) -> None:
            if index == 1:
                raise OSError("no such thread setting")
            super().worker_started(index)

    raised: list[BaseException] = []

    def build() -> None:
        try:
            ModelThread(workers=2, call_threads=Broken(cores=1))
        except RuntimeError as exc:
            raised.append(exc)

    builder = threading.Thread(target=build, daemon=True)
    builder.start()
    builder.join(HANG_GUARD_S)
    assert not builder.is_alive(), "the constructor waited for a worker that had died"
    assert len(raised) == 1 and "a model thread failed to start: OSError" in str(raised[0])


def test_model_thread_call_runs_there_and_refuses_to_wait_on_itself():
    thread = ModelThread()
    try:
        name = thread.call(lambda: threading.current_thread().name)
        assert name.startswith("model")
        with pytest.raises(RuntimeError, match="would wait forever"):
            thread.call(thread.call, lambda: None)
    finally:
        thread.close()
