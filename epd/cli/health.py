"""`epd health HOST:PORT`: the probe compose and Kubernetes run."""

from __future__ import annotations

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def is_serving(address: str, service: str = "", timeout_s: float = 3.0) -> bool:
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def check_health(address: str, service: str, timeout_s: float) -> int:
    ok = is_serving(address, service, timeout_s)
    print("SERVING" if ok else "NOT_SERVING", file=sys.stderr)
    return 0 if ok else 1
