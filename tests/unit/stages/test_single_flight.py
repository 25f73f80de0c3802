"""SingleFlight (encoder_svc/single_flight.py): one leader per key; waiters get its result, take
over when it fails, and stop waiting when they are cancelled. Real threads, no model."""

from __future__ import annotations

import threading
import time

import pytest

from epd.encoder_svc.single_flight import SingleFlight


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
