"""The gateway's health follows its stages: SERVING only while every stage replica it calls
answers SERVING, so a client (or compose's `service_healthy`, or a load balancer) never reaches
a front door whose stages are still loading their models, or have died since.

`StageHealth` checks the stages on demand (HTTP `GET /health`); `watch_stages` re-checks them
every `stage_check_interval_s` and flips the gateway's grpc.health status when they change. Each
check also tells the stages' replica pools which replicas serve: requests are routed over those.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epd.gateway.config import GatewayConfig
from epd.transport.remote_stages import ReplicaPool
from epd.transport.server import RECONNECT_OPTIONS, HealthyServer, channel_options

log = logging.getLogger(__name__)

STARTUP_POLL_S = 0.25
"""Check interval until the stages first serve: the gateway comes up as soon as they do."""



class StageHealth:
    """grpc.health checks of every configured stage replica."""

    def __init__(
        self, config: GatewayConfig, timeout_s: float = 2.0, pools: Mapping[str, ReplicaPool] | None = None
    ) -> None:
        self.timeout_s = timeout_s
        self.pools = dict(pools or {})
        """By stage name: each check's answers also tell that stage's pool which replicas serve,
        so that media affinity routes over the healthy ones (epd/transport/affinity.py)."""
        self.addresses = [
            (stage, address)
            for stage, addresses in (
                ("encoder", config.encoder_addresses),
                ("prefill", config.prefill_addresses),
                ("decode", config.decode_addresses),
            )
            for address in addresses
        ]
        self._channels: dict[str, grpc.aio.Channel] = {}

    async def down(self) -> list[str]:
        """"STAGE ADDRESS" of each replica that is not serving: for the server log only."""
        results = await asyncio.gather(*(self._serving(address) for _, address in self.addresses))
        for (stage, address), ok in zip(self.addresses, results):
            pool = self.pools.get(stage)
            if pool is not None:
                pool.set_serving(address, ok)
        return [f"{stage} {address}" for (stage, address), ok in zip(self.addresses, results) if not ok]

    async def not_serving(self) -> list[str]:
        """Names of the stages with a replica not serving ([] = healthy), as HTTP /health shows
        them to anyone: the addresses go to the server log, not to the client."""
        down = await self.down()
        if down:
            log.warning("stage replicas not serving: %s", ", ".join(down))
        return sorted({entry.split(" ", 1)[0] for entry in down})

    async def _serving(self, address: str) -> bool:
        channel = self._channels.get(address)
        if channel is None:
            options = [*channel_options(), *RECONNECT_OPTIONS]
            channel = self._channels[address] = grpc.aio.insecure_channel(address, options=options)
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=self.timeout_s
            )
        except grpc.aio.AioRpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()


class InProcessHealth:
    """The stages of a colocated server (`epd serve --colocate`): they live in this process and
    serve as soon as it does."""

    async def down(self) -> list[str]:
        return []

    async def not_serving(self) -> list[str]:
        return []

    async def close(self) -> None:
        pass


async def watch_stages(hs: HealthyServer, health: StageHealth | InProcessHealth, interval_s: float) -> None:
    """Set `hs` SERVING once every stage serves, then keep its status in step with the stages,
    checked every `interval_s` (0: never again after the first SERVING). Runs until cancelled."""
    serving: bool | None = None
    try:
        while True:
            down = await health.down()
            if serving is None and down:
                await asyncio.sleep(STARTUP_POLL_S)  # still starting: stay NOT_SERVING, quietly
                continue
            if serving != (not down):
                serving = not down
                await hs.set_serving(serving)
                if serving:
                    log.info("all stages serving: gateway SERVING on port %d", hs.port)
                else:
                    log.warning("gateway NOT_SERVING: not serving: %s", ", ".join(down))
            if interval_s <= 0:
                return
            await asyncio.sleep(interval_s)
    finally:
        await health.close()
