"""The gateway's health follows its stages: SERVING while every stage has at least one replica
that answers SERVING, so a client (or compose's `service_healthy`, or a load balancer) never
reaches a front door whose stages are still loading their models, or have all died since; one
replica of several going away only takes it out of routing.

`StageHealth` checks the stages on demand (HTTP `GET /health`); `watch_stages` re-checks them
every `stage_check_interval_s` and flips the gateway's grpc.health status when they change. The
gateway builds one (`server.main`) for both, so they share one view: a check in flight, which
replicas are down, and the log line that says so once. Each
check also tells the stages' replica pools which replicas serve: requests are routed over those
(a replica that stopped serving leaves routing at the check, one whose call failed at once; either
comes back when a check finds it SERVING). The replicas checked are the pools' current ones, so a
reloaded replica list (`epd.gateway.replica_list`) is followed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epd.gateway.config import GatewayConfig
from epd.transport.aio_cancel import cancelled_by_grpc
from epd.transport.replica_pool import ReplicaPool, unresolved
from epd.transport.security import stage_channel
from epd.transport.server import RECONNECT_OPTIONS, HealthyServer, channel_options
from epd.transport.single_flight import SingleFlight

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
        self._configured = {
            "encoder": list(config.encoder_addresses),
            "prefill": list(config.prefill_addresses),
            "decode": list(config.decode_addresses),
        }
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._last_down: set[str] = set()
        self._ever_served = False
        self.status = SingleFlight(self._check)
        """Check every replica once: (stages with no replica serving, "STAGE ADDRESS" of each
        replica not serving). The pools learn each answer. Concurrent callers (HTTP /health is
        open to anyone) share the check in flight."""

    @property
    def addresses(self) -> list[tuple[str, str]]:
        """(stage, address) of every replica: a pool's current list, else the configured one."""
        return [
            (stage, address)
            for stage, configured in self._configured.items()
            for address in (self.pools[stage].addresses if stage in self.pools else configured)
        ]

    async def _check(self) -> tuple[list[str], list[str]]:
        addresses = self.addresses
        results = await asyncio.gather(*(self._serving(stage, address) for stage, address in addresses))
        serving_stages = set()
        for (stage, address), ok in zip(addresses, results):
            pool = self.pools.get(stage)
            if pool is not None:
                pool.set_serving(address, ok)
            if ok:
                serving_stages.add(stage)
        down = [f"{stage} {address}" for (stage, address), ok in zip(addresses, results) if not ok]
        stages_down = sorted({stage for stage, _ in addresses} - serving_stages)
        self._log_changes(down, stages_down)
        return stages_down, down

    def _log_changes(self, down: list[str], stages_down: list[str]) -> None:
        if not self._ever_served:  # starting: quiet until every stage has a replica serving
            if stages_down:
                return
            self._ever_served = True
        now = set(down)
        if now - self._last_down:
            log.warning(
                "stage replicas not serving (out of routing): %s", ", ".join(sorted(now - self._last_down))
            )
        if self._last_down - now:
            log.info("stage replicas serving again: %s", ", ".join(sorted(self._last_down - now)))
        self._last_down = now

    async def down(self) -> list[str]:
        """ "STAGE ADDRESS" of each replica that is not serving: for the server log only."""
        return (await self.status())[1]

    async def not_serving(self) -> list[str]:
        """Names of the stages with no replica serving ([] = healthy), as HTTP /health shows them
        to anyone: the addresses go to the server log, not to the client."""
        return (await self.status())[0]

    def _channel(self, stage: str, address: str) -> grpc.aio.Channel:
        """The channel the stage's calls to `address` use, where a pool routes them: a replica is
        "serving" only once a call can go out on it. A check on a channel of its own answered
        SERVING as soon as a restarted replica listened, while the calls' channel still waited out
        its reconnect backoff (up to RECONNECT_OPTIONS' 2 s), failing every call at once."""
        pool = self.pools.get(stage)
        if pool is not None and address in pool.addresses:
            return pool.channel(address)
        channel = self._channels.get(address)
        if channel is None:
            options = [*channel_options(), *RECONNECT_OPTIONS]
            channel = self._channels[address] = stage_channel(address, options)
        return channel

    async def _serving(self, stage: str, address: str) -> bool:
        if stage in self.pools and unresolved(address):  # a name the pool routes nothing to yet
            return False
        channel = self._channel(stage, address)
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=self.timeout_s
            )
        except grpc.aio.AioRpcError:
            return False
        except asyncio.CancelledError:
            # The replica left the pool during the check (a lookup, a reloaded replica file) and
            # its channel closed under the call: grpc.aio cancels it. Let through, it ended the
            # watch's task, and the gateway's health stayed as it was for good.
            if not cancelled_by_grpc():
                raise
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    async def close(self) -> None:
        """Close the checks' own channels (the pools' are the pipeline's). Idempotent: the gateway's
        one StageHealth is closed by the gRPC server's watch and by the HTTP API's stop, whichever
        ends first; a check after it opens a channel the next close closes."""
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close()


class InProcessHealth:
    """The stages of a colocated server (`epd serve --colocate`): they live in this process and
    serve as soon as it does."""

    async def status(self) -> tuple[list[str], list[str]]:
        return [], []

    async def down(self) -> list[str]:
        return []

    async def not_serving(self) -> list[str]:
        return []

    async def close(self) -> None:
        pass


async def watch_stages(hs: HealthyServer, health: StageHealth | InProcessHealth, interval_s: float) -> None:
    """Set `hs` SERVING once every stage has a replica serving, then keep its status in step with
    the stages, checked every `interval_s` (0: never again after the first SERVING). Runs until
    cancelled."""
    serving: bool | None = None
    try:
        while True:
            stages_down, _ = await health.status()
            if serving is None and stages_down:
                await asyncio.sleep(STARTUP_POLL_S)  # still starting: stay NOT_SERVING, quietly
                continue
            if serving != (not stages_down):
                serving = not stages_down
                await hs.set_serving(serving)
                if serving:
                    log.info("every stage has a replica serving: gateway SERVING on port %d", hs.port)
                else:
                    log.warning("gateway NOT_SERVING: no replica serving: %s", ", ".join(stages_down))
            if interval_s <= 0:
                return
            await asyncio.sleep(interval_s)
    finally:
        await health.close()
