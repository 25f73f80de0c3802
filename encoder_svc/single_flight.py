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

The work runs for whoever wants it, at the best priority among them (`Flight.runs_for`: the
lowest `priority` value of its leader, until it leaves, and of the requests waiting on it), under
the id of one of them (its leader's while it stays, else the first waiter's of that priority).
Its leader's `Interest.on_change` is called each time that changes: the encoder then moves the
work's tower jobs to that priority and id (`encoder_svc/stage.py`). So a low-priority leader
does not hold back a high-priority request waiting on it (before, the jobs kept the leader's
priority and id to the end, even after the leader left), and a high-priority leader that left no
longer boosts the low-priority requests left waiting.

The work is no single request's, so it does not run as its leader's: its thread runs it in a
context of its own (`epd.stages.request_id.shared_work_context`, `EncoderEngine.encode`), under
the flight's id (`Flight.id`, in its log lines, and those of the tower jobs it submits) and
without any client's deadline (`epd.stages.deadline`). Before, it ran in its leader's context: its
log lines named the leader after it had left, and the leader's deadline would have ended work that
requests waiting on it, with deadlines of their own, still needed.

If the work fails, its waiters do not inherit that: one of them takes the work over (the next to
`join`), the others wait for it in turn. A waiter that is itself cancelled stops waiting within
`poll_s`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


def flight_id(key: str) -> str:
    """The name of the work on `key` in log lines (a cache key is a sha256 in hex: its first 16
    characters): its leader's say "... as flight-KEY", waiters' "... in flight (flight-KEY)", and
    the work's own carry it as their request id (`EncoderEngine.encode`)."""
    return f"flight-{key[:16]}"


class Flight(Generic[T]):
    """The work on one key, led by one request; `land` always ends it (result or None)."""

    def __init__(self, owner: SingleFlight[T], key: str) -> None:
        self.owner = owner
        self.key = key
        self.id = flight_id(key)
        self.result: T | None = None
        self.leader: Interest | None = None
        """The request that does the work (`Interest.lead`); it stays set after its caller left."""
        self.waiters: list[Interest] = []
        """The requests waiting on the work, in the order they came (owner's lock)."""
        self.leader_left = False
        """The leading request's caller went away; the work goes on while anyone waits."""
        self.cancel = threading.Event()
        """The work's own cancel flag (the one its decode and model calls watch): set once nobody
        wants the result any more, its leader gone and no waiter left. Never cleared."""
        self._done = threading.Event()
        self._told: tuple[str, int] | None = None
        """`runs_for` when the leader's `on_change` was last called (owner's lock); None: never."""

    @property
    def num_waiters(self) -> int:
        return len(self.waiters)

    def runs_for(self) -> tuple[str, int]:
        """(request id, priority) the work runs under now: the best priority (lowest value) among
        those who want it, its leader until it leaves and the requests waiting on it; the leader's
        id while it stays, else the id of the first waiter of that priority. The leader's own
        when nobody wants it any more (it is being cancelled)."""
        with self.owner._lock:
            return self._runs_for()

    def _runs_for(self) -> tuple[str, int]:  # owner's lock held
        leader = self.leader
        staying = [leader] if leader is not None and not self.leader_left else []
        wanting = staying + self.waiters
        if not wanting:
            return ("", 0) if leader is None else (leader.request_id, leader.priority)
        best = min(w.priority for w in wanting)
        who = staying[0] if staying else next(w for w in wanting if w.priority == best)
        return who.request_id, best

    def _retarget(self) -> Callable[[], None]:
        """(owner's lock held) The leader's `on_change` when who the work runs for changed, else
        a no-op: called once the lock is released. `on_change` reads `runs_for` itself, when it
        runs: calls made from several threads may run in another order than they were made."""
        leader = self.leader
        if leader is None or leader.on_change is None or self._done.is_set() or self.cancel.is_set():
            return lambda: None
        now = self._runs_for()
        if now == (self._told or (leader.request_id, leader.priority)):
            return lambda: None
        self._told = now
        return leader.on_change

    def leave(self) -> bool:
        """The leading request's caller went away. True: requests wait on the work, which goes on
        for them (at their best priority: `runs_for`); False: nobody wants it, and `cancel` is set
        (or it had landed already)."""
        with self.owner._lock:
            if self._done.is_set():
                return False
            self.leader_left = True
            if self.num_waiters == 0:
                self.cancel.set()
                return False
            retarget = self._retarget()
        retarget()
        return True

    def land(self, result: T | None) -> None:
        """The work is done: `result`, or None when it failed or was cancelled (a waiter then
        takes over). Called exactly once, in a `finally`."""
        with self.owner._lock:
            if self.owner._flights.get(self.key) is self:
                del self.owner._flights[self.key]
            self.result = result
            self._done.set()


class Interest:
    """A request's hold on the work it leads or waits on, given to it before it joins, so that its
    caller can say, from any thread, that it left (`leave`) while the request's thread is busy with
    the work. `cancel` is the request's own flag, set by `leave`. `request_id` and `priority` are
    the request's (vLLM's priority: lower is served earlier). `on_change()`, called from any
    thread, says that the work this request leads runs for another request or priority
    (`runs_for`) from now on; None: the work has nothing to move."""

    def __init__(
        self, request_id: str = "", priority: int = 0, on_change: Callable[[], None] | None = None
    ) -> None:
        self.request_id = request_id
        self.priority = priority
        self.on_change = on_change
        self.cancel = threading.Event()
        self._lock = threading.Lock()
        self._flight: Flight | None = None

    def lead(self, flight: Flight) -> bool:
        """The request leads `flight` from now (told at once when requests that wait on it
        already want it at a better priority). False: its caller left already (do no work)."""
        with self._lock:
            if self.cancel.is_set():
                return False
            self._flight = flight
        with flight.owner._lock:
            flight.leader = self
            retarget = flight._retarget()
        retarget()
        return True

    def runs_for(self) -> tuple[str, int]:
        """(request id, priority) the work this request leads runs under now (`Flight.runs_for`);
        the request's own before it leads any."""
        with self._lock:
            flight = self._flight
        return (self.request_id, self.priority) if flight is None else flight.runs_for()

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
        self,
        key: str,
        check_cancelled: Callable[[], None],
        on_wait: Callable[[], None] = lambda: None,
        interest: Interest | None = None,
    ) -> tuple[Flight[T] | None, T | None]:
        """(flight, None): the caller leads the work on `key` and must `flight.land(...)`;
        (None, result): another request's result for `key`. Blocks while another request leads
        (`on_wait()` first, each time); `check_cancelled` (raises when the caller is cancelled)
        is called every `poll_s` meanwhile. `interest`: the caller's request (its id and
        priority count in `Flight.runs_for` while it waits)."""
        interest = interest or Interest()
        while True:
            with self._lock:
                flight = self._flights.get(key)
                if flight is None:
                    flight = self._flights[key] = Flight(self, key)
                    return flight, None
                flight.waiters.append(interest)
                retarget = flight._retarget()
            try:
                # Inside the try: whatever happens from here, the finally takes the waiter off the
                # list, so a waiter that left never keeps the shared work alive.
                retarget()
                on_wait()
                while not flight._done.wait(self.poll_s):
                    check_cancelled()
            finally:
                with self._lock:
                    flight.waiters.remove(interest)
                    if flight.leader_left and flight.num_waiters == 0 and not flight._done.is_set():
                        flight.cancel.set()  # the last one who wanted it left
                    retarget = flight._retarget()
                retarget()
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
