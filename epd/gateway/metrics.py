"""Prometheus metrics of the front door, written in the text exposition format (version 0.0.4)
by hand: counters, gauges and histograms with labels, no client library.

`GatewayMetrics.track(events)` wraps one pipeline run and records TTFT, time per output token,
end-to-end latency, outcome by status, requests in flight, visual tokens and encoder cache hits;
`MeteredPipeline` applies it to every `ask`, so the gRPC and HTTP APIs are counted alike.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import aclosing

from epd.gateway.pipeline import AskRequest, AskSummary, Pipeline, PipelineEvent
from epd.stages.contracts import StageEvent, TokenStep
from epd.stages.names import Stage
from epd.transport.errors import status_of

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

LabelKey = tuple[str, ...]


def format_value(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return repr(float(value))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels_text(names: Sequence[str], values: Sequence[str]) -> str:
    if not names:
        return ""
    return "{" + ",".join(f'{n}="{_escape(v)}"' for n, v in zip(names, values)) + "}"


class _Metric:
    kind = ""

    def __init__(self, name: str, help_text: str, label_names: Sequence[str] = ()) -> None:
        self.name = name
        self.help_text = help_text
        self.label_names = tuple(label_names)

    def _key(self, labels: dict[str, str]) -> LabelKey:
        if set(labels) != set(self.label_names):
            raise ValueError(f"{self.name} takes labels {self.label_names}, got {sorted(labels)}")
        return tuple(str(labels[n]) for n in self.label_names)

    def header(self) -> list[str]:
        help_text = self.help_text.replace("\\", "\\\\").replace("\n", "\\n")
        return [f"# HELP {self.name} {help_text}", f"# TYPE {self.name} {self.kind}"]

    def lines(self) -> list[str]:
        raise NotImplementedError


class Counter(_Metric):
    """A count that only goes up; by Prometheus convention its name ends in `_total`."""

    kind = "counter"

    def __init__(self, name: str, help_text: str, label_names: Sequence[str] = ()) -> None:
        super().__init__(name, help_text, label_names)
        self.values: dict[LabelKey, float] = {} if label_names else {(): 0.0}

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        if amount < 0:
            raise ValueError("a counter cannot go down")
        key = self._key(labels)
        self.values[key] = self.values.get(key, 0.0) + amount

    def get(self, **labels: str) -> float:
        return self.values.get(self._key(labels), 0.0)

    def lines(self) -> list[str]:
        return [
            f"{self.name}{_labels_text(self.label_names, k)} {format_value(v)}"
            for k, v in self.values.items()
        ]


class Gauge(Counter):
    """A value that goes up and down."""

    kind = "gauge"

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = self._key(labels)
        self.values[key] = self.values.get(key, 0.0) + amount

    def dec(self, amount: float = 1.0, **labels: str) -> None:
        self.inc(-amount, **labels)

    def set(self, value: float, **labels: str) -> None:
        self.values[self._key(labels)] = value


class Histogram(_Metric):
    """Counts of observations at or below each bucket bound (cumulative), their sum and count."""

    kind = "histogram"

    def __init__(
        self, name: str, help_text: str, buckets: Sequence[float], label_names: Sequence[str] = ()
    ) -> None:
        super().__init__(name, help_text, label_names)
        if list(buckets) != sorted(set(buckets)):
            raise ValueError("histogram buckets must be increasing and distinct")
        self.buckets = [float(b) for b in buckets if not math.isinf(b)] + [math.inf]
        # per label set: [count per bucket (not cumulative)], sum
        self.series: dict[LabelKey, tuple[list[int], list[float]]] = {}
        if not label_names:
            self.series[()] = ([0] * len(self.buckets), [0.0])

    def observe(self, value: float, **labels: str) -> None:
        key = self._key(labels)
        counts, total = self.series.setdefault(key, ([0] * len(self.buckets), [0.0]))
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                counts[i] += 1
                break
        total[0] += value

    def count(self, **labels: str) -> int:
        series = self.series.get(self._key(labels))
        return sum(series[0]) if series else 0

    def lines(self) -> list[str]:
        out = []
        for key, (counts, total) in self.series.items():
            cumulative = 0
            for bound, n in zip(self.buckets, counts):
                cumulative += n
                labels = _labels_text((*self.label_names, "le"), (*key, format_value(bound)))
                out.append(f"{self.name}_bucket{labels} {cumulative}")
            labels = _labels_text(self.label_names, key)
            out.append(f"{self.name}_sum{labels} {format_value(total[0])}")
            out.append(f"{self.name}_count{labels} {cumulative}")
        return out


class Registry:
    def __init__(self) -> None:
        self.metrics: list[_Metric] = []

    def add(self, metric: _Metric):
        if any(m.name == metric.name for m in self.metrics):
            raise ValueError(f"metric {metric.name} is registered twice")
        self.metrics.append(metric)
        return metric

    def render(self) -> str:
        lines: list[str] = []
        for metric in self.metrics:
            lines += metric.header() + metric.lines()
        return "\n".join(lines) + "\n"


_LATENCY_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_TPOT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)
_VISUAL_TOKEN_BUCKETS = (16, 64, 256, 1024, 4096, 16384, 65536)


class GatewayMetrics:
    """The front door's metrics; one instance per gateway process."""

    def __init__(self) -> None:
        r = self.registry = Registry()
        self.requests = r.add(
            Counter("epd_requests_total", "Pipeline runs by outcome (gRPC status name).", ["status"])
        )
        self.in_flight = r.add(Gauge("epd_requests_in_flight", "Pipeline runs in progress."))
        self.stage_queue = r.add(
            Gauge(
                "epd_stage_requests",
                "Requests waiting for or being served by each stage (encoder, prefill, decode), "
                "as the gateway sees them: the stages' queue sizes.",
                ["stage"],
            )
        )
        self.ttft = r.add(
            Histogram(
                "epd_time_to_first_token_seconds", "Request start to first generated token.", _TTFT_BUCKETS_S
            )
        )
        self.tpot = r.add(
            Histogram(
                "epd_time_per_output_token_seconds",
                "Mean time between output tokens after the first, per request.",
                _TPOT_BUCKETS_S,
            )
        )
        self.e2e = r.add(
            Histogram(
                "epd_e2e_request_latency_seconds",
                "Request start to last token, successful requests.",
                _LATENCY_BUCKETS_S,
            )
        )
        self.visual_tokens = r.add(
            Histogram(
                "epd_request_visual_tokens",
                "Visual tokens kept per request (after token dropping).",
                _VISUAL_TOKEN_BUCKETS,
            )
        )
        self.prompt_tokens = r.add(Counter("epd_prompt_tokens_total", "Prompt tokens prefilled."))
        self.generation_tokens = r.add(Counter("epd_generation_tokens_total", "Tokens generated."))
        self.cache_hits = r.add(
            Counter(
                "epd_encoder_cache_hits_total", "Requests whose visual tokens came from the encoder cache."
            )
        )
        self.http_responses = r.add(
            Counter("epd_http_responses_total", "HTTP API responses by route and code.", ["route", "code"])
        )

    def render(self) -> str:
        return self.registry.render()

    async def track(self, events: AsyncIterator[PipelineEvent]) -> AsyncGenerator[PipelineEvent, None]:
        """Pass a pipeline run's events through, recording its metrics."""
        t0 = time.perf_counter()
        t_first: float | None = None
        answered = False
        status = "OK"
        stage = "encoder"  # the first stage a request waits for
        self.in_flight.inc()
        self.stage_queue.inc(stage=stage)
        try:
            async with aclosing(events):  # type: ignore[type-var]  # Pipeline.ask is an async generator
                async for item in events:
                    next_stage = _stage_after(item, stage)
                    if next_stage != stage:
                        self.stage_queue.dec(stage=stage)
                        if next_stage:
                            self.stage_queue.inc(stage=next_stage)
                        stage = next_stage
                    if isinstance(item, TokenStep) and t_first is None and item.token_ids:
                        t_first = time.perf_counter()
                        self.ttft.observe(t_first - t0)
                    elif isinstance(item, AskSummary):
                        self._observe_summary(item, t0, t_first)
                        answered = True
                    yield item
        except (asyncio.CancelledError, GeneratorExit):
            # A consumer that stops reading after the summary (a non-streaming answer) got it all.
            status = "OK" if answered else "CANCELLED"
            raise
        except Exception as exc:
            status = status_of(exc)[0].name
            raise
        finally:
            if stage:
                self.stage_queue.dec(stage=stage)
            self.in_flight.dec()
            self.requests.inc(status=status)

    def _observe_summary(self, summary: AskSummary, t0: float, t_first: float | None) -> None:
        t_end = time.perf_counter()
        self.e2e.observe(t_end - t0)
        num_tokens = len(summary.token_ids)
        if t_first is not None and num_tokens > 1:
            self.tpot.observe((t_end - t_first) / (num_tokens - 1))
        kept = len(summary.kept_visual_token_index) or summary.num_visual_tokens
        self.visual_tokens.observe(kept)
        self.prompt_tokens.inc(summary.num_prompt_tokens)
        self.generation_tokens.inc(num_tokens)
        if summary.encoder_cache_hit:
            self.cache_hits.inc()


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
    """The same pipeline, with every `ask` recorded in `metrics`."""

    def __init__(self, inner: Pipeline, metrics: GatewayMetrics) -> None:
        super().__init__(inner.encoder, inner.prefill, inner.decoder)
        self.metrics = metrics

    async def ask(self, req: AskRequest) -> AsyncIterator[PipelineEvent]:
        async with aclosing(self.metrics.track(super().ask(req))) as events:
            async for item in events:
                yield item
