"""The Prometheus exposition (prometheus_client, one registry per gateway), and what `GatewayMetrics.track` records for one run."""

from __future__ import annotations

import asyncio

import pytest

from epd.gateway.ask_types import AskSummary
from epd.gateway.metrics import GatewayMetrics
from epd.stages.contracts import StageEvent, TokenStep
from epd.stages.errors import InvalidRequest
from epd.stages.names import Stage
from epd.token_pruning import PruningStats

TTFT = "epd_time_to_first_token_seconds"
TPOT = "epd_time_per_output_token_seconds"
E2E = "epd_e2e_request_latency_seconds"


def test_exposition_keeps_every_name_label_and_type():
    m = GatewayMetrics()
    m.requests.labels(status="OK").inc()
    m.http_responses.labels(route="/v1/models", code="200").inc(2)
    m.ttft.observe(0.02)
    text = m.render()
    for line in (
        "# TYPE epd_requests_total counter",
        'epd_requests_total{status="OK"} 1.0',
        "# TYPE epd_requests_in_flight gauge",
        "epd_requests_in_flight 0.0",
        'epd_stage_requests{stage="encoder"} 0.0',
        "# TYPE epd_time_to_first_token_seconds histogram",
        'epd_time_to_first_token_seconds_bucket{le="0.01"} 0.0',
        'epd_time_to_first_token_seconds_bucket{le="0.025"} 1.0',
        'epd_time_to_first_token_seconds_bucket{le="+Inf"} 1.0',
        "epd_time_to_first_token_seconds_count 1.0",
        "# TYPE epd_time_per_output_token_seconds histogram",
        "# TYPE epd_e2e_request_latency_seconds histogram",
        "# TYPE epd_request_visual_tokens histogram",
        "epd_prompt_tokens_total 0.0",
        "epd_generation_tokens_total 0.0",
        "epd_encoder_cache_hits_total 0.0",
        "# TYPE epd_transfer_bytes_total counter",
        "epd_transfer_bytes_total 0.0",
        'epd_http_responses_total{code="200",route="/v1/models"} 2.0',
    ):
        assert line in text.splitlines(), line


def test_each_gateway_has_its_own_registry():
    a, b = GatewayMetrics(), GatewayMetrics()
    a.requests.labels(status="OK").inc()
    assert a.value("epd_requests_total", status="OK") == 1
    assert b.value("epd_requests_total", status="OK") == 0
    assert 'epd_requests_total{status="OK"}' not in b.render()


def test_misuse_is_refused():
    m = GatewayMetrics()
    with pytest.raises(ValueError, match="Incorrect label names"):
        m.requests.labels(route="/")
    with pytest.raises(ValueError, match="negative"):
        m.prompt_tokens.inc(-1)


def _summary(num_tokens: int, cache_hit: bool) -> AskSummary:
    return AskSummary(
        request_id="r", answer="abc", token_ids=list(range(num_tokens)), finish_reason="length", num_frames=4,
        num_visual_tokens=48, num_prompt_tokens=60, timings_ms={}, kv_num_bytes=0, encoder_cache_hit=cache_hit,
        media_sha256="", frame_timestamps_s=[], pruning=PruningStats(transfer_bytes=1234),
    )  # fmt: skip


async def _events(num_tokens: int, fail: Exception | None = None, cache_hit: bool = False):
    yield StageEvent(Stage.ENCODE, "finished")
    if fail:
        raise fail
    for i in range(num_tokens):
        yield TokenStep([i], "x")
    yield _summary(num_tokens, cache_hit)


async def _drain(metrics: GatewayMetrics, events) -> list:
    return [item async for item in metrics.track(events)]


def test_track_records_a_successful_run():
    m = GatewayMetrics()
    items = asyncio.run(_drain(m, _events(3, cache_hit=True)))
    assert len(items) == 5  # passed through unchanged
    assert m.value("epd_requests_total", status="OK") == 1
    assert [m.value(f"{h}_count") for h in (TTFT, E2E, TPOT)] == [1, 1, 1]
    assert m.value("epd_generation_tokens_total") == 3
    assert m.value("epd_prompt_tokens_total") == 60
    assert m.value("epd_request_visual_tokens_count") == 1
    assert m.value("epd_encoder_cache_hits_total") == 1
    assert m.value("epd_transfer_bytes_total") == 1234
    assert m.value("epd_requests_in_flight") == 0


def test_track_records_failures_and_cancellations():
    m = GatewayMetrics()
    with pytest.raises(InvalidRequest, match="bad"):
        asyncio.run(_drain(m, _events(3, fail=InvalidRequest("bad"))))
    assert m.value("epd_requests_total", status="INVALID_ARGUMENT") == 1

    async def stop_after_first_token():
        gen = m.track(_events(5))
        async for item in gen:
            if isinstance(item, TokenStep):
                break
        await gen.aclose()

    asyncio.run(stop_after_first_token())
    assert m.value("epd_requests_total", status="CANCELLED") == 1
    assert m.value(f"{E2E}_count") == 0  # only successful runs
    assert m.value("epd_requests_in_flight") == 0


def test_closing_after_the_summary_counts_as_ok():
    m = GatewayMetrics()

    async def read_until_summary():
        gen = m.track(_events(2))
        async for item in gen:
            if isinstance(item, AskSummary):
                break
        await gen.aclose()

    asyncio.run(read_until_summary())
    assert m.value("epd_requests_total", status="OK") == 1
    assert "epd_requests_total" in m.render()


def test_stage_queue_gauges_follow_a_request():
    import asyncio

    from epd.gateway.ask_types import AskSummary
    from epd.gateway.metrics import GatewayMetrics
    from epd.stages.contracts import StageEvent, TokenStep

    metrics = GatewayMetrics()
    seen = []

    def queues() -> dict[str, float]:
        return {s: metrics.value("epd_stage_requests", stage=s) for s in ("encoder", "prefill", "decode")}

    async def events():
        yield StageEvent(Stage.VIDEO_DECODE, "started")
        seen.append(queues())
        yield StageEvent(Stage.PREFILL, "started")
        seen.append(queues())
        yield StageEvent(Stage.PREFILL, "finished")
        yield TokenStep([5], "a")
        seen.append(queues())
        yield AskSummary("r", "a", [5], "stop", 1, 4, 9, {}, 0, False, "", [], kept_visual_token_index=[0, 2])

    async def run():
        async for _ in metrics.track(events()):
            pass

    asyncio.run(run())
    assert seen == [
        {"encoder": 1, "prefill": 0, "decode": 0},
        {"encoder": 0, "prefill": 1, "decode": 0},
        {"encoder": 0, "prefill": 0, "decode": 1},
    ]
    assert all(metrics.value("epd_stage_requests", stage=s) == 0 for s in ("encoder", "prefill", "decode"))
    assert 'epd_stage_requests{stage="decode"} 0.0' in metrics.render()
    assert "epd_request_visual_tokens_sum 2.0" in metrics.render()


def test_a_text_only_request_waits_for_prefill_first_and_is_not_a_zero_visual_token_request():
    metrics = GatewayMetrics()
    seen = []

    async def events():
        seen.append(metrics.value("epd_stage_requests", stage="prefill"))
        yield StageEvent(Stage.PREFILL, "started")
        yield StageEvent(Stage.PREFILL, "finished")
        yield TokenStep([5], "a")
        yield AskSummary("r", "a", [5], "stop", 0, 0, 9, {}, 0, False, "", [])

    async def run():
        async for _ in metrics.track(events(), with_media=False):
            pass

    asyncio.run(run())
    assert seen == [1] and metrics.value("epd_stage_requests", stage="encoder") == 0
    assert metrics.value("epd_request_visual_tokens_count") == 0
    assert (
        metrics.value("epd_requests_total", status="OK") == 1
        and metrics.value("epd_prompt_tokens_total") == 9
    )


def test_counting_a_grpc_call_logs_nothing_of_its_own(caplog):
    # A raw upstream error is sanitised, and its details logged, once: by `rpc_errors` as it
    # aborts the call. The servicer's count of the call takes only the code.
    import logging

    import grpc

    from epd.gateway.config import GatewayConfig
    from epd.gateway.servicer import GatewayServicer

    metrics = GatewayMetrics()
    servicer = GatewayServicer(GatewayConfig(), pipeline=None, metrics=metrics)  # type: ignore[arg-type]
    upstream = grpc.aio.AioRpcError(
        grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "failed to connect to 10.0.0.7"
    )
    with caplog.at_level(logging.DEBUG), pytest.raises(grpc.aio.AioRpcError):
        with servicer._counted("Tokenize"):
            raise upstream
    assert [r.getMessage() for r in caplog.records] == []
    assert metrics.value("epd_grpc_responses_total", method="Tokenize", code="UNAVAILABLE") == 1
