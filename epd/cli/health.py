"""`epd health HOST:PORT`: the probe compose and Kubernetes run; and the answers `epd serve`'s
supervisor reads (epd/cli/supervisor.py)."""

from __future__ import annotations

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epd.transport.security import blocking_channel

# No answer came back: the server is not there, or does not respond (stopped, hung).
_NO_ANSWER = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)


def health_answer(address: str, service: str = "", timeout_s: float = 3.0) -> bool | None:
    """True: SERVING; False: the server answered, but not SERVING (loading its model, draining,
    a stage behind it down, an unknown service); None: no answer within `timeout_s`."""
    with blocking_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as exc:
            return None if exc.code() in _NO_ANSWER else False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def is_serving(address: str, service: str = "", timeout_s: float = 3.0) -> bool:
    return health_answer(address, service, timeout_s) is True


def check_health(address: str, service: str, timeout_s: float) -> int:
    ok = is_serving(address, service, timeout_s)
    print("SERVING" if ok else "NOT_SERVING", file=sys.stderr)
    return 0 if ok else 1
