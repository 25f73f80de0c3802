"""Prometheus metrics of the front door, on prometheus_client with one registry per gateway (so
that several gateways in one process keep their own counts).

`GatewayMetrics.track(events)` wraps one pipeline run and records TTFT, time per output token,
end-to-end latency, outcome by status, requests in flight, visual tokens and encoder cache hits;
`MeteredPipeline` applies it to every `ask`, so the gRPC and HTTP APIs are counted alike, and
reads its stages' engine load at each scrape (`epd.gateway.engine_load`). Each API also counts its
own responses: the HTTP API by route and code, the gRPC servicer by method and status name.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from epd.gateway.ask_types import AskRequest, AskSummary, PipelineEvent
from epd.gateway.engine_load import LOAD_TIMEOUT_S, EngineLoadCollector, sources_of
from epd.gateway.pipeline import Pipeline
from epd.gateway.shutdown import current_call
from epd.stages.contracts import StageEvent, TokenStep
from epd.stages.messages import media_type
from epd.stages.names import Stage
from epd.transport.errors import status_of

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""The text format `generate_latest` writes. prometheus_client >= 0.22 names it
CONTENT_TYPE_PLAIN_0_0_4; its CONTENT_TYPE_LATEST there is 1.0.0 (with escaping negotiation)."""

_LATENCY_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_TPOT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)
_VISUAL_TOKEN_BUCKETS = (16, 64, 256, 1024, 4096, 16384, 65536)
_STAGES = ("encoder", "prefill", "decode")


class GatewayMetrics:
    """The front door's metrics; one instance (and one registry) per gateway."""

    def __init__(self, load_timeout_s: float = LOAD_TIMEOUT_S) -> None:
        # No `*_created` series next to each counter and histogram (the text format writes them as
        # extra gauges); prometheus_client only has the process-wide switch.
        disable_created_metrics()
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "epd_requests_total",
            "Pipeline runs by outcome (the gRPC status name the client got).",
            ["status"],
            registry=r,
        )
        self.in_flight = Gauge("epd_requests_in_flight", "Pipeline runs in progress.", registry=r)
        self.stage_queue = Gauge(
            "epd_stage_requests",
            "Requests waiting for or being served by each stage (encoder, prefill, decode), "
            "as the gateway sees them: the stages' queue sizes.",
            ["stage"],
            registry=r,
        )
        for stage in _STAGES:
            self.stage_queue.labels(stage=stage)
        self.ttft = Histogram(
            "epd_time_to_first_token_seconds",
            "Request start to first generated token.",
            buckets=_TTFT_BUCKETS_S,
            registry=r,
        )
        self.tpot = Histogram(
            "epd_time_per_output_token_seconds",
            "Mean time between output tokens after the first, per request.",
            buckets=_TPOT_BUCKETS_S,
            registry=r,
        )
        self.e2e = Histogram(
            "epd_e2e_request_latency_seconds",
            "Request start to last token, successful requests.",
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.visual_tokens = Histogram(
            "epd_request_visual_tokens",
            "Visual tokens kept per request with media (after token dropping); text-only requests are not counted.",
            buckets=_VISUAL_TOKEN_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter("epd_prompt_tokens_total", "Prompt tokens prefilled.", registry=r)
        self.generation_tokens = Counter("epd_generation_tokens_total", "Tokens generated.", registry=r)
        self.transfer_bytes = Counter(
            "epd_transfer_bytes_total",
            "Tensor bytes answered requests moved between processes (embeddings, the KV cache, "
            "eviction masks; each request's transfer_bytes, docs/architecture.md).",
            registry=r,
        )
        self.cache_hits = Counter(
            "epd_encoder_cache_hits_total",
            "Requests whose visual tokens came from the encoder cache.",
            registry=r,
        )
        self.http_responses = Counter(
            "epd_http_responses_total", "HTTP API responses by route and code.", ["route", "code"], registry=r
        )
        self.grpc_responses = Counter(
            "epd_grpc_responses_total",
            "gRPC API (GatewayService) calls by method (Ask, Tokenize, Detokenize) and the status name "
            "the client got; a call the API key check refused is counted too (UNAUTHENTICATED).",
            ["method", "code"],
            registry=r,
        )
        self.engine_load = EngineLoadCollector(r, load_timeout_s)

    def value(self, name: str, **labels: str) -> float:
        """One sample's value by its exposed name (0 when it has none yet), e.g.
        `value("epd_requests_total", status="OK")`, `value("epd_time_to_first_token_seconds_count")`."""
        return self.registry.get_sample_value(name, labels) or 0.0

    def render(self) -> str:
        """The exposition text, with the engine loads of the last `scrape`."""
        return generate_latest(self.registry).decode()

    async def scrape(self) -> bytes:
        """What GET /metrics answers: the stages' engine loads read now, then every metric."""
        await self.engine_load.refresh()
        return generate_latest(self.registry)

    async def track(
        self, events: AsyncIterator[PipelineEvent], with_media: bool = True
    ) -> AsyncGenerator[PipelineEvent, None]:
        """Pass a pipeline run's events through, recording its metrics. `with_media` False: a
        text-only request, which never waits for the encoder and has no visual tokens to count."""
        t0 = time.perf_counter()
        t_first: float | None = None
        answered = False
        status = "OK"
        stage = "encoder" if with_media else "prefill"  # the first stage a request waits for
        self.in_flight.inc()
        self.stage_queue.labels(stage=stage).inc()
        try:
            async with aclosing(events):  # type: ignore[type-var]  # Pipeline.ask is an async generator
                async for item in events:
                    next_stage = _stage_after(item, stage)
                    if next_stage != stage:
                        self.stage_queue.labels(stage=stage).dec()
                        if next_stage:
                            self.stage_queue.labels(stage=next_stage).inc()
                        stage = next_stage
                    if isinstance(item, TokenStep) and t_first is None and item.token_ids:
                        t_first = time.perf_counter()
                        self.ttft.observe(t_first - t0)
                    elif isinstance(item, AskSummary):
                        self._observe_summary(item, t0, t_first, with_media)
                        answered = True
                    yield item
        except (asyncio.CancelledError, GeneratorExit):
            # A consumer that stops reading after the summary (a non-streaming answer) got it all.
            status = "OK" if answered else _cancelled_status()
            raise
        except Exception as exc:
            status = status_of(exc)[0].name
            raise
        finally:
            if stage:
                self.stage_queue.labels(stage=stage).dec()
            self.in_flight.dec()
            self.requests.labels(status=status).inc()

    def _observe_summary(
        self, summary: AskSummary, t0: float, t_first: float | None, with_media: bool
    ) -> None:
        t_end = time.perf_counter()
        self.e2e.observe(t_end - t0)
        num_tokens = len(summary.token_ids)  # choice 0's: the time per token of one stream
        if t_first is not None and num_tokens > 1:
            self.tpot.observe((t_end - t_first) / (num_tokens - 1))
        if with_media:  # the histogram is of media requests' tokens: a text-only one is not a 0 there
            self.visual_tokens.observe(len(summary.kept_visual_token_index) or summary.num_visual_tokens)
        self.prompt_tokens.inc(summary.num_prompt_tokens)
        self.generation_tokens.inc(sum(len(choice.token_ids) for choice in summary.all_choices()))
        self.transfer_bytes.inc(summary.pruning.transfer_bytes)
        if summary.encoder_cache_hit:
            self.cache_hits.inc()


def _cancelled_status() -> str:
    """The outcome of a run cancelled before its answer: the status its client gets when the
    gateway's shutdown cut it at the end of the drain (UNAVAILABLE before any token, ABORTED after:
    `epd.gateway.shutdown`), else CANCELLED (its client went away). Both were CANCELLED."""
    call = current_call()
    return (call.cut_status() if call is not None else None) or "CANCELLED"


def _stage_after(item: PipelineEvent, stage: str) -> str:
    """Which stage a request is in after this event ("" once answered)."""
    if isinstance(item, StageEvent):
        # Stage names are what the events say; the queue labels name the services.
        if item.stage == Stage.PREFILL and item.state == "started":
            return "prefill"
        if item.stage == Stage.PREFILL and item.state == "finished":
            return "decode"
    if isinstance(item, AskSummary):
        return ""
    return stage


class MeteredPipeline(Pipeline):
    """The same pipeline, with every `ask` recorded in `metrics` and its stages' engine load
    read at each scrape (remote stages over LoadService, local ones directly)."""

    def __init__(self, inner: Pipeline, metrics: GatewayMetrics) -> None:
        super().__init__(inner.encoder, inner.prefill, inner.decoder)
        self.inner = inner
        self.metrics = metrics
        stages = {"encoder": inner.encoder, "prefill": inner.prefill, "decode": inner.decoder}
        metrics.engine_load.add_sources(sources_of(stages))

    async def ask(self, req: AskRequest) -> AsyncIterator[PipelineEvent]:
        async with aclosing(self.metrics.track(super().ask(req), bool(media_type(req.messages)))) as events:
            async for item in events:
                yield item

    async def aclose(self) -> None:
        await self.inner.aclose()  # what the stages hold is the inner pipeline's (a remote one's channels)
