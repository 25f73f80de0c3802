"""Start the front door: `start(config)` for tests, `main(config)` for `epd serve gateway`.

`main` serves gRPC and, unless `config.http.port` is None, the OpenAI-compatible HTTP API in the
same event loop, both over one metered pipeline.
"""

from __future__ import annotations

import asyncio
import logging

from epd.gateway.admission import Admission
from epd.gateway.config import GatewayConfig, open_without_key
from epd.gateway.dns_replicas import Lookup, ReplicaSets, getaddrinfo_lookup
from epd.gateway.engine_load import watch_loads
from epd.gateway.metrics import GatewayMetrics, MeteredPipeline
from epd.gateway.model_info import watch_model_info
from epd.gateway.pipeline import Pipeline
from epd.gateway.readiness import InProcessHealth, StageHealth, watch_stages
from epd.gateway.replica_list import (
    ReplicaFileError,
    ReplicaListWatcher,
    ReplicaUpdater,
    read_replicas,
)
from epd.gateway.servicer import SERVICE_NAME, GatewayServicer
from epd.transport.auth import ApiKeyInterceptor
from epd.transport.remote_decode import RemoteDecodeStage
from epd.transport.remote_encode import RemoteEncodeStage
from epd.transport.remote_prefill import RemotePrefillStage
from epd.transport.replica_pool import ReplicaPool
from epd.transport.server import HealthyServer, StopSignals, create_server, serve_until_signal
from epd.v1 import gateway_pb2_grpc

log = logging.getLogger(__name__)


def stage_addresses(config: GatewayConfig) -> dict[str, tuple[str, ...]]:
    """Each stage's replicas at start: the replica file's list where it names the stage, else
    the flag's. ReplicaFileError when the file is unusable."""
    addresses = {
        "encoder": config.encoder_addresses,
        "prefill": config.prefill_addresses,
        "decode": config.decode_addresses,
    }
    if config.replicas_file:
        addresses.update(read_replicas(config.replicas_file))
    return addresses


class RemotePipeline(Pipeline):
    """The pipeline over remote stages: it owns their replica pools and prefill's KV release
    channels, and `aclose` closes them all (left open, they kept reconnecting to the replicas,
    stopped or not, for as long as the process lived)."""

    def __init__(
        self, encoder: RemoteEncodeStage, prefill: RemotePrefillStage, decoder: RemoteDecodeStage
    ) -> None:
        super().__init__(encoder, prefill, decoder)
        self.encoder: RemoteEncodeStage = encoder
        self.prefill: RemotePrefillStage = prefill
        self.decoder: RemoteDecodeStage = decoder

    async def aclose(self) -> None:
        await super().aclose()
        for stage in (self.encoder, self.prefill, self.decoder):
            await stage.close()


def remote_pipeline(config: GatewayConfig, replicas: ReplicaSets | None = None) -> RemotePipeline:
    """Stages calling the replicas of `replicas` (default: the configured lists, `dns:///` names
    not looked up yet: `start` has them looked up once it serves)."""
    t = config.stage_timeout_s
    replicas = replicas or ReplicaSets(stage_addresses(config))

    def pool(stage: str) -> ReplicaPool:
        listed = replicas.expanded(stage)
        return ReplicaPool(
            listed.addresses,
            routing=config.routing,
            attempt_timeout_s=config.stage_attempt_timeout_s,
            max_excess_load=config.affinity_max_excess_load,
            server_names=listed.server_names,
        )

    return RemotePipeline(
        RemoteEncodeStage(pool("encoder"), t, config.max_transfer_bytes),
        RemotePrefillStage(pool("prefill"), t),
        RemoteDecodeStage(pool("decode"), t),
    )


def stage_pools(pipeline: Pipeline) -> dict[str, ReplicaPool]:
    """The replica pools of a pipeline's remote stages, by stage name (none for local stages)."""
    stages = {"encoder": pipeline.encoder, "prefill": pipeline.prefill, "decode": pipeline.decoder}
    return {
        name: pool
        for name, stage in stages.items()
        if isinstance(pool := getattr(stage, "pool", None), ReplicaPool)
    }


async def start(
    config: GatewayConfig,
    pipeline: Pipeline,
    admission: Admission | None = None,
    health: StageHealth | InProcessHealth | None = None,
    replicas: ReplicaSets | None = None,
    lookup: Lookup = getaddrinfo_lookup,
    http_port: int | None = None,
) -> HealthyServer:
    """`replicas`: what `pipeline`'s pools were built from; default: their lists as they are.
    `http_port`: the HTTP API's bound port, when it serves one (written to the ports file too).
    `dns:///` names not looked up yet are looked up in the background (`lookup`) once the server
    serves: a slow or unreachable DNS server must not keep the gateway from answering its health
    checks (NOT_SERVING until every stage has a replica serving). `pipeline` stays the caller's
    to close (`Pipeline.aclose`) once the server has stopped: `main` does."""
    # A metered pipeline's metrics count the gRPC API's calls too (epd_grpc_responses_total).
    metrics = pipeline.metrics if isinstance(pipeline, MeteredPipeline) else None
    servicer = GatewayServicer(config, pipeline, admission, metrics)
    # The HTTP API's key (--api-key) guards the gRPC API too; health and reflection stay open.
    # The calls it refuses never reach the servicer: they are counted as it refuses them.
    interceptors = (
        [ApiKeyInterceptor(config.http.api_keys, (f"/{SERVICE_NAME}/",), servicer.count_refused)]
        if config.http.api_keys
        else []
    )
    hs = await create_server(
        config.server,
        lambda s: gateway_pb2_grpc.add_GatewayServiceServicer_to_server(servicer, s),
        [SERVICE_NAME],
        interceptors,
        public=True,  # the front door: its internal secret is only presented to the stages
        other_ports=None if http_port is None else {"http": http_port},
    )
    hs.cut_calls = servicer.cut_calls_in_flight  # at the end of the grace period: each call's own status
    # NOT_SERVING until every stage has a replica serving, and again whenever a stage has none
    # (epd/gateway/readiness.py); the same checks tell the replica pools which replicas to route to.
    pools = stage_pools(pipeline)
    health = health or StageHealth(config, pools=pools)
    watch = watch_stages(hs, health, config.stage_check_interval_s)
    hs.background_tasks.append(asyncio.ensure_future(watch))
    # Routing's inputs besides health: the replicas' loads, the `dns:///` names' lookups and the
    # replica file when there is one; the last two change the lists through one ReplicaUpdater.
    if pools and config.routing == "affinity":
        hs.background_tasks.append(asyncio.ensure_future(watch_loads(pools, config.load_refresh_interval_s)))
    # The served model's vocabulary and limits, from prefill (epd/gateway/model_info.py).
    if isinstance(pipeline.prefill, RemotePrefillStage):
        info = watch_model_info(pipeline.prefill, config.stage_check_interval_s)
        hs.background_tasks.append(asyncio.ensure_future(info))
    # Both begin with what start-up left undone, off the start: the lookups of the names (`run`)
    # and the file as it is now (`reload_first`: it may have changed since the pools were built).
    if pools:
        updater = ReplicaUpdater(pools, replicas, lookup)
        hs.background_tasks.append(asyncio.ensure_future(updater.run(config.dns_refresh_interval_s)))
        if config.replicas_file:
            watcher = ReplicaListWatcher(config.replicas_file, updater, config.replicas_poll_interval_s)
            hs.background_tasks.append(asyncio.ensure_future(watcher.run(reload_first=True)))
    return hs


async def main(config: GatewayConfig, local: Pipeline | None = None) -> None:
    """The front door until SIGTERM/SIGINT: over the remote stages of `config`, or over `local`
    stages in this process (`epd serve --colocate`)."""
    # Before anything binds: exit non-zero with one line, not a traceback.
    problem = open_without_key(config)
    if problem:
        raise SystemExit(f"epd serve gateway: {problem}")
    signals = StopSignals()  # first: a signal while the servers start stops them cleanly
    metrics = GatewayMetrics()
    try:
        # The names as written: `start` looks them up once it serves (a hung DNS server kept the
        # gateway from binding, and so from answering its probes, for as long as the lookup took).
        replicas = None if local is not None else ReplicaSets(stage_addresses(config))
    except ReplicaFileError as exc:
        raise SystemExit(f"epd serve gateway: {exc}") from None
    stages = local or remote_pipeline(config, replicas)
    pipeline = MeteredPipeline(stages, metrics)
    # One health view for HTTP /health and gRPC's health and readiness: one check in flight at a
    # time, one record of which replicas are down (and one log line when one goes down).
    health: StageHealth | InProcessHealth = (
        InProcessHealth() if local is not None else StageHealth(config, pools=stage_pools(pipeline))
    )
    admission = Admission.of_gateway(config)  # one per process: a client's limit counts both APIs
    http = None
    try:
        if config.http.port is not None:
            from epd.gateway.http_server import start_http_api  # aiohttp only when asked for

            http = await start_http_api(config, pipeline, metrics, health, admission)
            if config.server.security.tls_cert and any(
                not site.name.startswith("https") for site in http.runner.sites
            ):
                raise SystemExit(
                    "epd serve gateway: --tls-cert was given but the HTTP API (--http-port) serves "
                    "plain HTTP: refusing to expose it unencrypted"
                )
        hs = await start(config, pipeline, admission, health, replicas, http_port=http.port if http else None)
        # HTTP drains alongside gRPC, each for up to the grace period; a second signal cuts both.
        await serve_until_signal(
            hs, config.server.grace_s, signals=signals, drain_too=http.stop if http else None
        )
        http = None
    finally:
        if http is not None:  # start-up failed after the HTTP API bound
            await http.stop()
        # After the drain (no call is in flight: a call on a closed channel crashed the process):
        # the stages' channels, or the embedded pipeline's threads.
        await pipeline.aclose()
