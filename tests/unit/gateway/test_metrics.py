"""The hand-written Prometheus exposition, and what `GatewayMetrics.track` records for one run."""

from __future__ import annotations

import asyncio
import math

import pytest

from epd.gateway.metrics import Counter, GatewayMetrics, Gauge, Histogram, Registry, format_value
from epd.gateway.pipeline import AskSummary
from epd.stages.contracts import StageEvent, TokenStep
from epd.stages.errors import InvalidRequest
from epd.stages.names import Stage


def test_exposition_text():
    r = Registry()
    c = r.add(Counter("demo_requests_total", "Requests.\nBy code.", ["code"]))
    g = r.add(Gauge("demo_in_flight", "In flight."))
    h = r.add(Histogram("demo_latency_seconds", "Latency.", [0.1, 1]))
    c.inc(code="200")
    c.inc(2, code="200")
    c.inc(code='we"ird\\\n')
    g.inc()
    g.inc()
    g.dec()
    for v in (0.05, 0.1, 0.5, 3.0):
        h.observe(v)
    assert r.render() == (
        "# HELP demo_requests_total Requests.\\nBy code.\n"
        "# TYPE demo_requests_total counter\n"
        'demo_requests_total{code="200"} 3\n'
        'demo_requests_total{code="we\\"ird\\\\\\n"} 1\n'
        "# HELP demo_in_flight In flight.\n"
        "# TYPE demo_in_flight gauge\n"
        "demo_in_flight 1\n"
        "# HELP demo_latency_seconds Latency.\n"
        "# TYPE demo_latency_seconds histogram\n"
        'demo_latency_seconds_bucket{le="0.1"} 2\n'
        'demo_latency_seconds_bucket{le="1"} 3\n'
        'demo_latency_seconds_bucket{le="+Inf"} 4\n'
        "demo_latency_seconds_sum 3.65\n"
        "demo_latency_seconds_count 4\n"
    )


def test_labelled_histogram_and_empty_series():
    h = Histogram("lat_seconds", "x", [1], ["route"])
    assert h.lines() == []  # no series until observed
    h.observe(2, route="/a")
    assert h.lines() == [
        'lat_seconds_bucket{route="/a",le="1"} 0',
        'lat_seconds_bucket{route="/a",le="+Inf"} 1',
        'lat_seconds_sum{route="/a"} 2',
        'lat_seconds_count{route="/a"} 1',
    ]


def test_misuse_is_refused():
    c = Counter("x_total", "x", ["code"])
    with pytest.raises(ValueError, match="takes labels"):
        c.inc(route="/")
    with pytest.raises(ValueError, match="cannot go down"):
        c.inc(-1, code="200")
    with pytest.raises(ValueError, match="increasing and distinct"):
        Histogram("h", "x", [1, 0.5])
    r = Registry()
    r.add(Gauge("g", "x"))
    with pytest.raises(ValueError, match="registered twice"):
        r.add(Gauge("g", "x"))


def test_format_value():
    assert [format_value(v) for v in (3.0, 0.25, math.inf, -math.inf, math.nan, 1e20)] == [
        "3", "0.25", "+Inf", "-Inf", "NaN", "1e+20",
    ]  # fmt: skip


def _summary(num_tokens: int, cache_hit: bool) -> AskSummary:
    return AskSummary(
        request_id="r", answer="abc", token_ids=list(range(num_tokens)), finish_reason="length", num_frames=4,
        num_visual_tokens=48, num_prompt_tokens=60, timings_ms={}, kv_num_bytes=0, encoder_cache_hit=cache_hit,
        media_sha256="", frame_timestamps_s=[],
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
    assert m.requests.get(status="OK") == 1
    assert m.ttft.count() == m.e2e.count() == m.tpot.count() == 1
    assert m.generation_tokens.get() == 3
    assert m.prompt_tokens.get() == 60
    assert m.visual_tokens.count() == 1
    assert m.cache_hits.get() == 1
    assert m.in_flight.get() == 0


def test_track_records_failures_and_cancellations():
    m = GatewayMetrics()
    with pytest.raises(InvalidRequest, match="bad"):
        asyncio.run(_drain(m, _events(3, fail=InvalidRequest("bad"))))
    assert m.requests.get(status="INVALID_ARGUMENT") == 1

    async def stop_after_first_token():
        gen = m.track(_events(5))
        async for item in gen:
            if isinstance(item, TokenStep):
                break
        await gen.aclose()

    asyncio.run(stop_after_first_token())
    assert m.requests.get(status="CANCELLED") == 1
    assert m.e2e.count() == 0  # only successful runs
    assert m.in_flight.get() == 0


def test_closing_after_the_summary_counts_as_ok():
    m = GatewayMetrics()

    async def read_until_summary():
        gen = m.track(_events(2))
        async for item in gen:
            if isinstance(item, AskSummary):
                break
        await gen.aclose()

    asyncio.run(read_until_summary())
    assert m.requests.get(status="OK") == 1
    assert "epd_requests_total" in m.render()


def test_stage_queue_gauges_follow_a_request():
    import asyncio

    from epd.gateway.metrics import GatewayMetrics
    from epd.gateway.pipeline import AskSummary
    from epd.stages.contracts import StageEvent, TokenStep

    metrics = GatewayMetrics()
    seen = []

    async def events():
        yield StageEvent(Stage.VIDEO_DECODE, "started")
        seen.append({s: metrics.stage_queue.get(stage=s) for s in ("encoder", "prefill", "decode")})
        yield StageEvent(Stage.PREFILL, "started")
        seen.append({s: metrics.stage_queue.get(stage=s) for s in ("encoder", "prefill", "decode")})
        yield StageEvent(Stage.PREFILL, "finished")
        yield TokenStep([5], "a")
        seen.append({s: metrics.stage_queue.get(stage=s) for s in ("encoder", "prefill", "decode")})
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
    assert all(metrics.stage_queue.get(stage=s) == 0 for s in ("encoder", "prefill", "decode"))
    assert 'epd_stage_requests{stage="decode"} 0' in metrics.render()
    assert "epd_request_visual_tokens_sum 2" in metrics.render()
