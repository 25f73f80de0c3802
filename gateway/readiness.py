"""The gateway reports SERVING only once every stage it calls does, so a client (or compose's
`service_healthy`) never reaches a front door whose stages are still loading their models."""

from __future__ import annotations

import asyncio
import logging

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

log = logging.getLogger(__name__)


async def stage_serving(address: str, timeout_s: float = 2.0) -> bool:
    async with grpc.aio.insecure_channel(address) as channel:
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=timeout_s
            )
        except grpc.aio.AioRpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


async def wait_for_stages(addresses: list[str], poll_s: float = 0.25) -> None:
    """Returns once every address answers SERVING."""
    pending = list(addresses)
    while pending:
        results = await asyncio.gather(*(stage_serving(a) for a in pending))
        pending = [a for a, ok in zip(pending, results) if not ok]
        if pending:
            await asyncio.sleep(poll_s)
    log.info("all stages serving: %s", ", ".join(addresses))
