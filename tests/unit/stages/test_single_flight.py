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
