"""One encode per media at a time: a request that misses the token cache while another request is
already decoding and encoding the same media with the same options (same cache key) waits for that
request's result instead of doing the work a second time. Two users asking about the same new
video at once, or a client that retries while its first try still runs, cost one decode and one
tower pass, and the second gets a cache hit. No gRPC, no torch: unit-tested alone.

If the request doing the work fails or is cancelled, its waiters do not inherit that: one of them
takes the work over (the next to `join`), the others wait for it in turn. A waiter that is itself
cancelled stops waiting within `poll_s`.
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
        self._done = threading.Event()

    def land(self, result: T | None) -> None:
        """The leader is done: `result`, or None when it failed or was cancelled (a waiter then
        takes over). Called exactly once, in a `finally`."""
        with self.owner._lock:
            if self.owner._flights.get(self.key) is self:
                del self.owner._flights[self.key]
            self.result = result
        self._done.set()


class SingleFlight(Generic[T]):
    def __init__(self, poll_s: float = 0.05) -> None:
        self.poll_s = poll_s
        self._lock = threading.Lock()
        self._flights: dict[str, Flight[T]] = {}
        self.num_shared = 0
        """Requests answered with another request's result (a decode and an encode saved each)."""

    def join(self, key: str, check_cancelled: Callable[[], None]) -> tuple[Flight[T] | None, T | None]:
        """(flight, None): the caller leads the work on `key` and must `flight.land(...)`;
        (None, result): another request's result for `key`. Blocks while another request leads;
        `check_cancelled` (raises when the caller is cancelled) is called every `poll_s` meanwhile."""
        while True:
            with self._lock:
                flight = self._flights.get(key)
                if flight is None:
                    flight = self._flights[key] = Flight(self, key)
                    return flight, None
                flight.num_waiters += 1
            try:
                while not flight._done.wait(self.poll_s):
                    check_cancelled()
            finally:
                with self._lock:
                    flight.num_waiters -= 1
            if flight.result is not None:
                with self._lock:
                    self.num_shared += 1
                return None, flight.result
            # Its leader failed or was cancelled: lead it ourselves, or wait for whoever does.

    def num_waiting(self, key: str) -> int:
        """Requests waiting on the work on `key` now (0 when none leads it)."""
        with self._lock:
            flight = self._flights.get(key)
            return 0 if flight is None else flight.num_waiters
