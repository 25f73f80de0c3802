"""When `epd serve` restarts a replica of its loopback stack, and when it gives up on one.

Bookkeeping only: no processes, no gRPC, no clock of its own (every call is given `now`), so it
is unit-tested with a fake clock; `epd/cli/launcher.py` does the processes and the health checks.

A replica's life, as a process manager (systemd, Kubernetes) would run it:

    STARTING --SERVING--> SERVING --exits / no health answer for health_timeout_s--> WAITING
       |                                                                              |
       +--exits / not SERVING within start_timeout_s (bound or not)----------> WAITING
    WAITING --backoff elapsed--> STARTING (forked again)
    WAITING --crash_loop_exits exits within crash_loop_window_s--> GIVEN_UP (never restarted)
    WAITING --backoff elapsed, its port held by another process--> WAITING (`port_taken`)

The backoff doubles from `backoff_initial_s` to `backoff_max_s` with each exit, and goes back to
`backoff_initial_s` once the replica has served for `healthy_reset_s` without exiting: a replica
that crashes once a day restarts after 1 s each time, one that crashes at once waits longer and
longer, then is given up on (restarting it again would only burn CPU loading the model).

"Stops answering" is liveness, not readiness: a replica that answers its health check with
NOT_SERVING is alive (the gateway answers NOT_SERVING while a stage is down; a stage while it
loads its model), one whose health check gets no answer at all (stopped, hung, deadlocked) is not.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class RestartPolicy:
    backoff_initial_s: float = 1.0
    """Wait before the first restart after an exit."""
    backoff_max_s: float = 30.0
    """The doubling wait stops growing here."""
    healthy_reset_s: float = 60.0
    """Served this long without an exit: the next restart waits `backoff_initial_s` again."""
    crash_loop_exits: int = 5
    crash_loop_window_s: float = 60.0
    """This many exits within this window: a crash loop, given up on (no more restarts)."""
    health_timeout_s: float = 10.0
    """A replica that served and then gets no answer to its health checks for this long is killed."""
    start_timeout_s: float = 600.0
    """`--start-timeout`. At the stack's start-up, every service must be SERVING within this long
    (else the stack stops). A restarted replica that is not SERVING within this long (loading its
    model) is killed, counted from its start: the time before it binds its port (one moved to a
    free port, whose health is not asked until then) is part of it."""

    def __post_init__(self) -> None:
        if not (0 < self.backoff_initial_s <= self.backoff_max_s):
            raise ValueError(
                f"backoff must be 0 < initial <= max, got {self.backoff_initial_s}, {self.backoff_max_s}"
            )
        if self.crash_loop_exits < 1 or self.crash_loop_window_s <= 0:
            raise ValueError(
                f"a crash loop needs >= 1 exit in > 0 s, got {self.crash_loop_exits} "
                f"in {self.crash_loop_window_s}"
            )
        if self.health_timeout_s <= 0:
            raise ValueError(f"--health-timeout must be > 0 seconds, got {self.health_timeout_s}")
        if self.start_timeout_s <= 0:
            raise ValueError(f"--start-timeout must be > 0 seconds, got {self.start_timeout_s}")


class State(enum.Enum):
    STARTING = "starting"  # started, not SERVING yet
    SERVING = "serving"  # has been SERVING since it was (re)started
    WAITING = "waiting"  # exited; restarts at `restart_at`
    GIVEN_UP = "given up"  # crash-looping: never restarted again


@dataclass(frozen=True)
class Exit:
    """What to do about one exit: restart after `delay_s`, or give up (`given_up`)."""

    given_up: bool
    delay_s: float
    recent_exits: int
    """Exits within the crash-loop window, this one included."""


class Replica:
    """The restart bookkeeping of one replica (one process slot of the stack)."""

    def __init__(self, name: str, policy: RestartPolicy, now: float) -> None:
        self.name = name
        self.policy = policy
        self.state = State.STARTING
        self.restarts = 0
        self._started_at = now
        self._serving_since: float | None = None
        self._last_answer_at = now
        self._exits: deque[float] = deque()
        self._backoff_s = policy.backoff_initial_s
        self._restart_at = 0.0

    @property
    def running(self) -> bool:
        """A process should be running for it (STARTING or SERVING)."""
        return self.state in (State.STARTING, State.SERVING)

    def answered(self, now: float, serving: bool) -> None:
        """Its health check got an answer (`serving`: SERVING, else NOT_SERVING)."""
        if not self.running:
            return
        self._last_answer_at = now
        if serving and self.state is State.STARTING:
            self.state = State.SERVING
            self._serving_since = now

    def unresponsive_s(self, now: float) -> float | None:
        """Why it should be killed: seconds without a health answer (SERVING) or without being
        SERVING since its start (STARTING, whether it has been asked yet or not) beyond the
        policy's limits; None while it is fine."""
        if self.state is State.SERVING:
            silent_s = now - self._last_answer_at
            return silent_s if silent_s > self.policy.health_timeout_s else None
        if self.state is State.STARTING:
            starting_s = now - self._started_at
            return starting_s if starting_s > self.policy.start_timeout_s else None
        return None

    def exited(self, now: float) -> Exit:
        """Its process exited (or was killed for not answering): restart later, or give up."""
        if self._serving_since is not None and now - self._serving_since >= self.policy.healthy_reset_s:
            self._backoff_s = self.policy.backoff_initial_s  # it had been fine for a while
        self._exits.append(now)
        while self._exits and self._exits[0] < now - self.policy.crash_loop_window_s:
            self._exits.popleft()
        self._serving_since = None
        if len(self._exits) >= self.policy.crash_loop_exits:
            self.state = State.GIVEN_UP
            return Exit(given_up=True, delay_s=0.0, recent_exits=len(self._exits))
        delay_s = self._backoff_s
        self._backoff_s = min(self._backoff_s * 2, self.policy.backoff_max_s)
        self.state = State.WAITING
        self._restart_at = now + delay_s
        return Exit(given_up=False, delay_s=delay_s, recent_exits=len(self._exits))

    def port_taken(self, now: float) -> float:
        """Its restart was due, but another process holds the port it must listen on (the gateway's,
        which its clients know): no process was started. Look again later, backing off as after an
        exit, without counting one: nothing crashed, and the port may come free. The wait."""
        delay_s = self._backoff_s
        self._backoff_s = min(self._backoff_s * 2, self.policy.backoff_max_s)
        self._restart_at = now + delay_s
        return delay_s

    def restart_due(self, now: float) -> bool:
        return self.state is State.WAITING and now >= self._restart_at

    def restarted(self, now: float) -> None:
        """A new process was started for it."""
        self.state = State.STARTING
        self.restarts += 1
        self._started_at = self._last_answer_at = now


def stage_lost(replicas: list[Replica]) -> bool:
    """Every replica of a stage has been given up on: the stack cannot answer any more."""
    return bool(replicas) and all(r.state is State.GIVEN_UP for r in replicas)
