"""`epd health HOST:PORT`: the probe compose and Kubernetes run; and the answers `epd serve`'s
supervisor reads (epd/cli/supervisor.py)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epd.transport.security import blocking_channel

# No answer came back: the server is not there, or does not respond (stopped, hung).
_NO_ANSWER = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)


def health_answer(address: str, service: str = "", timeout_s: float = 3.0) -> bool | None:
    """True: SERVING; False: the server answered, but not SERVING (loading its model, draining,
    a stage behind it down, an unknown service); None: no answer within `timeout_s`."""
    return _check(address, service, timeout_s)[0]


def _check(address: str, service: str, timeout_s: float) -> tuple[bool | None, str]:
    """`health_answer`'s answer, and what came back: the serving status's name, or the gRPC
    status and its details (for no answer, gRPC's reason: connection refused, TLS handshake...)."""
    with blocking_channel(address) as channel:
        return _ask(channel, service, timeout_s)


def _ask(channel: grpc.Channel, service: str, timeout_s: float) -> tuple[bool | None, str]:
    stub = health_pb2_grpc.HealthStub(channel)
    try:
        reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
    except grpc.RpcError as exc:
        code = exc.code()
        return (None if code in _NO_ANSWER else False), f"{code.name}: {exc.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, status


def answer_on(channel: grpc.Channel, timeout_s: float) -> bool | None:
    """`health_answer` over an open channel (`HealthChannels`)."""
    return _ask(channel, "", timeout_s)[0]


def _supervisor_channel(address: str) -> grpc.Channel:
    # Imported here: epd.transport.server is more than a command line needs to be parsed.
    from epd.transport.server import RECONNECT_OPTIONS

    return blocking_channel(address, RECONNECT_OPTIONS)


class HealthChannels:
    """The supervisor's channels to its services: one per service process, kept from one check to
    the next. A channel per check (as before) cost a TCP connection and an HTTP/2 handshake every
    second in the launcher and in each service (about 1 ms of CPU a second each, idle); a process
    started again gets a channel of its own, never one waiting out the reconnect backoff of its
    predecessor's. No gRPC beyond `open_channel` and `close()`: unit-tested."""

    def __init__(self, open_channel: Callable[[str], grpc.Channel] = _supervisor_channel) -> None:
        self._open = open_channel
        self._by_process: dict[tuple[str, int], grpc.Channel] = {}

    def channels(self, processes: Sequence[tuple[str, int]]) -> list[grpc.Channel]:
        """A channel to each (address, pid) in `processes`: the one it had, else a new one; the
        channels of processes no longer listed (exited, restarted, moved) are closed. Not while a
        check is in flight on one of them (the supervisor asks again once all have answered)."""
        for key in [k for k in self._by_process if k not in processes]:
            self._by_process.pop(key).close()
        for key in processes:
            if key not in self._by_process:
                self._by_process[key] = self._open(key[0])
        return [self._by_process[key] for key in processes]

    def close(self) -> None:
        self.channels([])


def is_serving(address: str, service: str = "", timeout_s: float = 3.0) -> bool:
    return health_answer(address, service, timeout_s) is True


def check_health(address: str, service: str, timeout_s: float) -> int:
    """Exit 0 when SERVING; 1 otherwise, with one line saying which: the server's answer
    (NOT_SERVING while it loads, drains or misses a stage), or no answer at all. A probe retries
    either way, but a person reading the line needs to know whether anything is listening."""
    answer, what = _check(address, service, timeout_s)
    if answer is None:
        # gRPC's reason says which: nothing listening (connection refused), the TLS handshake
        # (a client certificate the server wants, a CA that does not verify it), or a hung server.
        print(f"no answer from {address} within {timeout_s:g} s ({what})", file=sys.stderr)
    elif answer:
        print("SERVING", file=sys.stderr)
    else:  # an answer: a status other than SERVING, or an error such as an unknown --service
        print("NOT_SERVING" if what == "NOT_SERVING" else f"NOT_SERVING ({what})", file=sys.stderr)
    return 0 if answer else 1
