"""Which replica of a stage gets a call: media affinity by rendezvous hashing, round robin without
media. Pure bookkeeping (no gRPC); `epd.transport.remote_stages.ReplicaPool` holds one per stage.

A request about media with sha256 S goes to the replica with the highest score hash(S, replica)
among the replicas currently believed healthy (rendezvous, or highest-random-weight, hashing). Every
request about the same video therefore reaches the same encoder replica (its token cache holds the
video's visual tokens) and the same prefill replica (its prefix cache holds the conversation's KV).
Each replica's score for a key is independent of the others, so adding a replica moves only the
keys it now wins, and losing one moves only the keys it held: each to the replica that was second
in its order, which is also where a failed call is retried (`order(key)[1]`).

Health has two sources: the gateway's grpc.health checks (`set_serving`: down until a later check
says serving) and calls that failed with UNAVAILABLE (`mark_failed`: down for `failure_hold_s`,
then tried again). Replicas believed down are not dropped from `order`, only put last, so that a
stale belief costs one failed try, never a refused request.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence

FAILURE_HOLD_S = 5.0
"""How long a replica whose call failed with UNAVAILABLE gets no calls first (it is still tried
last, and the health checks may keep it down longer)."""


def rendezvous_score(key: str, replica: str) -> int:
    """A stable 64-bit score of `replica` for `key` (the same in every process and run)."""
    digest = hashlib.blake2b(f"{key}\0{replica}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rendezvous_order(key: str, replicas: Sequence[str]) -> list[str]:
    """`replicas` by descending score for `key` (ties, i.e. duplicates, by name): the first is the
    key's home, the second where it goes when the first is gone, and so on."""
    return sorted(replicas, key=lambda r: (-rendezvous_score(key, r), r))


class ReplicaChooser:
    """The order in which one call tries the replicas of a stage.

    `order(key)`: with a key (a media sha256), the replicas believed healthy in rendezvous order
    for the key, then those believed down in the same order; without one, the healthy replicas in
    turn (round robin, each call starting one further), then the down ones.
    """

    def __init__(
        self,
        replicas: Sequence[str],
        failure_hold_s: float = FAILURE_HOLD_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not replicas:
            raise ValueError("a stage needs at least one address")
        self.replicas = list(replicas)
        self.failure_hold_s = failure_hold_s
        self._clock = clock
        self._down: set[str] = set()  # by the health checks
        self._failed_until: dict[str, float] = {}  # by calls that failed with UNAVAILABLE
        self._turn = 0

    def set_serving(self, replica: str, serving: bool) -> None:
        """A health check's answer for `replica` (unknown replicas are ignored)."""
        if replica not in self.replicas:
            return
        if serving:
            self._down.discard(replica)
        else:
            self._down.add(replica)

    def mark_failed(self, replica: str) -> None:
        """A call to `replica` failed with UNAVAILABLE: it gets calls only after the others for
        `failure_hold_s`."""
        if replica in self.replicas:
            self._failed_until[replica] = self._clock() + self.failure_hold_s

    def is_healthy(self, replica: str) -> bool:
        if replica in self._down:
            return False
        until = self._failed_until.get(replica)
        if until is not None and self._clock() >= until:
            del self._failed_until[replica]
            until = None
        return until is None

    def healthy(self) -> list[str]:
        return [r for r in self.replicas if self.is_healthy(r)]

    def order(self, key: str = "") -> list[str]:
        healthy = self.healthy()
        if key:
            ranked = rendezvous_order(key, self.replicas)
            up = set(healthy)
            return [r for r in ranked if r in up] + [r for r in ranked if r not in up]
        turn = healthy or self.replicas  # all believed down: round robin over all of them
        start = self._turn % len(turn)
        self._turn += 1
        rotated = turn[start:] + turn[:start]
        return rotated + [r for r in self.replicas if r not in rotated]
