"""The engine core's loop without a model: a counting runner stands in for the model (the core is
what is tested here). Requests admitted while a step runs join the next one; outputs reach only
their own request; a finished request is released before its reader sees the end; a reader that
leaves is removed and released; a failed step fails only its batch; deadlines end requests."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

import pytest

from epd.stages.engine_core import CoreRequest, EngineCore, EngineLoad, ModelRunner, Scheduler
from epd.stages.errors import ResourceExhausted
from epd.stages.model_thread import ModelThread


@dataclass(eq=False)
class CountRequest(CoreRequest):
    steps: int = 3  # outputs to produce
    done: int = 0


class FifoScheduler(Scheduler[CountRequest]):
    def __init__(self, max_running: int = 8, max_waiting: int = 8) -> None:
        self.waiting: list[CountRequest] = []
        self.running: list[CountRequest] = []
        self.max_running, self.max_waiting = max_running, max_waiting

    def add(self, r):
        if len(self.waiting) >= self.max_waiting:
            raise ResourceExhausted("full")
        self.waiting.append(r)

    def schedule(self):
        while self.waiting and len(self.running) < self.max_running:
            self.running.append(self.waiting.pop(0))
        return list(self.running)

    def remove(self, r):
        for q in (self.waiting, self.running):
            if r in q:
                q.remove(r)

    def requests(self):
        return [*self.running, *self.waiting]

    def load(self):
        return EngineLoad("test", len(self.running), len(self.waiting))


class CountRunner(ModelRunner[CountRequest]):
    def __init__(self, fail_on_step: int | None = None, step_s: float = 0.0) -> None:
        self.step_s = step_s
        self.batches: list[list[str]] = []
        self.released: list[str] = []
        self.fail_on_step = fail_on_step

    def execute(self, batch):
        self.batches.append([r.request_id for r in batch])
        if self.fail_on_step == len(self.batches):
            raise RuntimeError("step failed")
        time.sleep(self.step_s)
        out = []
        for r in batch:
            r.done += 1
            r.finished = r.done == r.steps
            out.append((r, f"{r.request_id}{r.done}"))
        return out

    def release(self, r):
        self.released.append(r.request_id)


def _core(runner=None, scheduler=None, thread=None):
    thread = thread or ModelThread()
    return EngineCore(scheduler or FifoScheduler(), runner or CountRunner(), thread), thread


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


async def _collect(core, r):
    return [x async for x in core.submit(r)]


def test_requests_share_steps_and_get_only_their_own_outputs():
    core, thread = _core()

    async def scenario():
        a, b = CountRequest("a", steps=3), CountRequest("b", steps=1)
        return await asyncio.gather(_collect(core, a), _collect(core, b))

    try:
        assert _run(scenario()) == [["a1", "a2", "a3"], ["b1"]]
        assert core.runner.batches[0] == ["a", "b"], "both joined the first step"
        assert sorted(core.runner.released) == ["a", "b"]
        assert core.load().num_steps == 3
    finally:
        thread.close()


def test_a_finished_request_is_released_before_its_reader_sees_the_end():
    core, thread = _core()

    async def scenario():
        out = await _collect(core, CountRequest("a", steps=2))
        return out, list(core.runner.released)

    try:
        assert _run(scenario()) == (["a1", "a2"], ["a"])
    finally:
        thread.close()


def test_a_reader_that_leaves_is_removed_and_released():
    core, thread = _core()

    async def scenario():
        r = CountRequest("a", steps=10**6)
        stream = core.submit(r)
        first = await stream.__anext__()
        await stream.aclose()
        for _ in range(20):
            await asyncio.sleep(0.01)
            if core.runner.released:
                break
        return first, r.cancelled, core.scheduler.requests(), core.runner.released

    try:
        assert _run(scenario()) == ("a1", True, [], ["a"])
    finally:
        thread.close()


def test_a_full_scheduler_refuses_before_anything_runs():
    core, thread = _core(scheduler=FifoScheduler(max_running=1, max_waiting=0))

    async def scenario():
        with pytest.raises(ResourceExhausted, match="full"):
            await _collect(core, CountRequest("a"))

    try:
        _run(scenario())
        assert core.runner.batches == []
    finally:
        thread.close()


def test_a_failed_step_fails_its_batch_and_the_core_keeps_serving():
    core, thread = _core(runner=CountRunner(fail_on_step=1))

    async def scenario():
        with pytest.raises(RuntimeError, match="step failed"):
            await _collect(core, CountRequest("a"))
        return await _collect(core, CountRequest("b", steps=2))

    try:
        assert _run(scenario()) == ["b1", "b2"]
        assert "a" in core.runner.released
    finally:
        thread.close()


class AdmittingRunner(CountRunner):
    """Admits first: its output "<id>0" must reach the reader before the request's first step runs;
    `steps=0` requests are done at admission; "bad" fails there, alone."""

    admits_first = True

    def __init__(self) -> None:
        super().__init__()
        self.seen_before_step: list[list[str]] = []  # what readers had received when each step began
        self.received: dict[str, list[str]] = {}

    def admit(self, requests):
        out = []
        for r in requests:
            if r.request_id == "bad":
                from epd.stages.engine_core import RequestFailed

                out.append((r, RequestFailed(ValueError("cannot join"))))
                continue
            r.finished = r.steps == 0
            out.append((r, f"{r.request_id}0"))
        return out

    def execute(self, batch):
        # The readers run on the event loop, free while this step runs: what was delivered before
        # the step reaches them now; what would be delivered with the step's outputs cannot.
        deadline = time.monotonic() + 2.0
        while len(self._seen()) < 3 and time.monotonic() < deadline:
            time.sleep(0.005)
        self.seen_before_step.append(self._seen())
        return super().execute(batch)

    def _seen(self) -> list[str]:
        return sorted(x for xs in list(self.received.values()) for x in list(xs))


def test_a_runner_that_admits_first_delivers_those_outputs_before_the_step():
    runner = AdmittingRunner()
    core, thread = _core(runner)

    async def read(r):
        got = runner.received.setdefault(r.request_id, [])
        try:
            async for x in core.submit(r):
                got.append(x)
        except ValueError as exc:
            got.append(f"error: {exc}")
        return got

    async def scenario():
        return await asyncio.gather(
            read(CountRequest("a", steps=2)),
            read(CountRequest("z", steps=0)),
            read(CountRequest("bad", steps=1)),
        )

    try:
        assert _run(scenario()) == [["a0", "a1", "a2"], ["z0"], ["error: cannot join"]]
        assert runner.seen_before_step[0] == ["a0", "error: cannot join", "z0"], (
            "the admitted outputs (and the failure) reached their readers before the first step ran"
        )
        assert runner.batches == [["a"], ["a"]], "only the request still running went on to steps"
        assert sorted(runner.released) == ["a", "bad", "z"]
    finally:
        thread.close()


@pytest.mark.parametrize("first_calls_ahead", [True, False])
def test_the_admission_goes_ahead_of_other_stages_calls_under_ttft_first(first_calls_ahead):
    """On a model thread shared with other stages (`epd serve --colocate`) with the ttft-first
    schedule, a request's admission (the call that delivers its first token) does not wait behind
    the other stages' queued calls; under fifo it takes its turn after them."""
    ran: list[str] = []

    class Runner(CountRunner):
        admits_first = True

        def admit(self, requests):
            ran.append("admit")
            return [(r, f"{r.request_id}0") for r in requests]

    core, thread = _core(Runner(), thread=ModelThread(first_calls_ahead=first_calls_ahead))

    async def scenario():
        started, release = threading.Event(), threading.Event()

        def blocker():
            started.set()
            assert release.wait(10)

        held = asyncio.ensure_future(thread.run_in("prefill", blocker))
        assert await asyncio.to_thread(started.wait, 10)
        others = [asyncio.ensure_future(thread.run_in("encode", ran.append, f"encode {i}")) for i in range(3)]
        reader = asyncio.ensure_future(_collect(core, CountRequest("a", steps=1)))
        for _ in range(500):  # until the core has queued the admission behind the blocker
            await asyncio.sleep(0.01)
            if len(thread._queue) == 4:
                break
        assert len(thread._queue) == 4, "the admission was not queued"
        release.set()
        await held
        await asyncio.gather(*others)
        return await reader

    try:
        assert _run(scenario()) == ["a0", "a1"]
        encodes = ["encode 0", "encode 1", "encode 2"]
        assert ran == (["admit", *encodes] if first_calls_ahead else [*encodes, "admit"])
    finally:
        thread.close()


def test_a_colocated_decode_step_of_few_rows_runs_on_one_torch_thread():
    """Under `CallThreads` (one model serving every stage), a decode step of fewer than 4 rows
    takes one thread (a second gains little there and spins through every step); a wider one,
    or another stage's, the cores the running calls leave."""
    import torch

    from epd.model_runtime.threads import CallThreads

    class ThreadsRunner(CountRunner):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[tuple[int, int]] = []  # (rows, torch threads) per step

        def execute(self, batch):
            self.seen.append((len(batch), torch.get_num_threads()))
            return super().execute(batch)

    def core_of(stage: str, thread: ModelThread) -> EngineCore:
        scheduler = FifoScheduler()
        scheduler.load = lambda: EngineLoad(stage, 0, 0)  # type: ignore[method-assign]
        return EngineCore(scheduler, ThreadsRunner(), thread)

    before = torch.get_num_threads()
    thread = ModelThread(call_threads=CallThreads(cores=4))
    decode, prefill = core_of("decode", thread), core_of("prefill", thread)

    async def scenario():
        await _collect(decode, CountRequest("a", steps=2))
        await asyncio.gather(*(_collect(decode, CountRequest(f"b{i}", steps=1)) for i in range(4)))
        await _collect(prefill, CountRequest("p", steps=1))

    try:
        _run(scenario())
        assert decode.runner.seen == [(1, 1), (1, 1), (4, 4)]
        assert prefill.runner.seen == [(1, 4)]
    finally:
        thread.close()
        torch.set_num_threads(before)


def test_the_loop_logs_under_no_request_s_id_and_a_failed_step_names_its_requests(caplog):
    """The loop task was created from the first request's task and kept its context: every later
    step's log line carried that first request's id (grep ID *.log found other requests' failures)."""
    from epd.transport import tracing

    core, thread = _core(runner=CountRunner(fail_on_step=2), scheduler=FifoScheduler(max_running=1))

    async def first():
        tracing.begin_request("first-request")
        return await _collect(core, CountRequest("first", steps=1))

    async def scenario():
        await asyncio.ensure_future(first())  # starts the loop from its own context
        with pytest.raises(RuntimeError, match="step failed"):
            await _collect(core, CountRequest("second", steps=1))

    caplog.handler.addFilter(tracing.RequestIdFilter())
    try:
        with caplog.at_level("ERROR", logger="epd.stages.engine_core"):
            _run(scenario())
    finally:
        thread.close()
    (record,) = [r for r in caplog.records if "batched step" in r.getMessage()]
    assert record.getMessage() == "a batched step of 1 requests failed (request ids second)"
    assert record.request_id == ""


class FailingReleaseRunner(CountRunner):
    """Its release of "a" fails, once "b" has been submitted (held until then)."""

    def __init__(self) -> None:
        super().__init__(step_s=0.01)
        self.releasing_a = threading.Event()
        self.b_submitted = threading.Event()

    def release(self, r):
        if r.request_id == "a":
            self.releasing_a.set()
            self.b_submitted.wait(5)
            raise RuntimeError("release failed")
        super().release(r)


def test_a_failing_release_is_logged_and_the_core_keeps_serving(caplog):
    """A runner's release that raises (with nothing else to step, the loop frees the leavers on
    its own) stopped the core's loop: a request submitted meanwhile was never stepped."""
    runner = FailingReleaseRunner()
    core, thread = _core(runner=runner)

    async def scenario():
        reader = asyncio.ensure_future(_collect(core, CountRequest("a", steps=1000)))
        while not runner.batches:
            await asyncio.sleep(0.001)
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
        await asyncio.to_thread(runner.releasing_a.wait, 5)
        b = asyncio.ensure_future(_collect(core, CountRequest("b", steps=2)))
        await asyncio.sleep(0.01)
        runner.b_submitted.set()
        return await b

    from epd.transport import tracing

    caplog.handler.addFilter(tracing.RequestIdFilter())
    try:
        assert _run(scenario()) == ["b1", "b2"]
        assert "b" in runner.released
        (record,) = [r for r in caplog.records if "freeing the state of request a failed" in r.getMessage()]
        assert record.request_id == "a"  # the loop has no request's context: the line names it itself
    finally:
        thread.close()
