"""`--scheduling-policy priority` (vLLM's): every queue a request waits in serves it by
`(priority, arrival)`, lower priority first; under fcfs by arrival, and a non-zero priority is
refused. Each stage's queue is checked here without a model: the shared `WaitingQueue`, prefill's
prompts, encoder's tower jobs and request drivers, decode's wait for KV room; and the policy's way
to the front door (ModelInfo) and into the configs from the command line."""

from __future__ import annotations

import asyncio
import threading

import pytest

from epd.decode_svc.config import DecodeConfig
from epd.decode_svc.kv_memory import KvMemory
from epd.encoder_svc.scheduler import EncodeScheduler, TowerJob
from epd.model_runtime.sampling import GenerationConfig
from epd.prefill_svc.config import PrefillSchedulerConfig
from epd.prefill_svc.scheduler import PrefillRequest, PrefillScheduler
from epd.stages.contracts import check_generation_limits, check_request_priority
from epd.stages.errors import Busy, InvalidRequest
from epd.stages.model_info import ModelInfo, common_model_info
from epd.stages.request_pool import RequestPool
from epd.stages.scheduling import PRIORITY_MAX, PRIORITY_MIN, WaitingQueue, check_priority

HANG_GUARD_S = 30.0


def _queue(policy: str, items: list[tuple[str, int]]) -> WaitingQueue[str]:
    q: WaitingQueue[str] = WaitingQueue(policy)
    for name, priority in items:
        q.push(name, priority)
    return q


ARRIVALS = [("a", 5), ("b", 0), ("c", 5), ("d", -3), ("e", 0)]


def test_priority_orders_by_priority_then_arrival_and_fcfs_by_arrival_alone():
    assert list(_queue("priority", ARRIVALS)) == ["d", "b", "e", "a", "c"]
    assert list(_queue("fcfs", ARRIVALS)) == ["a", "b", "c", "d", "e"]


def test_pop_peek_and_remove_keep_the_order():
    q = _queue("priority", ARRIVALS)
    assert q.peek() == "d" and q.pop() == "d" and len(q) == 4
    assert q.remove("e") and not q.remove("e") and "e" not in q
    q.push("f", 0)  # arrives after a and c, ahead of them by priority
    assert [q.pop() for _ in range(len(q))] == ["b", "f", "a", "c"]
    assert not q
    with pytest.raises(IndexError):
        q.pop()


def test_an_unknown_policy_is_refused_naming_the_flag():
    with pytest.raises(ValueError, match="--scheduling-policy must be one of fcfs, priority"):
        WaitingQueue("lifo")
    with pytest.raises(ValueError, match="--scheduling-policy"):
        DecodeConfig(scheduling_policy="sjf")
    with pytest.raises(ValueError, match="--scheduling-policy"):
        PrefillSchedulerConfig(scheduling_policy="")


def test_fcfs_refuses_a_nonzero_priority_saying_how_to_enable_it():
    check_priority(0, "fcfs")
    check_priority(-7, "priority")
    with pytest.raises(
        ValueError, match="start it with --scheduling-policy priority, or leave priority unset"
    ):
        check_priority(1, "fcfs")
    with pytest.raises(InvalidRequest, match="--scheduling-policy priority"):
        check_request_priority(-1, "fcfs")
    with pytest.raises(InvalidRequest, match="--scheduling-policy priority"):  # prefill's and decode's check
        check_generation_limits(GenerationConfig(priority=2), 32, scheduling_policy="fcfs")
    check_generation_limits(GenerationConfig(priority=2), 32, scheduling_policy="priority")
    for priority in (PRIORITY_MIN - 1, PRIORITY_MAX + 1):
        with pytest.raises(InvalidRequest, match="priority must be an integer from"):
            check_request_priority(priority, "priority")


# -- prefill ---------------------------------------------------------------------------------


def _prompt(name: str, tokens: int, priority: int = 0) -> PrefillRequest:
    return PrefillRequest(name, priority=priority, num_prompt_tokens=tokens)


def _names(requests) -> list[str]:
    return [r.request_id for r in requests]


def test_prefill_schedules_waiting_prompts_by_priority_and_never_preempts_a_started_one():
    config = PrefillSchedulerConfig(
        max_prefill_tokens_per_step=100, prefill_chunk_tokens=100, scheduling_policy="priority"
    )
    s = PrefillScheduler(config)
    long = _prompt("long", 250, priority=9)  # chunked: 3 steps
    s.add(long)
    assert _names(s.schedule()) == ["long"]
    long.step_done()
    for r in (_prompt("low", 60, 5), _prompt("mid", 60, 0), _prompt("high", 30, -1)):
        s.add(r)
    # the started prompt keeps its chunk (its KV would be recomputed); the rest by priority
    assert _names(s.schedule()) == ["long"]
    long.step_done()
    step = s.schedule()  # long's last 50 tokens, then the highest waiting (30) fits; mid (60) does not
    assert _names(step) == ["long", "high"]
    assert _names(s.waiting) == ["mid", "low"]


def test_prefill_under_fcfs_keeps_arrival_order():
    s = PrefillScheduler(PrefillSchedulerConfig(max_prefill_tokens_per_step=100, prefill_chunk_tokens=100))
    for r in (_prompt("a", 60, 0), _prompt("b", 60, 0)):
        s.add(r)
    s.add(PrefillRequest("c", num_prompt_tokens=30))
    assert _names(s.schedule()) == ["a"], "b does not fit the rest of the step and blocks c (arrival order)"


# -- encoder ---------------------------------------------------------------------------------


def test_the_tower_takes_waiting_frame_groups_by_their_requests_priority():
    s = EncodeScheduler(max_patches_per_step=20, max_waiting_jobs=8, scheduling_policy="priority")
    for name, priority in (("low", 3), ("low2", 3), ("high", -2)):
        s.add(TowerJob(name, priority=priority, num_patches=10))
    assert _names(s.schedule()) == ["high", "low"]
    fifo = EncodeScheduler(max_patches_per_step=20, max_waiting_jobs=8)
    for name, priority in (("low", 3), ("low2", 3), ("high", -2)):
        fifo.add(TowerJob(name, priority=priority, num_patches=10))
    assert _names(fifo.schedule()) == ["low", "low2"]


def _held_driver(started: list[str], release: threading.Event):
    """`driver(name)`: a driver that records its start; "holder" keeps its thread until `release`."""

    def driver(name: str):
        def drive(cancel: threading.Event) -> str:
            started.append(name)
            if name == "holder":
                assert release.wait(HANG_GUARD_S)
            return name

        return drive

    return driver


@pytest.mark.parametrize(
    ("policy", "expected"), [("priority", ["high", "w1", "w2"]), ("fcfs", ["w1", "w2", "high"])]
)
def test_requests_waiting_for_a_driver_thread_start_in_the_policys_order(policy, expected):
    """One driver thread, held; three requests wait for it (the last one of high priority)."""
    pool = RequestPool(1, 3, lambda running, waiting: "full", scheduling_policy=policy)
    release = threading.Event()
    started: list[str] = []
    driver = _held_driver(started, release)

    async def scenario() -> None:
        holder = asyncio.ensure_future(pool.run(driver("holder")))
        while started != ["holder"]:
            await asyncio.sleep(0.01)
        waiters = [
            asyncio.ensure_future(pool.run(driver(name), priority))
            for name, priority in (("w1", 1), ("w2", 1), ("high", -1))
        ]
        await asyncio.sleep(0)
        assert pool.num_admitted == 4
        release.set()
        assert await holder == "holder"
        await asyncio.gather(*waiters)
        assert pool.num_admitted == 0

    try:
        asyncio.run(asyncio.wait_for(scenario(), HANG_GUARD_S))
    finally:
        pool.close()
    assert started == ["holder", *expected]


def test_a_cancelled_waiter_gives_its_turn_to_the_next():
    pool = RequestPool(1, 2, lambda running, waiting: "full", scheduling_policy="priority")
    release = threading.Event()
    started: list[str] = []
    driver = _held_driver(started, release)

    async def scenario() -> None:
        holder = asyncio.ensure_future(pool.run(driver("holder")))
        while not started:
            await asyncio.sleep(0.01)
        high = asyncio.ensure_future(pool.run(driver("high"), -5))
        low = asyncio.ensure_future(pool.run(driver("low"), 5))
        await asyncio.sleep(0)
        high.cancel()
        with pytest.raises(asyncio.CancelledError):
            await high
        assert pool.num_admitted == 2
        release.set()
        assert [await holder, await low] == ["holder", "low"]
        assert pool.num_admitted == 0

    try:
        asyncio.run(asyncio.wait_for(scenario(), HANG_GUARD_S))
    finally:
        pool.close()
    assert started == ["holder", "low"]


# -- decode ----------------------------------------------------------------------------------


def _granted_order(
    policy: str, arrivals: list[tuple[str, int, int]], free_first: str = "holder"
) -> list[str]:
    """A budget of 100 tokens (1 byte each), held by `free_first` (100 tokens); `arrivals` (name,
    final length, priority) wait in order; then the holder frees its room, and each request frees
    its own as soon as it is granted: the order they got room."""
    memory = KvMemory(100, 1, max_running=4, max_waiting=8, scheduling_policy=policy)
    granted: list[str] = []

    async def one(name: str, length: int, priority: int) -> None:
        await memory.reserve(name, length, priority)
        granted.append(name)
        await asyncio.sleep(0)
        memory.free(name)

    async def scenario() -> None:
        await memory.reserve(free_first, 100)
        tasks = []
        for name, length, priority in arrivals:
            tasks.append(asyncio.ensure_future(one(name, length, priority)))
            await asyncio.sleep(0)
        assert memory.num_waiting == len(arrivals)
        memory.free(free_first)
        await asyncio.gather(*tasks)

    asyncio.run(asyncio.wait_for(scenario(), HANG_GUARD_S))
    return granted


def test_decode_grants_kv_room_by_priority_then_arrival():
    arrivals = [("a", 60, 4), ("b", 60, 4), ("high", 60, -1)]
    assert _granted_order("priority", arrivals) == ["high", "a", "b"]
    assert _granted_order("fcfs", arrivals) == ["a", "b", "high"]


def test_a_higher_priority_request_that_fits_goes_ahead_of_a_waiting_head_that_does_not():
    """Under priority, the head is the highest priority: a new request ahead of it by priority that
    fits now is granted at once. Under fcfs it waits behind the head (as before)."""

    async def scenario(policy: str) -> tuple[bool, int]:
        memory = KvMemory(100, 1, max_running=4, max_waiting=8, scheduling_policy=policy)
        await memory.reserve("holder", 40)  # the small one fits beside it: 2 x 40 tokens; the big one not
        big = asyncio.ensure_future(memory.reserve("big", 90, 5))
        await asyncio.sleep(0)
        small = asyncio.ensure_future(memory.reserve("small", 30, 0))
        await asyncio.sleep(0)
        granted = small.done()
        for task in (big, small):
            task.cancel()
        await asyncio.gather(big, small, return_exceptions=True)
        return granted, memory.num_waiting

    assert asyncio.run(scenario("priority")) == (True, 0)
    assert asyncio.run(scenario("fcfs")) == (False, 0)


def test_a_request_ahead_of_the_waiting_head_that_fits_is_granted_even_when_the_wait_queue_is_full():
    """It never joins the queue, so the queue's bound does not refuse it (it was Busy: a 429 for a
    request served at once). One that would wait behind the head is still refused."""

    async def scenario() -> None:
        memory = KvMemory(100, 1, max_running=4, max_waiting=1, scheduling_policy="priority")
        await memory.reserve("holder", 40)
        big = asyncio.ensure_future(memory.reserve("big", 90, 5))  # fills the one waiting place
        await asyncio.sleep(0)
        assert memory.num_waiting == 1
        await memory.reserve("small", 30, 0)  # ahead of big by priority, and 2 x 40 fits
        assert memory.num_holding == 2
        with pytest.raises(Busy):
            await memory.reserve("behind", 10, 5)  # behind big (same priority, later): waits, and no place
        big.cancel()
        await asyncio.gather(big, return_exceptions=True)

    asyncio.run(asyncio.wait_for(scenario(), HANG_GUARD_S))


# -- the front door learns prefill's policy --------------------------------------------------


def _info(policy: str) -> ModelInfo:
    return ModelInfo(100, 1000, 500, 500, scheduling_policy=policy)


def test_replicas_schedule_by_priority_for_the_gateway_only_when_every_one_does():
    both = common_model_info([_info("priority"), _info("priority")])
    assert both is not None and both.scheduling_policy == "priority"
    mixed = common_model_info([_info("priority"), _info("fcfs")])
    assert mixed is not None and mixed.scheduling_policy == "fcfs"


def test_the_policy_and_the_priority_cross_the_wire():
    from epd.transport.convert import generation_from_proto, generation_to_proto
    from epd.transport.model_info import model_info_from_proto, model_info_to_proto
    from epd.v1 import prefill_pb2

    assert model_info_from_proto(model_info_to_proto(_info("priority"))).scheduling_policy == "priority"
    assert model_info_from_proto(prefill_pb2.ModelInfo()).scheduling_policy == "fcfs", "a prefill from before"
    wire = generation_to_proto(GenerationConfig(priority=-4))
    assert wire.priority == -4 and generation_from_proto(wire, GenerationConfig()).priority == -4


def test_reprioritize_moves_an_item_keeping_its_arrival_and_fcfs_keeps_the_order():
    queue: WaitingQueue[str] = WaitingQueue("priority")
    for item, priority in [("a", 0), ("b", 2), ("c", 2), ("d", 1)]:
        queue.push(item, priority)
    assert queue.reprioritize("c", 0) and list(queue) == ["a", "c", "d", "b"]
    assert queue.reprioritize("a", 2) and list(queue) == ["c", "d", "a", "b"]  # "a" came before "b"
    assert not queue.reprioritize("gone", 0)
    fcfs: WaitingQueue[str] = WaitingQueue("fcfs")
    for item in "xyz":
        fcfs.push(item)
    assert fcfs.reprioritize("z", -5) and list(fcfs) == ["x", "y", "z"]
