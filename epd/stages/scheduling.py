"""vLLM's `--scheduling-policy`: the order in which a stage serves the requests waiting for it.

    fcfs       first come, first served (the default): arrival order; a request's `priority`
               must be 0 (unset), as vLLM refuses another without priority scheduling.
    priority   by each request's `priority`, lower first (vLLM's: any integer, default 0, so a
               negative one goes ahead of the unset ones), ties in arrival order.

Every queue a request waits in before it runs is a `WaitingQueue`: encoder's tower jobs
(`encoder_svc/scheduler.py`), prefill's prompts (`prefill_svc/scheduler.py`), decode's requests
waiting for KV room (`decode_svc/kv_memory.py`). Only the waiting order changes: nothing already
running is preempted (vLLM preempts the lowest-priority running request when KV blocks run out and
recomputes it later; here decode reserves a request's room for its whole life before it starts,
so room never runs out mid-answer, and no stage can recompute a request's lost work). A request
of low priority waits as long as higher ones keep coming: as vLLM's, no ageing.

No torch, no gRPC: unit-tested alone (tests/unit/stages/test_scheduling.py).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator
from typing import Generic, TypeVar

SCHEDULING_POLICIES = ("fcfs", "priority")

PRIORITY_MIN = -(1 << 31)
PRIORITY_MAX = (1 << 31) - 1
"""A request's `priority` range: the wire's int32 (vLLM takes any Python int)."""

T = TypeVar("T")


def check_scheduling_policy(policy: str) -> None:
    """ValueError naming the flag, for a policy not in `SCHEDULING_POLICIES`."""
    if policy not in SCHEDULING_POLICIES:
        raise ValueError(
            f"--scheduling-policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {policy!r}"
        )


def check_priority(priority: int, policy: str) -> None:
    """ValueError unless `priority` is in the wire's range and, under fcfs, 0 (vLLM's refusal:
    a priority nothing orders by would be ignored silently)."""
    if not PRIORITY_MIN <= priority <= PRIORITY_MAX:
        raise ValueError(f"priority must be an integer from {PRIORITY_MIN} to {PRIORITY_MAX}, got {priority}")
    if priority != 0 and policy != "priority":
        raise ValueError(
            f"priority {priority} needs priority scheduling, and this server schedules first come, "
            "first served: start it with --scheduling-policy priority, or leave priority unset (0)"
        )


class WaitingQueue(Generic[T]):
    """Waiting items in the order they are served: `(priority, arrival)` under the priority policy,
    arrival alone under fcfs (every priority is then 0). `push` is O(n) (sorted insertion), which
    queues of hundreds of requests do not feel; `pop` and `peek` take the first."""

    def __init__(self, policy: str = "fcfs") -> None:
        check_scheduling_policy(policy)
        self.policy = policy
        self._keys: list[tuple[int, int]] = []  # (priority, arrival number), sorted
        self._items: list[T] = []  # in the same order
        self._arrivals = itertools.count()

    def push(self, item: T, priority: int = 0) -> None:
        key = (priority if self.policy == "priority" else 0, next(self._arrivals))
        i = bisect.bisect_right(self._keys, key)
        self._keys.insert(i, key)
        self._items.insert(i, item)

    def goes_first(self, priority: int = 0) -> bool:
        """Whether an item pushed now with `priority` would be served before every waiting one
        (the queue is empty, or under the priority policy it is of a lower value than the first's):
        one that can be served at once then need not queue at all."""
        if not self._keys:
            return True
        return self.policy == "priority" and priority < self._keys[0][0]

    def peek(self) -> T:
        """The item served next (IndexError when empty)."""
        return self._items[0]

    def pop(self) -> T:
        """Take the item served next (IndexError when empty)."""
        del self._keys[0]
        return self._items.pop(0)

    def reprioritize(self, item: T, priority: int) -> bool:
        """Move `item` (by identity) to its place at `priority`, keeping its arrival: among items
        of that priority it goes where it would be had it come with it. False when it is not here."""
        for i, waiting in enumerate(self._items):
            if waiting is item:
                arrival = self._keys[i][1]
                del self._keys[i], self._items[i]
                key = (priority if self.policy == "priority" else 0, arrival)
                at = bisect.bisect_right(self._keys, key)
                self._keys.insert(at, key)
                self._items.insert(at, item)
                return True
        return False

    def remove(self, item: T) -> bool:
        """Take `item` out wherever it waits (by identity); False when it is not here."""
        for i, waiting in enumerate(self._items):
            if waiting is item:
                del self._keys[i], self._items[i]
                return True
        return False

    def __contains__(self, item: object) -> bool:
        return any(waiting is item for waiting in self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[T]:
        return iter(list(self._items))
