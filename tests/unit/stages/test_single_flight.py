"""SingleFlight (encoder_svc/single_flight.py): one leader per key; waiters get its result, take
over when it fails, and stop waiting when they are cancelled; a leader whose caller leaves hands
the work on to its waiters (cancelled only once the last of them leaves too). Real threads, no
model."""

from __future__ import annotations

import threading
import time

import pytest

from epd.encoder_svc.single_flight import Interest, SingleFlight


class Cancelled(Exception):
    pass


def _never() -> None:
    pass


def _wait_for(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


def _follow(flights: SingleFlight[str], key: str, out: list, check=_never) -> threading.Thread:
    def run() -> None:
        try:
            out.append(flights.join(key, check))
        except Cancelled:
            out.append("cancelled")

    thread = threading.Thread(target=run)
    thread.start()
    _wait_for(lambda: flights.num_waiting(key) >= 1 or out)
    return thread


def test_a_waiter_gets_the_leaders_result_and_a_new_key_leads_again():
    flights: SingleFlight[str] = SingleFlight(poll_s=0.01)
    flight, shared = flights.join("k", _never)
    assert flight is not None and shared is None
    out: list = []
    waiter = _follow(flights, "k", out)
    assert flights.num_waiting("k") == 1 and not out
    flight.land("tokens")
    waiter.join(5)
    assert out == [(None, "tokens")] and flights.num_shared == 1
    again, _ = flights.join("k", _never)  # landed: the next request about the key leads anew
    assert again is not None and again is not flight
    other, _ = flights.join("other", _never)  # another key never waits
    assert other is not None


def test_when_the_leader_fails_one_waiter_takes_over():
    flights: SingleFlight[str] = SingleFlight(poll_s=0.01)
    flight, _ = flights.join("k", _never)
    assert flight is not None
    out: list = []
    waiter = _follow(flights, "k", out)
    flight.land(None)  # failed or cancelled
    waiter.join(5)
    ((taken_over, shared),) = out
    assert taken_over is not None and shared is None and flights.num_shared == 0
    taken_over.land("second try")


def test_a_cancelled_waiter_stops_waiting_and_the_leader_goes_on():
    flights: SingleFlight[str] = SingleFlight(poll_s=0.01)
    flight, _ = flights.join("k", _never)
    assert flight is not None
    cancel = threading.Event()

    def check() -> None:
        if cancel.is_set():
            raise Cancelled

    out: list = []
    waiter = _follow(flights, "k", out, check)
    cancel.set()
    waiter.join(5)
    assert out == ["cancelled"] and flights.num_waiting("k") == 0
    flight.land("tokens")
    done, shared = flights.join("k", _never)
    assert done is not None and shared is None


@pytest.mark.parametrize("num_waiters", [1, 4])
def test_every_waiter_gets_the_one_result(num_waiters):
    flights: SingleFlight[str] = SingleFlight(poll_s=0.01)
    flight, _ = flights.join("k", _never)
    assert flight is not None
    out: list = []
    threads = [
        threading.Thread(target=lambda: out.append(flights.join("k", _never))) for _ in range(num_waiters)
    ]
    for t in threads:
        t.start()
    _wait_for(lambda: flights.num_waiting("k") == num_waiters)
    flight.land("tokens")
    for t in threads:
        t.join(5)
    assert out == [(None, "tokens")] * num_waiters and flights.num_shared == num_waiters


def _cancellable() -> tuple[threading.Event, object]:
    cancel = threading.Event()

    def check() -> None:
        if cancel.is_set():
            raise Cancelled

    return cancel, check


def test_a_leader_that_leaves_hands_the_work_to_its_waiter_which_gets_its_result():
    """The leader's caller goes while a request waits: the work is not cancelled and its result
    reaches the waiter as a shared one; nobody takes the work over (no second decode)."""
    flights: SingleFlight[str] = SingleFlight(poll_s=0.01)
    interest = Interest()
    flight, _ = flights.join("k", _never)
    assert flight is not None and interest.lead(flight)
    out: list = []
    waiter = _follow(flights, "k", out)
    assert interest.leave() is True  # the work goes on for the waiter
    assert interest.cancel.is_set() and not flight.cancel.is_set()
    flight.land("tokens")  # the leader's thread finishes the work
    waiter.join(5)
    assert out == [(None, "tokens")] and flights.num_shared == 1


def test_a_leader_that_leaves_alone_cancels_the_work():
    flights: SingleFlight[str] = SingleFlight(poll_s=0.01)
    interest = Interest()
    flight, _ = flights.join("k", _never)
    assert flight is not None and interest.lead(flight)
    assert interest.leave() is False and flight.cancel.is_set()
    flight.land(None)
    again, _ = flights.join("k", _never)  # the next request leads a fresh work
    assert again is not None and not again.cancel.is_set()


def test_the_work_is_cancelled_when_its_last_waiter_leaves_after_its_leader():
    flights: SingleFlight[str] = SingleFlight(poll_s=0.01)
    interest = Interest()
    flight, _ = flights.join("k", _never)
    assert flight is not None and interest.lead(flight)
    (first, check_first), (second, check_second) = _cancellable(), _cancellable()
    out: list = []
    threads = [_follow(flights, "k", out, check_first)]
    threads.append(_follow(flights, "k", out, check_second))
    _wait_for(lambda: flights.num_waiting("k") == 2)
    assert interest.leave() is True
    first.set()
    _wait_for(lambda: out == ["cancelled"])
    assert not flight.cancel.is_set(), "one request still waits on the work"
    second.set()
    for thread in threads:
        thread.join(5)
    assert out == ["cancelled", "cancelled"] and flight.cancel.is_set()
    flight.land(None)


def test_a_waiter_that_leaves_while_its_leader_stays_does_not_cancel_the_work():
    flights: SingleFlight[str] = SingleFlight(poll_s=0.01)
    flight, _ = flights.join("k", _never)
    assert flight is not None
    cancel, check = _cancellable()
    out: list = []
    waiter = _follow(flights, "k", out, check)
    cancel.set()
    waiter.join(5)
    assert out == ["cancelled"] and not flight.cancel.is_set()
    flight.land("tokens")


def test_a_request_whose_caller_left_before_it_could_lead_does_no_work():
    flights: SingleFlight[str] = SingleFlight(poll_s=0.01)
    interest = Interest()
    assert interest.leave() is False  # nothing led yet: nothing goes on
    flight, _ = flights.join("k", _never)
    assert flight is not None and interest.lead(flight) is False
    flight.land(None)


def test_leaving_after_the_work_landed_cancels_nothing():
    flights: SingleFlight[str] = SingleFlight(poll_s=0.01)
    interest = Interest()
    flight, _ = flights.join("k", _never)
    assert flight is not None and interest.lead(flight)
    flight.land("tokens")
    assert interest.leave() is False and not flight.cancel.is_set()


class _Changes:
    """A leader's `on_change`: records who the work runs for each time it is told, as the encoder's
    tower jobs read it (`Interest.runs_for`, when the call runs)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, int]] = []
        self.interest: Interest | None = None

    def __call__(self) -> None:
        assert self.interest is not None
        self.seen.append(self.interest.runs_for())


def _leader(flights: SingleFlight[str], request_id: str, priority: int) -> tuple[Interest, _Changes]:
    changes = _Changes()
    interest = changes.interest = Interest(request_id, priority, on_change=changes)
    flight, _ = flights.join("k", _never, interest=interest)
    assert flight is not None and interest.lead(flight)
    return interest, changes


def _waiter(flights: SingleFlight[str], request_id: str, priority: int, out: list):
    """A request waiting on the work, and the event that cancels it."""
    cancel, check = _cancellable()
    interest = Interest(request_id, priority)

    def run() -> None:
        try:
            out.append(flights.join("k", check, interest=interest))
        except Cancelled:
            out.append("cancelled")

    thread = threading.Thread(target=run)
    waiting = flights.num_waiting("k")
    thread.start()
    _wait_for(lambda: flights.num_waiting("k") > waiting)
    return thread, cancel


def test_the_work_runs_at_the_best_priority_of_those_who_want_it_and_a_left_leader_counts_no_more():
    """Lower is served earlier (vLLM's priority). A low-priority leader's work is raised to the
    priority of a request that waits on it (under the leader's id while it stays); once the leader
    leaves, the work runs for the best of those still waiting, under the id of the first of them;
    as they leave in turn, it drops to the best of the rest. Before, the work kept its leader's id
    and priority to its end."""
    flights: SingleFlight[str] = SingleFlight(poll_s=0.01)
    leader, changes = _leader(flights, "leader", 5)
    assert leader.runs_for() == ("leader", 5) and changes.seen == []
    out: list = []
    urgent, leave_urgent = _waiter(flights, "urgent", -3, out)
    assert leader.runs_for() == ("leader", -3) and changes.seen == [("leader", -3)]
    later, leave_later = _waiter(flights, "later", 1, out)
    assert changes.seen == [("leader", -3)]  # nothing changed: not told
    assert leader.leave() is True
    assert leader.runs_for() == ("urgent", -3) and changes.seen[-1] == ("urgent", -3)
    leave_urgent.set()
    urgent.join(5)
    assert leader.runs_for() == ("later", 1) and changes.seen[-1] == ("later", 1)
    flight = leader._flight  # noqa: SLF001 - the work the leader's thread still does
    assert flight is not None and not flight.cancel.is_set()
    flight.land("tokens")
    later.join(5)
    assert out == ["cancelled", (None, "tokens")]
    leave_later.set()


def test_a_high_priority_leader_that_leaves_no_longer_boosts_its_low_priority_waiters():
    flights: SingleFlight[str] = SingleFlight(poll_s=0.01)
    leader, changes = _leader(flights, "urgent-leader", -5)
    out: list = []
    first, _ = _waiter(flights, "slow-1", 7, out)
    second, _ = _waiter(flights, "slow-2", 7, out)
    assert leader.runs_for() == ("urgent-leader", -5) and changes.seen == []
    assert leader.leave() is True
    assert leader.runs_for() == ("slow-1", 7) and changes.seen == [("slow-1", 7)]  # the first of equals
    flight = leader._flight  # noqa: SLF001
    assert flight is not None
    flight.land("tokens")
    for thread in (first, second):
        thread.join(5)
    assert out == [(None, "tokens")] * 2


def test_waiters_that_come_before_their_leader_leads_are_counted_when_it_does():
    """The leader joins (and so makes the flight), then leads it a moment later on its thread: a
    request that waits on it meanwhile raises the work's priority as soon as it is led."""
    flights: SingleFlight[str] = SingleFlight(poll_s=0.01)
    changes = _Changes()
    interest = changes.interest = Interest("leader", 0, on_change=changes)
    flight, _ = flights.join("k", _never, interest=interest)
    assert flight is not None
    out: list = []
    waiter, _ = _waiter(flights, "urgent", -1, out)
    assert changes.seen == []
    assert interest.lead(flight)
    assert changes.seen == [("leader", -1)]
    flight.land("tokens")
    waiter.join(5)
