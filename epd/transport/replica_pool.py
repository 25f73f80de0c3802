"""Channels to the replicas of one stage, and the order and retries of one call over them: what the
remote stages (`remote_encode`, `remote_prefill`, `remote_decode`, the gateway's view of the
disaggregated stack) share.

Each stage holds one channel per replica address (client-side load balancing; in Kubernetes the
addresses are the pods a headless Service's `dns:///` name resolves to, `epd.gateway.dns_replicas`,
or come from a replica file the gateway reloads, `epd.gateway.replica_list`). A call about media
goes to the replica that rendezvous hashing of the media's sha256 picks among the healthy ones,
unless that replica is overloaded; a call without media goes to the least loaded healthy replica
(`epd.transport.affinity`).

Retries, before anything reached the client only. Encode and prefill are idempotent (a cache miss
on another replica, the same answer): a try that fails with UNAVAILABLE (replica gone, draining or
not reachable), or that hangs past `attempt_timeout_s`, is made again on the next healthy replica
in the call's order, each healthy replica at most once, while the call's deadline allows: the
stage timeout, or less when the request's client gives up sooner (its gRPC deadline,
`epd.stages.deadline`), which each stage gets with the call. A decode stream is retried the same
way before its first token, and never after it (`epd.transport.remote_decode`).

Cancelling a stage call (the gateway's request task is cancelled when its client goes away)
cancels the RPC, and the service's handler is cancelled in turn.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TypeVar

import grpc

from epd.stages.deadline import timeout_within_client_deadline
from epd.transport.affinity import FAILURE_HOLD_S, MAX_EXCESS_LOAD, ReplicaChooser
from epd.transport.aio_cancel import cancelled_by_grpc
from epd.transport.errors import UpstreamError, replica_lost, stage_error
from epd.transport.server import RECONNECT_OPTIONS, channel_options, traced_channel

log = logging.getLogger(__name__)

T = TypeVar("T")

FORMER_NAMES_MAX = 4096
"""Removed addresses whose TLS name a pool remembers (`ReplicaPool.server_name`): far more pods
than leave routing within a KV cache's lifetime (--kv-ttl)."""

HANG_SLACK_S = 0.05
"""A try that ended in DEADLINE_EXCEEDED this close to its attempt timeout hung (ours expired);
one that ended sooner got the status from the service itself, which is the request's own."""


def unresolved(address: str) -> bool:
    """Whether a pool's entry is a `dns:///NAME:PORT` name the gateway has not found yet: it
    replaces a name by its addresses once a lookup finds them (`epd.gateway.dns_replicas`, whose
    DNS_PREFIX this is). Such an entry gets no call, no health check and no load read: dialled as
    written, gRPC's own resolver spread the calls over the pods behind it, past the router's
    affinity, load and failure hold, and a prefill pod reached that way advertised an IP the
    gateway could not check its certificate for (its KV cache was then not released). Nor does it
    get a channel (`ReplicaPool`): one would sit idle, never connecting, for as long as the name
    stayed unresolved (for good, for a name that never resolves)."""
    return address.startswith("dns:///")


class ReplicaPool:
    """Channels to the replicas of one stage and the order a call tries them in
    (`epd.transport.affinity.ReplicaChooser`: by a key, a media sha256 or a conversation's
    opening, else least loaded)."""

    def __init__(
        self,
        addresses: Sequence[str],
        failure_hold_s: float = FAILURE_HOLD_S,
        routing: str = "affinity",
        attempt_timeout_s: float = 0.0,
        max_excess_load: int = MAX_EXCESS_LOAD,
        server_names: Mapping[str, str] | None = None,
    ) -> None:
        self.chooser = ReplicaChooser(
            addresses, failure_hold_s, routing=routing, max_excess_load=max_excess_load
        )
        self.attempt_timeout_s = attempt_timeout_s
        """Longest one try may take before the next replica is tried (0: the whole deadline)."""
        self._server_names = dict(server_names or {})
        """address -> the name its TLS certificate is checked against, for an address the gateway
        resolved from a `dns:///NAME:PORT` entry (NAME; `epd.gateway.dns_replicas`)."""
        self._former_names: dict[str, str] = {}
        """The same for addresses no longer listed (oldest first, at most FORMER_NAMES_MAX): a
        prefill pod that left its Service's DNS answer (draining) may still hold KV caches, which
        the gateway releases at its address (`RemotePrefillStage.release`)."""
        self._by_address = {a: self._open(a) for a in self.chooser.replicas if not unresolved(a)}
        """A channel per address the pool routes over; none for a name not resolved yet."""
        self._retired: dict[str, grpc.aio.Channel] = {}  # removed replicas with calls still open
        self._closing: set[asyncio.Future] = set()
        self.call_began = asyncio.Event()
        """Set as each call begins (`begin`): the routing-load reads, which pause while the gateway
        has no call open, resume at once (`epd.gateway.engine_load.watch_loads` clears it)."""

    def _open(self, address: str) -> grpc.aio.Channel:
        # round_robin: a target gRPC resolves itself (a plain `name:port`) spreads calls over every
        # address behind the name (gRPC's default pick_first would send all of them to one).
        options = [*channel_options(), *RECONNECT_OPTIONS, ("grpc.lb_policy_name", "round_robin")]
        return traced_channel(address, options, server_name=self._server_names.get(address, ""))

    @property
    def addresses(self) -> list[str]:
        return list(self.chooser.replicas)

    @property
    def channels(self) -> list[grpc.aio.Channel]:
        """The replicas' channels, in list order (a name not resolved yet has none)."""
        return [self._by_address[a] for a in self.chooser.replicas if a in self._by_address]

    def channel(self, address: str) -> grpc.aio.Channel:
        """The channel of a listed replica; KeyError for a name not resolved yet (`unresolved`)."""
        return self._by_address[address]

    def server_name(self, address: str) -> str:
        """The name `address`'s TLS certificate is checked against ("": the address itself); for an
        address listed before, the name it was listed under."""
        if address in self._server_names or address in self.chooser.replicas:
            return self._server_names.get(address, "")
        return self._former_names.get(address, "")

    def set_addresses(
        self, addresses: Sequence[str], server_names: Mapping[str, str] | None = None
    ) -> tuple[list[str], list[str]]:
        """Route over `addresses` from now on (a reloaded replica list, a name resolved again);
        returns (added, removed). A removed replica's channel closes once the calls open on it end.
        `server_names`: as in the constructor, for the addresses added."""
        added, removed = self.chooser.set_replicas(addresses)
        for a in removed:
            if name := self._server_names.get(a):
                self._former_names.pop(a, None)
                self._former_names[a] = name
        while len(self._former_names) > FORMER_NAMES_MAX:
            del self._former_names[next(iter(self._former_names))]
        self._server_names = dict(server_names or {})
        for a in added:
            if not unresolved(a):
                self._by_address[a] = self._retired.pop(a, None) or self._open(a)
        for a in removed:
            if a in self._by_address:  # a name not resolved yet had no channel
                self._retired[a] = self._by_address.pop(a)
        self._close_idle()
        return added, removed

    def _close_idle(self) -> None:
        for address in [a for a in self._retired if self.chooser.in_flight(a) == 0]:
            closing = asyncio.ensure_future(self._retired.pop(address).close())
            self._closing.add(closing)
            closing.add_done_callback(self._closing.discard)

    def begin(self, address: str) -> None:
        self.chooser.begin(address)
        self.call_began.set()

    def end(self, address: str) -> None:
        self.chooser.end(address)
        if address in self._retired:
            self._close_idle()

    def pick(self, key: str = "") -> grpc.aio.Channel:
        """The channel a call with affinity `key` ("" = none) goes to first: `candidates`' first
        (never a name not resolved yet; IndexError when the pool has nothing else)."""
        return self.candidates(key)[0][1]

    def candidates(self, key: str = "") -> list[tuple[str, grpc.aio.Channel]]:
        """(address, channel) of the replicas one call may try, best first: the healthy ones, or
        every replica when none is believed healthy (a stale belief costs a try, not the request).
        A name not resolved yet is none (`unresolved`): [] when the pool has nothing else."""
        order = [a for a in self.chooser.order(key) if not unresolved(a)]
        healthy = set(self.chooser.healthy())
        return [(a, self._by_address[a]) for a in ([a for a in order if a in healthy] or order)]

    def nothing_to_call(self, stage: str, request_id: str) -> UpstreamError:
        """The error of a call made while every entry of the pool is a name not resolved yet."""
        log.warning(
            "request %s: no %s replica to call: %s not resolved yet",
            request_id,
            stage,
            ", ".join(self.chooser.replicas),
        )
        return UpstreamError(
            grpc.StatusCode.UNAVAILABLE, f"{stage} stage unavailable (request id {request_id})"
        )

    def still_listed(
        self, tries: Sequence[tuple[str, grpc.aio.Channel]]
    ) -> list[tuple[str, grpc.aio.Channel]]:
        """Those of a call's `tries` still in the replica list, each with its current channel. A
        replica removed since the call began (a reloaded replica file) gets no retry: its channel
        closes once its last call ends, and a call made on a closed channel crashed the gateway
        (gRPC core aborted the process, SIGSEGV / SIGABRT)."""
        return [(a, self._by_address[a]) for a, _ in tries if a in self._by_address]

    def set_serving(self, address: str, serving: bool) -> None:
        """A health check's answer (the gateway's stage checks, epd/gateway/readiness.py)."""
        self.chooser.set_serving(address, serving)

    def mark_failed(self, address: str, hung: bool = False) -> None:
        self.chooser.mark_failed(address, hung)

    def try_timeout_s(self, remaining_s: float) -> float:
        """The timeout of one try with `remaining_s` left of the call's deadline."""
        if self.attempt_timeout_s > 0:
            return min(remaining_s, self.attempt_timeout_s)
        return remaining_s

    async def call(
        self,
        key: str,
        attempt: Callable[[grpc.aio.Channel, float], Awaitable[T]],
        stage: str,
        request_id: str,
        timeout_s: float,
    ) -> T:
        """`attempt(channel, try_timeout_s)` on the first choice for `key`; when a try fails with
        UNAVAILABLE or hangs past `attempt_timeout_s`, again on the next healthy replica (a fresh
        attempt: the caller rebuilds its request stream), each at most once, within `timeout_s`
        seconds in all, and within the time the request's client has left (`epd.stages.deadline`).
        Any other failure, or the last try's, is the stage's error."""
        loop = asyncio.get_running_loop()
        end_at = loop.time() + timeout_within_client_deadline(timeout_s)
        tries = self.candidates(key)
        if not tries:
            raise self.nothing_to_call(stage, request_id)
        while tries:
            (address, channel), tries = tries[0], self.still_listed(tries[1:])
            remaining = end_at - loop.time()
            try_timeout_s = self.try_timeout_s(remaining)
            started = loop.time()
            self.begin(address)
            try:
                answer = await attempt(channel, try_timeout_s)
                self.chooser.mark_answered(address)
                return answer
            except asyncio.CancelledError:
                if not cancelled_by_grpc():
                    raise  # the request's task was cancelled (its client went away)
                # grpc.aio cancelled the call itself: its request stream could not be written
                # (epd.transport.aio_cancel). A failure of this call, not a gone client.
                late = loop.time() - started >= try_timeout_s
                log.warning(
                    "request %s: gRPC cancelled the %s call to %s while sending its request%s",
                    request_id,
                    stage,
                    address,
                    " (past its deadline)" if late else "",
                )
                code = grpc.StatusCode.DEADLINE_EXCEEDED if late else grpc.StatusCode.INTERNAL
                what = (
                    "timed out before its request was sent"
                    if late
                    else "call failed while sending its request"
                )
                raise UpstreamError(code, f"{stage} stage {what} (request id {request_id})") from None
            except grpc.aio.AioRpcError as exc:
                hung = (
                    exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                    and try_timeout_s < remaining
                    and loop.time() - started >= try_timeout_s - HANG_SLACK_S
                )
                if not replica_lost(exc) and not hung:
                    raise stage_error(exc, stage, request_id) from None
                self.mark_failed(address, hung)
                what = (
                    f"did not answer in {try_timeout_s:.1f} s" if hung else f"unavailable ({exc.details()})"
                )
                tries = self.still_listed(tries)  # the list may have changed during the try
                if not tries or end_at - loop.time() <= 0:
                    # One line (stage_error logs none): before the stages are ready every
                    # early request ends here, and two lines each buried the start-up's own.
                    if self.chooser.ready_once:
                        log.warning(
                            "%s replica %s %s for request %s; no replica left to try",
                            stage,
                            address,
                            what,
                            request_id,
                        )
                    else:
                        log.warning(
                            "request %s: the %s stage is not ready (no replica has served yet): %s %s",
                            request_id,
                            stage,
                            address,
                            what,
                        )
                    raise stage_error(exc, stage, request_id, logged=True) from None
                log.warning(
                    "%s replica %s %s for request %s; trying %s",
                    stage,
                    address,
                    what,
                    request_id,
                    tries[0][0],
                )
            finally:
                self.end(address)
        raise AssertionError("unreachable: a pool has at least one replica")

    async def close(self) -> None:
        """Close every channel of the pool, retired ones too; idempotent. The pool takes no call
        after it (a call made on a closed channel crashed the process, `still_listed`)."""
        for ch in [*self._by_address.values(), *self._retired.values()]:
            await ch.close()  # a closed grpc.aio channel's close() returns at once
        self._retired.clear()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)
