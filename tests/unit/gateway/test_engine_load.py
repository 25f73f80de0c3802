"""The engine cores' load on the gateway's /metrics, with fake stages (no model): local stages
read directly, remote replicas over a real in-process LoadService, and stages that do not answer."""

from __future__ import annotations

import asyncio

import grpc

from epd.gateway.engine_load import LoadSource
from epd.gateway.metrics import GatewayMetrics, MeteredPipeline
from epd.gateway.pipeline import Pipeline
from epd.stages.engine_core import EngineLoad
from epd.transport.load_servicer import stage_loads, with_load_service
from epd.transport.ports_file import free_port
from epd.transport.remote_decode import RemoteDecodeStage
from epd.transport.remote_encode import RemoteEncodeStage
from epd.transport.remote_prefill import RemotePrefillStage
from epd.transport.replica_pool import ReplicaPool

ENGINE_METRICS = {
    "epd_engine_running_requests": ("gauge", "num_running"),
    "epd_engine_waiting_requests": ("gauge", "num_waiting"),
    "epd_engine_batch_size": ("gauge", "last_batch_size"),
    "epd_engine_steps_total": ("counter", "num_steps"),
    "epd_engine_queue_wait_seconds_total": ("counter", "queue_wait_s_total"),
    "epd_engine_preemptions_total": ("counter", "num_preemptions"),
    "epd_engine_memory_used_bytes": ("gauge", "memory_used_bytes"),
    "epd_engine_memory_total_bytes": ("gauge", "memory_total_bytes"),
}
SHORT_TIMEOUT_S = 0.2  # only how long a scrape waits for the stage that never answers


class FakeStage:
    """A stage whose engine core reports `self.loads` (or raises / hangs when told to)."""

    def __init__(self, *loads: EngineLoad, fail: bool = False) -> None:
        self.loads = list(loads)
        self.fail = fail

    def load(self) -> list[EngineLoad]:
        if self.fail:
            raise RuntimeError("the scheduler is gone")
        return self.loads


class NoCoreStage:
    """A stage without an engine core (no `load`)."""


def _metered(encoder, prefill, decoder, timeout_s: float = 5.0) -> GatewayMetrics:
    metrics = GatewayMetrics(load_timeout_s=timeout_s)
    MeteredPipeline(Pipeline(encoder, prefill, decoder), metrics)
    return metrics


def _scrape(metrics: GatewayMetrics) -> str:
    return asyncio.run(metrics.scrape()).decode()


def _engine(
    metrics: GatewayMetrics, name: str, stage: str, core: str, replica: str = "local"
) -> float | None:
    return metrics.registry.get_sample_value(name, {"stage": stage, "core": core, "replica": replica})


def test_local_stage_loads_become_one_sample_per_metric():
    busy = EngineLoad(
        "prefill", num_running=2, num_waiting=5, last_batch_size=2, num_steps=17, queue_wait_s_total=0.75,
        num_preemptions=3, memory_used_bytes=1000, memory_total_bytes=8000,
    )  # fmt: skip
    metrics = _metered(
        FakeStage(EngineLoad("encoder", num_steps=1)), FakeStage(busy), FakeStage(EngineLoad("decode"))
    )
    text = _scrape(metrics)
    for name, (kind, attr) in ENGINE_METRICS.items():
        assert f"# TYPE {name} {kind}" in text, name
        assert _engine(metrics, name, "prefill", "prefill") == getattr(busy, attr), name
        assert _engine(metrics, name, "decode", "decode") == 0, name
    assert _engine(metrics, "epd_engine_steps_total", "encoder", "encoder") == 1
    assert 'epd_engine_steps_total{core="prefill",replica="local",stage="prefill"} 17.0' in text.splitlines()


def test_each_scrape_reads_the_load_afresh():
    decode = FakeStage(EngineLoad("decode", num_steps=1, num_running=1))
    metrics = _metered(NoCoreStage(), NoCoreStage(), decode)
    _scrape(metrics)
    assert _engine(metrics, "epd_engine_steps_total", "decode", "decode") == 1
    decode.loads = [EngineLoad("decode", num_steps=9, num_running=0)]
    assert _engine(metrics, "epd_engine_steps_total", "decode", "decode") == 1  # until the next scrape
    _scrape(metrics)
    assert _engine(metrics, "epd_engine_steps_total", "decode", "decode") == 9
    assert _engine(metrics, "epd_engine_running_requests", "decode", "decode") == 0
    # stages without an engine core have no samples and no scrape errors
    assert _engine(metrics, "epd_engine_steps_total", "encoder", "encoder") is None
    assert 'stage="encoder"' not in "".join(
        line for line in _scrape(metrics).splitlines() if "epd_load" in line
    )


def test_a_process_with_two_cores_has_one_sample_per_core():
    encoder = FakeStage(EngineLoad("video_decode", num_waiting=4), EngineLoad("encoder", num_waiting=1))
    metrics = _metered(encoder, NoCoreStage(), NoCoreStage())
    _scrape(metrics)
    assert _engine(metrics, "epd_engine_waiting_requests", "encoder", "video_decode") == 4
    assert _engine(metrics, "epd_engine_waiting_requests", "encoder", "encoder") == 1


def test_a_stage_that_fails_or_hangs_has_no_samples_and_counts_an_error():
    decode = FakeStage(EngineLoad("decode", num_steps=2))
    metrics = _metered(FakeStage(fail=True), NoCoreStage(), decode, SHORT_TIMEOUT_S)

    async def never_answers(timeout_s: float) -> list[EngineLoad]:
        await asyncio.Event().wait()
        return []

    hung = LoadSource("prefill", "10.0.0.9:50052", never_answers)
    metrics.engine_load.add_sources([lambda: [hung]])
    errors = "epd_load_scrape_errors_total"
    assert metrics.value(errors, stage="encoder", replica="local") == 0  # the series exists from the start
    for scrape in (1, 2):
        _scrape(metrics)
        assert metrics.value(errors, stage="encoder", replica="local") == scrape
        assert metrics.value(errors, stage="prefill", replica="10.0.0.9:50052") == scrape
        assert metrics.value(errors, stage="decode", replica="local") == 0
    assert _engine(metrics, "epd_engine_steps_total", "encoder", "encoder") is None
    assert _engine(metrics, "epd_engine_steps_total", "prefill", "prefill", "10.0.0.9:50052") is None
    assert _engine(metrics, "epd_engine_steps_total", "decode", "decode") == 2
    # a stage that answered before and fails now loses its samples
    decode.fail = True
    _scrape(metrics)
    assert _engine(metrics, "epd_engine_steps_total", "decode", "decode") is None
    assert metrics.value(errors, stage="decode", replica="local") == 1


async def _load_servers(*names: str) -> tuple[list[grpc.aio.Server], list[str]]:
    """One in-process LoadService per name, reporting an engine core of that name."""
    servers, addresses = [], []
    for name in names:
        stage = FakeStage(EngineLoad(name, num_steps=len(name), memory_total_bytes=64, decord_fallbacks=3))
        server = grpc.aio.server()
        with_load_service(lambda s: None, lambda stage=stage: stage_loads(stage))(server)
        port = server.add_insecure_port("127.0.0.1:0")
        assert port
        await server.start()
        servers.append(server)
        addresses.append(f"127.0.0.1:{port}")
    return servers, addresses


def test_remote_replicas_are_read_over_load_service():
    """Two encoder replicas (one up, one down), one prefill and one decode replica: every
    replica is asked, by the address the gateway calls. The encoder's decode fallbacks are on the
    encoder's samples only."""

    async def scenario():
        servers, listed = await _load_servers("encoder", "prefill", "decode")
        addresses = dict(zip(("encoder", "prefill", "decode"), listed))
        down = f"127.0.0.1:{free_port()}"
        pools = [ReplicaPool([addresses["encoder"], down]), ReplicaPool([addresses["prefill"]])]
        pools.append(ReplicaPool([addresses["decode"]]))
        pipeline = Pipeline(
            RemoteEncodeStage(pools[0], 5.0, 1 << 20),
            RemotePrefillStage(pools[1], 5.0),
            RemoteDecodeStage(pools[2], 5.0),
        )
        metrics = GatewayMetrics(load_timeout_s=SHORT_TIMEOUT_S)
        MeteredPipeline(pipeline, metrics)
        try:
            await metrics.scrape()
        finally:
            for pool in pools:
                await pool.close()
            for server in servers:
                await server.stop(0)
        return metrics, addresses, down

    metrics, addresses, down = asyncio.run(scenario())
    for name, address in addresses.items():
        assert _engine(metrics, "epd_engine_steps_total", name, name, address) == len(name)
        assert _engine(metrics, "epd_engine_memory_total_bytes", name, name, address) == 64
        assert metrics.value("epd_load_scrape_errors_total", stage=name, replica=address) == 0
        fallbacks = _engine(metrics, "epd_encoder_decord_fallbacks_total", name, name, address)
        assert fallbacks == (3 if name == "encoder" else None), name
    assert _engine(metrics, "epd_engine_steps_total", "encoder", "encoder", down) is None
    assert metrics.value("epd_load_scrape_errors_total", stage="encoder", replica=down) == 1


def test_the_replicas_read_follow_the_pool_when_the_replica_file_changes_it():
    """The replica file changes a pool (`ReplicaPool.set_addresses`): an added replica has samples
    from the next scrape, a removed one has none and loses its error series, and one put back is
    read again (over its new channel: its first one closed when it was taken out)."""

    async def scenario() -> None:
        servers, (first, second) = await _load_servers("encoder", "encoder")
        pool = ReplicaPool([first])
        metrics = GatewayMetrics(load_timeout_s=5.0)
        MeteredPipeline(
            Pipeline(RemoteEncodeStage(pool, 5.0, 1 << 20), NoCoreStage(), NoCoreStage()), metrics
        )
        try:
            for replicas in ([first], [first, second], [second], [first, second]):
                pool.set_addresses(replicas)
                await metrics.scrape()
                for address in (first, second):
                    steps = _engine(metrics, "epd_engine_steps_total", "encoder", "encoder", address)
                    errors = metrics.registry.get_sample_value(
                        "epd_load_scrape_errors_total", {"stage": "encoder", "replica": address}
                    )
                    listed = address in replicas
                    assert (steps, errors) == ((7, 0) if listed else (None, None)), (replicas, address)
        finally:
            await pool.close()
            for server in servers:
                await server.stop(0)

    asyncio.run(scenario())


def test_prefills_kv_store_is_on_the_prefill_samples_only():
    """Held now (caches, bytes, budget) as gauges, drops by reason as one counter; the other
    stages' samples have none (their cores have no KV store)."""
    prefill = EngineLoad(
        "prefill", kv_store_caches=2, kv_store_used_bytes=3000, kv_store_total_bytes=8000,
        kv_store_expired=4, kv_store_released=5, kv_store_refused=6,
    )  # fmt: skip
    decode = EngineLoad("decode", memory_used_bytes=3000, memory_total_bytes=9000)
    metrics = _metered(FakeStage(EngineLoad("encoder")), FakeStage(prefill), FakeStage(decode))
    text = _scrape(metrics)
    expected = {
        ("epd_kv_store_caches", ""): ("gauge", 2),
        ("epd_kv_store_used_bytes", ""): ("gauge", 3000),
        ("epd_kv_store_total_bytes", ""): ("gauge", 8000),
        ("epd_kv_store_dropped_total", "expired"): ("counter", 4),
        ("epd_kv_store_dropped_total", "released"): ("counter", 5),
        ("epd_kv_store_refused_total", ""): ("counter", 6),
    }
    for (name, reason), (kind, value) in expected.items():
        assert f"# TYPE {name} {kind}" in text, name
        labels = {"stage": "prefill", "core": "prefill", "replica": "local"} | (
            {"reason": reason} if reason else {}
        )
        assert metrics.registry.get_sample_value(name, labels) == value, name
        for stage in ("encoder", "decode"):
            assert (
                metrics.registry.get_sample_value(name, labels | {"stage": stage, "core": stage}) is None
            ), name
    assert _engine(metrics, "epd_engine_memory_used_bytes", "decode", "decode") == 3000


def test_gauges_are_empty_before_the_first_scrape():
    metrics = _metered(FakeStage(EngineLoad("encoder", num_steps=3)), NoCoreStage(), NoCoreStage())
    text = metrics.render()
    assert "# TYPE epd_engine_steps_total counter" in text
    assert "epd_engine_steps_total{" not in text


def test_routing_reads_the_loads_of_the_stages_with_more_than_one_replica_only():
    """Routing chooses by load only among several replicas: a stage with one is not read (it was,
    every --load-refresh-interval, idle or not: an RPC each half second in the default stack),
    and keeps no report from when it had more; each replica of a stage with two is read."""
    from epd.gateway.engine_load import refresh_routing_loads

    async def scenario() -> list[int]:
        servers, addresses = [], []
        for running in (2, 5, 7):  # encoder replicas a and b, the one prefill replica
            stage = FakeStage(EngineLoad("core", num_running=running))
            server = grpc.aio.server()
            with_load_service(lambda s: None, lambda stage=stage: stage_loads(stage))(server)
            addresses.append(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
            await server.start()
            servers.append(server)
        a, b, single = addresses
        pools = {"encoder": ReplicaPool([a, b]), "prefill": ReplicaPool([single])}
        pools["prefill"].chooser.set_load(single, 9)  # reported while the stage had two replicas
        try:
            await refresh_routing_loads(pools, timeout_s=30.0)
            return [pools["encoder"].chooser.load(a), pools["encoder"].chooser.load(b)] + [
                pools["prefill"].chooser.load(single)
            ]
        finally:
            for pool in pools.values():
                await pool.close()
            for server in servers:
                await server.stop(0)

    assert asyncio.run(scenario()) == [2, 5, 0]


class _CountedStage(FakeStage):
    def __init__(self) -> None:
        super().__init__(EngineLoad("encoder"))
        self.reads = 0

    def load(self) -> list[EngineLoad]:
        self.reads += 1
        return super().load()


def test_the_routing_loads_are_not_read_while_the_gateway_has_no_call_open():
    """Loads choose where calls go: with none open, after one read of the replicas as they are, the
    watch waits for a call to begin and reads at once (it read every --load-refresh-interval,
    idle or not); it reads on while calls are open, and stops again once they have ended."""
    from epd.gateway.engine_load import watch_loads

    async def until(condition, what: str) -> None:
        for _ in range(600):  # a deadline (30 s), not a timing assertion
            if condition():
                return
            await asyncio.sleep(0.05)
        raise AssertionError(what)

    async def scenario() -> list[int]:
        stages = [_CountedStage(), _CountedStage()]
        servers, addresses = [], []
        for stage in stages:
            server = grpc.aio.server()
            with_load_service(lambda s: None, lambda stage=stage: stage_loads(stage))(server)
            addresses.append(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
            await server.start()
            servers.append(server)
        pool = ReplicaPool(addresses)
        watch = asyncio.ensure_future(watch_loads({"encoder": pool}, interval_s=0.02))
        reads = []
        try:
            await until(lambda: stages[0].reads >= 1, "no first read")
            await asyncio.sleep(0.5)  # 25 intervals: as many reads, idle, before
            reads.append(stages[0].reads)
            pool.begin(addresses[1])  # a call begins: read at once, and on while it is open
            await until(lambda: stages[0].reads >= reads[0] + 3, "no reads while a call is open")
            pool.end(addresses[1])
            # After at most two more reads (the one under way, one with none open) it waits.
            await until(lambda: steady(stages[0].reads), "reads went on after the call ended")
            reads.append(stages[0].reads)
            await asyncio.sleep(0.5)
            reads.append(stages[0].reads)
        finally:
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)
            await pool.close()
            for server in servers:
                await server.stop(0)
        return reads

    seen: list[int] = []

    def steady(count: int) -> bool:
        """True once the count has stayed the same for 20 looks 0.05 s apart (50 intervals)."""
        seen.append(count)
        return len(seen) >= 20 and len(set(seen[-20:])) == 1

    first, ended, later = asyncio.run(scenario())
    assert first == 1 and later == ended, (first, ended, later)
