"""`SingleFlight` and its two users: the gateway's open `GET /health` (a health check of every
stage replica) and `GET /metrics` (every replica's engine load). Concurrent requests made one
round of gRPC calls each; now they share the round in flight."""

from __future__ import annotations

import asyncio

import pytest

from epd.gateway.config import GatewayConfig
from epd.gateway.metrics import GatewayMetrics, MeteredPipeline
from epd.gateway.pipeline import Pipeline
from epd.gateway.readiness import StageHealth
from epd.stages.engine_core import EngineLoad
from epd.transport.single_flight import SingleFlight


def test_concurrent_callers_share_one_call_and_later_ones_get_a_new_one():
    calls: list[int] = []

    async def work() -> int:
        calls.append(len(calls))
        await asyncio.sleep(0.05)
        return len(calls)

    async def scenario():
        once = SingleFlight(work)
        together = await asyncio.gather(*(once() for _ in range(20)))
        later = await once()
        return together, later

    together, later = asyncio.run(scenario())
    assert together == [1] * 20 and later == 2 and calls == [0, 1]


def test_a_cancelled_caller_leaves_the_call_to_the_others_and_errors_reach_everyone():
    async def scenario():
        started = asyncio.Event()

        async def slow() -> str:
            started.set()
            await asyncio.sleep(0.1)
            return "answer"

        once = SingleFlight(slow)
        leaving = asyncio.ensure_future(once())
        staying = asyncio.ensure_future(once())
        await started.wait()
        leaving.cancel()
        answer = await staying

        async def fails() -> str:
            raise RuntimeError("no replica answered")

        failing = SingleFlight(fails)
        errors = await asyncio.gather(failing(), failing(), return_exceptions=True)
        return leaving.cancelled(), answer, errors

    cancelled, answer, errors = asyncio.run(scenario())
    assert cancelled and answer == "answer"
    assert [str(e) for e in errors] == ["no replica answered"] * 2


class CountingHealth(StageHealth):
    """The real checks' bookkeeping, each replica's grpc.health call replaced by a count."""

    def __init__(self) -> None:
        super().__init__(GatewayConfig(encoder_addresses=("e:1", "e:2"), prefill_addresses=("p:1",),
                                       decode_addresses=("d:1",)))  # fmt: skip
        self.num_checks = 0

    async def _serving(self, stage: str, address: str) -> bool:
        self.num_checks += 1
        await asyncio.sleep(0.05)
        return address != "e:2"


def test_concurrent_health_requests_check_each_replica_once():
    async def scenario():
        health = CountingHealth()
        answers = await asyncio.gather(*(health.not_serving() for _ in range(50)))
        return health.num_checks, answers

    num_checks, answers = asyncio.run(scenario())
    assert num_checks == 4  # 4 replicas, one round (it was 200)
    assert answers == [[]] * 50


@pytest.mark.parametrize("num_scrapes", [1, 30])
def test_concurrent_scrapes_read_each_replicas_load_once(num_scrapes):
    class Stage:
        num_reads = 0

        def load(self) -> list[EngineLoad]:
            Stage.num_reads += 1
            return [EngineLoad("decode", num_running=3)]

    async def scenario():
        metrics = GatewayMetrics()
        MeteredPipeline(Pipeline(Stage(), Stage(), Stage()), metrics)  # type: ignore[arg-type]
        pages = await asyncio.gather(*(metrics.scrape() for _ in range(num_scrapes)))
        return {page.count(b"epd_engine_running_requests{") for page in pages}

    per_page = asyncio.run(scenario())
    assert Stage.num_reads == 3  # one read per stage, however many scrapes came at once
    assert per_page == {3}
