"""An encode's driver alone (encoder_svc/driver.py): its model calls stop at its cancel flag, before
they run or while they wait for the model thread, and its wait for a tower job stops there too.
Real threads, no model."""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future

import pytest
import torch

from epd.encoder_svc.driver import Request, run_here
from epd.model_runtime.adapter import VisionInputs, VisualFeatures
from epd.stages.contracts import RequestCancelled


def _request(run_model=run_here, run_tower=None) -> Request:
    return Request(run_model, run_tower, threading.Event())


def test_a_model_call_runs_and_counts_its_time_until_the_request_is_cancelled():
    req = _request()
    assert req.model(lambda a, b: a + b, 2, 3) == 5
    assert req.model_s > 0
    req.num_groups_done = 2
    req.cancel.set()
    with pytest.raises(RequestCancelled, match="^cancelled after 2 frame groups$"):
        req.model(lambda: pytest.fail("a cancelled request's call ran"))


def test_a_call_queued_for_the_model_thread_does_not_run_once_cancelled_meanwhile():
    """The model thread checks the flag again before it starts the call (`guarded`)."""
    calls: queue.SimpleQueue = queue.SimpleQueue()
    ran: list[str] = []

    def model_thread() -> None:
        fn, done = calls.get()
        try:
            done.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            done.set_exception(exc)

    def run_model(fn):
        done: Future = Future()
        req.cancel.set()  # cancelled while the call waits in the model thread's queue
        calls.put((fn, done))
        return done.result(timeout=30)

    req = _request(run_model)
    thread = threading.Thread(target=model_thread)
    thread.start()
    with pytest.raises(RequestCancelled):
        req.model(lambda: ran.append("ran"))
    thread.join(30)
    assert ran == []


class _NeverDone:
    """A tower job that is never done (its `result` times out), as behind a long queue."""

    def __init__(self, on_poll) -> None:
        self.on_poll = on_poll
        self.polls = 0

    def result(self, timeout_s: float | None = None) -> VisualFeatures:
        self.polls += 1
        self.on_poll(self.polls)
        raise TimeoutError

    def cancel(self) -> None:
        pass


def test_waiting_for_a_tower_job_stops_when_the_request_is_cancelled_mid_wait():
    req = _request()

    def on_poll(polls: int) -> None:
        if polls == 3:
            req.cancel.set()
        assert polls < 100, "the wait did not stop at the cancel flag"

    pending = _NeverDone(on_poll)
    with pytest.raises(RequestCancelled):
        req.wait(pending)
    assert pending.polls == 3


def test_a_group_goes_to_the_tower_with_its_index_and_is_refused_once_cancelled():
    features = VisualFeatures(torch.zeros(4, 8))
    submitted: list[int] = []

    class Ready:
        def result(self, timeout_s: float | None = None) -> VisualFeatures:
            return features

        def cancel(self) -> None:
            pass

    def run_tower(inputs: VisionInputs, group_index: int) -> Ready:
        submitted.append(group_index)
        return Ready()

    req = _request(run_tower=run_tower)
    req.num_groups_done = 1
    inputs = VisionInputs("image", torch.zeros(16, 8), (1, 4, 4), 0.0)
    assert req.wait(req.submit_tower(adapter=None, inputs=inputs)) is features
    assert submitted == [1]
    req.cancel.set()
    with pytest.raises(RequestCancelled):
        req.submit_tower(adapter=None, inputs=inputs)
    assert submitted == [1]
