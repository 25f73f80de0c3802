"""The encoder core's bookkeeping without a model: which tower jobs a step takes (FIFO, up to a
patch budget), the queue bound, removal of cancelled jobs, and the core around it with a runner
that records its steps (so every job comes back to its own submitter, and a cancelled job never
reaches the tower)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import Any

import pytest

from epd.encoder_svc.config import EncoderConfig
from epd.encoder_svc.scheduler import EncodeScheduler, TowerJob
from epd.stages.engine_core import EngineCore, ModelRunner, RequestFailed
from epd.stages.errors import ResourceExhausted
from epd.stages.model_thread import ModelThread

HANG_GUARD_S = 60.0


def job(name: str, num_patches: int) -> TowerJob:
    return TowerJob(request_id=name, num_patches=num_patches)


def names(jobs: Sequence[TowerJob]) -> list[str]:
    return [j.request_id for j in jobs]


def test_a_step_takes_the_oldest_jobs_of_several_requests_up_to_the_patch_budget():
    s = EncodeScheduler(max_patches_per_step=1000, max_waiting_jobs=8)
    for name, patches in [("a", 300), ("b", 200), ("c", 600), ("d", 100)]:
        s.add(job(name, patches))
    first = s.schedule()
    # FIFO without skipping: "d" would fit beside a and b, but it waits behind "c".
    assert names(first) == ["a", "b"]
    assert (s.load().num_running, s.load().num_waiting, s.num_patches_waiting) == (2, 2, 700)
    for j in first:
        s.remove(j)
    assert names(s.schedule()) == ["c", "d"]


def test_a_group_larger_than_the_budget_runs_alone():
    s = EncodeScheduler(max_patches_per_step=100, max_waiting_jobs=8)
    s.add(job("big", 400))
    s.add(job("small", 10))
    assert names(s.schedule()) == ["big"]
    assert names(s.requests()) == ["big", "small"]


def test_the_queue_is_bounded_and_says_which_flag_raises_it():
    s = EncodeScheduler(max_patches_per_step=100, max_waiting_jobs=2)
    s.add(job("a", 1))
    s.add(job("b", 1))
    with pytest.raises(ResourceExhausted, match="holds 2 frame groups.*--max-concurrent-decodes"):
        s.add(job("c", 1))
    assert names(s.schedule()) == ["a", "b"]
    s.add(job("c", 1))  # scheduled jobs no longer count against the queue


def test_removing_a_waiting_or_running_job_frees_its_place():
    s = EncodeScheduler(max_patches_per_step=10, max_waiting_jobs=4)
    a, b, c = job("a", 6), job("b", 6), job("c", 3)
    for j in (a, b, c):
        s.add(j)
    assert s.schedule() == [a]
    s.remove(b)  # cancelled while it waited
    assert s.num_patches_waiting == 3 and names(s.requests()) == ["a", "c"]
    s.remove(a)
    s.remove(a)  # removing twice is harmless (cancelled after it finished)
    assert s.schedule() == [c]
    s.remove(c)
    assert s.requests() == [] and s.num_patches_waiting == 0
    assert (s.load().stage, s.load().num_running, s.load().num_waiting) == ("encode", 0, 0)


@pytest.mark.parametrize("patches,waiting", [(0, 1), (1, 0)])
def test_bounds_must_be_positive(patches, waiting):
    with pytest.raises(ValueError, match="must be >= 1"):
        EncodeScheduler(patches, waiting)


def test_config_refuses_a_zero_patch_budget():
    with pytest.raises(ValueError, match="--max-tower-patches-per-step"):
        EncoderConfig(max_tower_patches_per_step=0)


def test_config_refuses_no_tower_job_per_request_and_the_flag_reaches_it():
    with pytest.raises(ValueError, match="--max-tower-jobs-per-request"):
        EncoderConfig(max_tower_jobs_per_request=0)
    from epd.cli import configs
    from epd.cli.parsers.root import build_parser

    args = build_parser().parse_args(["serve", "encoder", "--max-tower-jobs-per-request", "2"])
    assert configs.encoder_config(args).max_tower_jobs_per_request == 2
    assert (
        configs.encoder_config(build_parser().parse_args(["serve", "encoder"])).max_tower_jobs_per_request
        == 4
    )


class RecordingRunner(ModelRunner[TowerJob]):
    """Stands in for the vision tower: each job's output is its own name, steps are recorded.
    `hold` keeps the first step on the model thread until the test opens it."""

    def __init__(self) -> None:
        self.steps: list[list[str]] = []
        self.released: list[str] = []
        self.hold = threading.Event()
        self.entered = threading.Event()
        self.fail: set[str] = set()

    def execute(self, batch: Sequence[TowerJob]) -> list[tuple[TowerJob, Any]]:
        self.entered.set()
        assert self.hold.wait(HANG_GUARD_S)
        self.steps.append(names(batch))
        out: list[tuple[TowerJob, Any]] = []
        for j in batch:
            j.finished = True
            bad = j.request_id in self.fail
            out.append(
                (j, RequestFailed(ValueError(f"bad {j.request_id}")) if bad else f"embeds of {j.request_id}")
            )
        return out

    def release(self, request: TowerJob) -> None:
        self.released.append(request.request_id)


async def _one(core: EngineCore[TowerJob], j: TowerJob) -> str:
    return [out async for out in core.submit(j)][0]


def test_core_batches_waiting_jobs_routes_outputs_and_drops_a_cancelled_job_at_once():
    scheduler = EncodeScheduler(max_patches_per_step=1000, max_waiting_jobs=8)
    runner = RecordingRunner()
    thread = ModelThread()
    core = EngineCore(scheduler, runner, thread)

    async def scenario():
        first = asyncio.ensure_future(_one(core, job("first", 100)))
        assert await asyncio.to_thread(runner.entered.wait, HANG_GUARD_S)  # step 1 holds the thread
        later = {n: asyncio.ensure_future(_one(core, job(n, 100))) for n in ("a", "gone", "b", "bad")}
        runner.fail.add("bad")
        while scheduler.load().num_waiting < 4:
            await asyncio.sleep(0.001)
        later["gone"].cancel()  # its client went away while its job waited
        with pytest.raises(asyncio.CancelledError):
            await later["gone"]
        assert names(scheduler.waiting) == ["a", "b", "bad"], "the cancelled job left the queue at once"
        runner.hold.set()
        assert await first == "embeds of first"
        assert await later["a"] == "embeds of a" and await later["b"] == "embeds of b"
        with pytest.raises(ValueError, match="bad bad"):
            await later["bad"]
        await core.close()

    try:
        asyncio.run(asyncio.wait_for(scenario(), HANG_GUARD_S))
    finally:
        thread.close()
    assert runner.steps == [["first"], ["a", "b", "bad"]], "one step for everything that waited"
    assert scheduler.requests() == [] and scheduler.num_patches_waiting == 0
    assert core.last_batch_size == 3 and core.num_steps == 2
    assert "gone" in runner.released and "gone" not in sum(runner.steps, [])


def test_core_respects_the_patch_budget_across_steps():
    scheduler = EncodeScheduler(max_patches_per_step=250, max_waiting_jobs=8)
    runner = RecordingRunner()
    thread = ModelThread()
    core = EngineCore(scheduler, runner, thread)

    async def scenario():
        first = asyncio.ensure_future(_one(core, job("first", 10)))
        assert await asyncio.to_thread(runner.entered.wait, HANG_GUARD_S)
        rest = [asyncio.ensure_future(_one(core, job(n, 100))) for n in "abcde"]
        while scheduler.load().num_waiting < 5:
            await asyncio.sleep(0.001)
        runner.hold.set()
        assert await asyncio.gather(first, *rest) == [f"embeds of {n}" for n in ["first", *"abcde"]]
        await core.close()

    try:
        asyncio.run(asyncio.wait_for(scenario(), HANG_GUARD_S))
    finally:
        thread.close()
    assert runner.steps == [["first"], ["a", "b"], ["c", "d"], ["e"]]


def test_a_waiting_job_moved_to_another_priority_goes_to_its_place_there():
    """A shared encode's jobs take the priority of the requests that want it (single flight): a
    waiting job moved to a better priority is taken before the jobs of the priority it left, after
    those already waiting at its new one; moved back, it keeps its arrival among its equals."""
    s = EncodeScheduler(max_patches_per_step=100, max_waiting_jobs=8, scheduling_policy="priority")
    jobs = {name: TowerJob(request_id=name, num_patches=100, priority=p) for name, p in
            [("a", 0), ("b", -1), ("shared", 5), ("c", 5)]}  # fmt: skip
    for j in jobs.values():
        s.add(j)
    s.reprioritize(jobs["shared"], -1)
    assert jobs["shared"].priority == -1
    assert [names(s.schedule()) for _ in range(2)] == [["b"], ["shared"]]
    s.add(moved_back := TowerJob(request_id="late", num_patches=100, priority=5))
    s.reprioritize(moved_back, 0)
    s.reprioritize(moved_back, 5)  # behind "c" again, which came before it
    assert [names(s.schedule()) for _ in range(3)] == [["a"], ["c"], ["late"]]


def test_a_shared_encodes_queued_jobs_follow_the_requests_that_want_it():
    """The stage's wiring of single flight into the tower queue (`_TowerJobs.run_for`), no model: a
    low-priority leader's queued job moves ahead of a priority-0 job once a priority -3 request
    waits on its work, and is that request's once the leader leaves, so the next step encodes it
    first, under that request's id. Before, it kept the leader's priority and id to the end."""
    import torch

    from epd.encoder_svc.single_flight import Interest, SingleFlight
    from epd.encoder_svc.stage import _TowerJobs
    from epd.model_runtime.adapter import VisionInputs

    scheduler = EncodeScheduler(max_patches_per_step=100, max_waiting_jobs=8, scheduling_policy="priority")
    runner = RecordingRunner()
    thread = ModelThread()
    core = EngineCore(scheduler, runner, thread)
    flights: SingleFlight[str] = SingleFlight(poll_s=0.01)
    group = VisionInputs("image", torch.zeros(100, 1), (1, 10, 10), 0.0)

    async def scenario():
        first = asyncio.ensure_future(_one(core, job("first", 100)))
        assert await asyncio.to_thread(runner.entered.wait, HANG_GUARD_S)  # step 1 holds the thread
        other = asyncio.ensure_future(_one(core, job("other", 100)))
        towers = _TowerJobs(core, scheduler, "leader", asyncio.get_running_loop(), priority=5)
        leader = Interest("leader", 5, on_change=lambda: towers.run_for(leader.runs_for))
        flight, _ = flights.join("k", lambda: None, interest=leader)
        assert flight is not None and leader.lead(flight)
        pending = await asyncio.to_thread(towers.submit, group, 0)  # from a driver thread
        while scheduler.load().num_waiting < 2:
            await asyncio.sleep(0.001)
        assert [(j.request_id, j.priority) for j in scheduler.waiting] == [("other", 0), ("leader", 5)]
        waiter = asyncio.ensure_future(
            asyncio.to_thread(flights.join, "k", lambda: None, interest=Interest("urgent", -3))
        )
        while [j.request_id for j in scheduler.waiting] != ["leader", "other"]:
            await asyncio.sleep(0.001)
        assert leader.leave() is True  # the work goes on for the waiting request
        while next(iter(scheduler.waiting)).request_id != "urgent":
            await asyncio.sleep(0.001)
        runner.hold.set()
        assert await asyncio.to_thread(pending.result, HANG_GUARD_S) == "embeds of urgent"
        flight.land("tokens")
        assert await waiter == (None, "tokens")
        assert await first == "embeds of first" and await other == "embeds of other"
        await core.close()

    try:
        asyncio.run(asyncio.wait_for(scenario(), HANG_GUARD_S))
    finally:
        thread.close()
    assert runner.steps == [["first"], ["urgent"], ["other"]]
