"""One encode per media at a time: a request that misses the token cache while another request is
already decoding and encoding the same media with the same options (same cache key) waits for that
request's result instead of doing the work a second time. Two users asking about the same new
video at once, or a client that retries while its first try still runs, cost one decode and one
tower pass, and the second gets a cache hit. No gRPC, no torch: unit-tested alone.

The work belongs to everyone who wants its result, not to the request that started it (its
leader). When the leader's caller goes away (`Interest.leave`: a client that disconnected, or a
gateway that cancelled the encode because the request failed elsewhere, e.g. its structured-output
spec did not compile), the work goes on, on the leader's thread, for the requests waiting on it;
the leader itself is answered at once. The work is cancelled (`Flight.cancel`) only once nobody
wants it: its leader left and the last waiter left too. (Were it cancelled with its leader, a
waiter would take the work over and decode and encode the media again from the start.)

If the work fails, its waiters do not inherit that: one of them takes the work over (the next to
`join`), the others wait for it in turn. A waiter that is itself cancelled stops waiting within
`poll_s`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Flight(Generic[T]):
    """The work on one key, led by one request; `land` always ends it (result or None)."""

    def __init__(self, owner: SingleFlight[T], key: str) -> None:
        self.owner = owner
        self.key = key
        self.result: T | None = None
        self.num_waiters = 0
        self.leader_left = False
        """The leading request's caller went away; the work goes on while anyone waits."""
        self.cancel = threading.Event()
        """The work's own cancel flag (the one its decode and model calls watch): set once nobody
        wants the result any more, its leader gone and no waiter left. Never cleared."""
        self._done = threading.Event()

    def leave(self) -> bool:
        """The leading request's caller went away. True: requests wait on the work, which goes on
        for them; False: nobody wants it, and `cancel` is set (or it had landed already)."""
        with self.owner._lock:
            if self._done.is_set():
                return False
            self.leader_left = True
            if self.num_waiters == 0:
                self.cancel.set()
            return not self.cancel.is_set()

    def land(self, result: T | None) -> None:
        """The work is done: `result`, or None when it failed or was cancelled (a waiter then
        takes over). Called exactly once, in a `finally`."""
        with self.owner._lock:
            if self.owner._flights.get(self.key) is self:
                del self.owner._flights[self.key]
            self.result = result
            self._done.set()


class Interest:
    """A request's hold on the work it leads, given to it before it joins, so that its caller can
    say, from any thread, that it left (`leave`) while the request's thread is busy with the work.
    `cancel` is the request's own flag, set by `leave`."""

    def __init__(self) -> None:
        self.cancel = threading.Event()
        self._lock = threading.Lock()
        self._flight: Flight | None = None

    def lead(self, flight: Flight) -> bool:
        """The request leads `flight` from now. False: its caller left already (do no work)."""
        with self._lock:
            if self.cancel.is_set():
                return False
            self._flight = flight
            return True

    def leave(self) -> bool:
        """The request's caller went away. True: the request led work that goes on for others
        (its thread stays busy with it); False: nothing of it goes on."""
        with self._lock:
            self.cancel.set()
            flight = self._flight
        return flight is not None and flight.leave()


class SingleFlight(Generic[T]):
    def __init__(self, poll_s: float = 0.05) -> None:
        self.poll_s = poll_s
        self._lock = threading.Lock()
        self._flights: dict[str, Flight[T]] = {}
        self.num_shared = 0
        """Requests answered with another request's result (a decode and an encode saved each)."""

    def join(
        self, key: str, check_cancelled: Callable[[], None], on_wait: Callable[[], None] = lambda: None
    ) -> tuple[Flight[T] | None, T | None]:
        """(flight, None): the caller leads the work on `key` and must `flight.land(...)`;
        (None, result): another request's result for `key`. Blocks while another request leads
        (`on_wait()` first, each time); `check_cancelled` (raises when the caller is cancelled)
        is called every `poll_s` meanwhile."""
        while True:
            with self._lock:
                flight = self._flights.get(key)
                if flight is None:
                    flight = self._flights[key] = Flight(self, key)
                    return flight, None
                flight.num_waiters += 1
            try:
                on_wait()
                while not flight._done.wait(self.poll_s):
                    check_cancelled()
            finally:
                with self._lock:
                    flight.num_waiters -= 1
                    if flight.leader_left and flight.num_waiters == 0 and not flight._done.is_set():
                        flight.cancel.set()  # the last one who wanted it left
            if flight.result is not None:
                with self._lock:
                    self.num_shared += 1
                return None, flight.result
            # The work failed or was cancelled: lead it ourselves, or wait for whoever does.

    def num_waiting(self, key: str) -> int:
        """Requests waiting on the work on `key` now (0 when none leads it)."""
        with self._lock:
            flight = self._flights.get(key)
            return 0 if flight is None else flight.num_waiters
