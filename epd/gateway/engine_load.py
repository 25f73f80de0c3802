"""The engine cores' load on the gateway's /metrics: what each stage's scheduler is doing now.

At each scrape `EngineLoadCollector.refresh()` asks every source at once, each within a short
timeout: a remote replica over `LoadService.GetLoad` (`epd.transport.load.fetch_loads`), a local
stage (the embedded mode) through its own `load()`. Then `collect()` (called by prometheus_client
while it renders) turns the answers into one sample per engine core, labelled by

    stage    the service, as the gateway names it: encoder, prefill, decode
    core     the core's own name (`EngineLoad.stage`; a process may run several cores)
    replica  the address the gateway calls ("local" in the embedded mode)

The prefill cores' samples also carry prefill's prefix cache (`epd_prefix_cache_*`) and its KV
store, the caches waiting for a decoder to pull them (`epd_kv_store_*`, the drops with a `reason`
label too).

`watch_loads` reads the same loads in the background for routing: every replica's running +
waiting requests go to its pool's chooser, so that calls without media affinity go to the least
loaded replica and a keyed call avoids an overloaded home (`epd.transport.affinity`); only of the
stages with more than one replica, as there is nothing to choose between otherwise, and only while
the gateway has calls open: idle, it reads once more and then waits for the next call to begin.

The sources are listed again at each scrape: a remote stage's are its pool's replicas at that
moment, each over the channel its calls use, so they follow the replica file (`--replicas-file`):
an added replica has samples from the next scrape, a removed one none, and one taken out and put
back is read over its new channel (the channel of its first listing closed when it was taken out).

A source that does not answer has no samples in that scrape, and `epd_load_scrape_errors_total`
counts it; a replica's error series goes when the replica leaves its pool. A `dns:///` name is one
source per address it resolves to (`epd.gateway.dns_replicas`), labelled by that address; a plain
name over several pods, which gRPC balances, is one source: each scrape sees the pod its channel
picks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import grpc
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from epd.stages.engine_core import EngineLoad
from epd.transport.aio_cancel import answer_or_none, within
from epd.transport.load import fetch_loads
from epd.transport.load_servicer import stage_loads
from epd.transport.replica_pool import ReplicaPool, unresolved
from epd.transport.single_flight import SingleFlight

log = logging.getLogger(__name__)

LOAD_TIMEOUT_S = 1.0
"""How long a scrape waits for a stage's load; /metrics must answer even when a stage is down."""

ROUTING_LOAD_INTERVAL_S = 0.5
"""How often the gateway reads its replicas' loads for routing (one small RPC per replica of a
stage with more than one: `routing_load_targets`)."""

LOCAL = "local"
LABELS = ("stage", "core", "replica")


@dataclass(frozen=True)
class LoadSource:
    stage: str
    """encoder, prefill or decode (the label `epd_stage_requests` uses too)."""
    replica: str
    read: Callable[[float], Awaitable[Sequence[EngineLoad]]]
    """timeout_s -> one EngineLoad per engine core; raises when the stage does not answer."""


Sources = Callable[[], Sequence[LoadSource]]
"""The sources of one stage as they are now; called at every scrape."""


def local_source(stage_name: str, stage: object) -> Sources:
    """A stage in this process (the embedded mode): its `load()` read directly."""

    async def read(timeout_s: float) -> Sequence[EngineLoad]:
        return stage_loads(stage)

    source = LoadSource(stage_name, LOCAL, read)
    return lambda: [source]


def remote_sources(stage_name: str, pool: ReplicaPool) -> Sources:
    """One source per replica of a remote stage now (the replica file changes them), each over
    the channel its calls use now."""

    def now() -> list[LoadSource]:
        return [
            LoadSource(stage_name, address, _reader(pool.channel(address)))
            for address in pool.addresses
            if not unresolved(address)
        ]

    return now


def _reader(channel: grpc.aio.Channel) -> Callable[[float], Awaitable[Sequence[EngineLoad]]]:
    async def read(timeout_s: float) -> Sequence[EngineLoad]:
        return await fetch_loads(channel, timeout_s)

    return read


def sources_of(stages: Mapping[str, object]) -> list[Sources]:
    """Sources for a pipeline's stages by name: remote stages (a `pool` of replicas) over gRPC,
    local ones that have a `load()` directly; a stage with neither has no engine load."""
    sources: list[Sources] = []
    for name, stage in stages.items():
        pool = getattr(stage, "pool", None)
        if isinstance(pool, ReplicaPool):
            sources.append(remote_sources(name, pool))
        elif callable(getattr(stage, "load", None)):
            sources.append(local_source(name, stage))
    return sources


def queued(loads: Sequence[EngineLoad]) -> int:
    """A replica's load for routing: requests running or waiting over its engine cores."""
    return sum(load.num_running + load.num_waiting for load in loads)


def routing_load_targets(pools: Mapping[str, ReplicaPool]) -> list[tuple[ReplicaPool, str]]:
    """(pool, address) of each replica whose load routing reads: those of the stages with more
    than one replica to call. With one there is nothing to choose between (the chooser's order
    holds it alone, loads unread), and reading it cost an RPC to it every half second, idle: the
    default stack has one replica per stage. A stage that had more keeps no report of its last
    one (`set_load(None)`): its own calls count until it has more again and they are read."""
    targets = []
    for pool in pools.values():
        addresses = [address for address in pool.addresses if not unresolved(address)]
        if len(addresses) > 1:
            targets += [(pool, address) for address in addresses]
        else:
            for address in addresses:
                pool.chooser.set_load(address, None)
    return targets


async def refresh_routing_loads(pools: Mapping[str, ReplicaPool], timeout_s: float) -> None:
    """Read the load of every replica routing chooses among once and tell its pool (no answer:
    only our own calls count)."""
    targets = routing_load_targets(pools)

    async def read(channel: grpc.aio.Channel, address: str) -> int | None:
        loads = await answer_or_none(
            fetch_loads(channel, timeout_s), timeout_s, f"no load for routing from {address}"
        )
        return None if loads is None else queued(loads)

    # Each channel taken now, with the list (as refresh_model_info): a replica removed before its
    # read starts gets an answer of none, not a KeyError that ends the watch.
    answers = await asyncio.gather(*(read(pool.channel(address), address) for pool, address in targets))
    for (pool, address), load in zip(targets, answers):
        pool.chooser.set_load(address, load)


async def watch_loads(pools: Mapping[str, ReplicaPool], interval_s: float = ROUTING_LOAD_INTERVAL_S) -> None:
    """`refresh_routing_loads` every `interval_s` while the gateway has stage calls open, until
    cancelled (0: never). Once a read that began with none open ends with none begun since, the
    next read waits for a call to begin (`ReplicaPool.call_began`) and is made at once: loads
    choose where calls go, and an idle gateway read them twice a second for nothing (that last
    read, with none of ours open, is the others' load: other gateways', the stages' own)."""
    if interval_s <= 0 or not pools:
        return
    while True:
        for pool in pools.values():
            pool.call_began.clear()
        idle = not any(pool.chooser.calls_open() for pool in pools.values())
        await refresh_routing_loads(pools, min(interval_s, LOAD_TIMEOUT_S))
        if idle and not any(pool.call_began.is_set() for pool in pools.values()):
            await _first_call(pools)
        else:
            await asyncio.sleep(interval_s)


async def _first_call(pools: Mapping[str, ReplicaPool]) -> None:
    """Until a call begins in any of `pools`."""
    waits = [asyncio.ensure_future(pool.call_began.wait()) for pool in pools.values()]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()


_GAUGES = [
    ("epd_engine_running_requests", "Requests in the engine core's running batch.", "num_running"),
    ("epd_engine_waiting_requests", "Requests admitted and waiting for their first step.", "num_waiting"),
    ("epd_engine_batch_size", "Requests in the engine core's most recent batched step.", "last_batch_size"),
    (
        "epd_engine_memory_used_bytes",
        "Bytes reserved for running and admitted requests (decode: KV memory).",
        "memory_used_bytes",
    ),
    (
        "epd_engine_memory_total_bytes",
        "The engine core's memory budget (0: not budgeted).",
        "memory_total_bytes",
    ),
]
_COUNTERS = [
    ("epd_engine_steps_total", "Batched steps the engine core has run since it started.", "num_steps"),
    (
        "epd_engine_requests_total",
        "Requests the engine core admitted since it started (encoder: tower jobs, one per frame group).",
        "num_requests",
    ),
    (
        "epd_engine_queue_wait_seconds_total",
        "Summed seconds requests waited before their first step, since the core started.",
        "queue_wait_s_total",
    ),
    (
        "epd_engine_preemptions_total",
        "Running requests sent back to waiting to free memory, since the core started.",
        "num_preemptions",
    ),
]


# Prefill's prefix cache (`prefill_svc/prefix_cache.py`), on the prefill cores' samples only.
_PREFIX_GAUGES = [
    (
        "epd_prefix_cache_entries",
        "Prompt KV caches prefill's prefix cache holds now.",
        "prefix_cache_entries",
    ),
    ("epd_prefix_cache_bytes", "Bytes of KV prefill's prefix cache holds now.", "prefix_cache_bytes"),
]
# The hit rate is in tokens, as vLLM's (`vllm:prefix_cache_hits` / `vllm:prefix_cache_queries`):
# rate(epd_prefix_cache_hit_tokens_total) / rate(epd_prefix_cache_query_tokens_total).
_PREFIX_COUNTERS = [
    (
        "epd_prefix_cache_query_tokens_total",
        "Prompt tokens of the prompts looked up in the prefix cache, since start (vLLM's prefix_cache_queries).",
        "prefix_cache_query_tokens",
    ),
    (
        "epd_prefix_cache_hit_tokens_total",
        "Prompt tokens whose KV came from the prefix cache, since start (vLLM's prefix_cache_hits).",
        "prefix_cache_hit_tokens",
    ),
    (
        "epd_prefix_cache_hits_total",
        "Prompts that reused a cached prefix's KV (16 tokens or more), since start.",
        "prefix_cache_hits",
    ),
    (
        "epd_prefix_cache_misses_total",
        "Prompts eligible for the prefix cache that found no usable prefix, since start.",
        "prefix_cache_misses",
    ),
    (
        "epd_prefix_cache_evictions_total",
        "Prefix-cache entries dropped for room (LRU) or age (TTL), since start.",
        "prefix_cache_evictions",
    ),
]
# Prefill's KV store (`prefill_svc/kv_store.py`): the caches it holds until a decoder pulls them,
# beside decode's KV memory (epd_engine_memory_*_bytes), on the prefill cores' samples only.
_KV_STORE_GAUGES = [
    ("epd_kv_store_caches", "KV caches prefill holds for a decoder to pull, now.", "kv_store_caches"),
    (
        "epd_kv_store_used_bytes",
        "Bytes of the KV caches prefill holds for decoders, now.",
        "kv_store_used_bytes",
    ),
    ("epd_kv_store_total_bytes", "Prefill's KV store budget (--kv-store-bytes).", "kv_store_total_bytes"),
]
_KV_STORE_DROPPED = (
    "epd_kv_store_dropped_total",
    "KV caches prefill dropped before a decoder confirmed them, since start, by reason: expired "
    "(--kv-ttl: a decoder or gateway died, or decode is too slow to pull) or released (the request ended).",
)
_KV_STORE_DROP_REASONS = [("expired", "kv_store_expired"), ("released", "kv_store_released")]
_PREFILL_STAGE = "prefill"
_PREFILL_GAUGES = _PREFIX_GAUGES + _KV_STORE_GAUGES
_PREFILL_COUNTERS = _PREFIX_COUNTERS + [
    (
        "epd_kv_store_refused_total",
        "KV caches prefill's store refused for want of room (--kv-store-bytes), since start: requests "
        "answered RESOURCE_EXHAUSTED after their prefill, because decoders pull too slowly or too few.",
        "kv_store_refused",
    )
]

# The encoder's decode backends (`encoder_svc/engine.py`), on the encoder cores' samples only.
_ENCODER_COUNTERS = [
    (
        "epd_encoder_decord_fallbacks_total",
        "Requests the encoder decoded with PyAV after their decord child crashed (--decode-backend "
        "decord), since start.",
        "decord_fallbacks",
    )
]
_ENCODER_STAGE = "encoder"

Family = GaugeMetricFamily | CounterMetricFamily


class EngineLoadCollector:
    """A prometheus_client collector over the loads read by the last `refresh()`."""

    def __init__(self, registry: CollectorRegistry, timeout_s: float = LOAD_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self._stages: list[Sources] = []
        self._error_series: set[tuple[str, str]] = set()  # (stage, replica) of the sources listed last
        self.loads: list[tuple[LoadSource, EngineLoad]] = []
        self._refresh_once = SingleFlight(self._refresh)
        self.scrape_errors = Counter(
            "epd_load_scrape_errors_total",
            "Scrapes in which a stage replica did not report its engine load in time.",
            ["stage", "replica"],
            registry=registry,
        )
        registry.register(self)

    def add_sources(self, stages: Sequence[Sources]) -> None:
        self._stages += stages
        self.sources()  # an error series for each from the start, at 0

    def sources(self) -> list[LoadSource]:
        """Every stage's sources now. Each has an error series; a replica gone from its pool
        loses its own (a gateway whose replica file moves over many addresses keeps no
        series of the departed)."""
        sources = [source for stage in self._stages for source in stage()]
        series = {(s.stage, s.replica) for s in sources}
        for stage, replica in self._error_series - series:
            self.scrape_errors.remove(stage, replica)
        for stage, replica in series - self._error_series:
            self.scrape_errors.labels(stage=stage, replica=replica)
        self._error_series = series
        return sources

    async def refresh(self) -> None:
        """Read every source at once; a source that fails or times out is counted and left out.
        Concurrent scrapes (GET /metrics is open to anyone) share the reads in flight."""
        await self._refresh_once()

    async def _refresh(self) -> None:
        sources = self.sources()
        answers = await asyncio.gather(
            *(within(s.read(self.timeout_s), self.timeout_s) for s in sources),
            return_exceptions=True,
        )
        loads = []
        for source, answer in zip(sources, answers):
            if isinstance(answer, BaseException):
                log.debug("no engine load from %s at %s: %r", source.stage, source.replica, answer)
                if (source.stage, source.replica) in self._error_series:  # not removed meanwhile
                    self.scrape_errors.labels(stage=source.stage, replica=source.replica).inc()
                continue
            loads += [(source, load) for load in answer]
        self.loads = loads

    def describe(self) -> Iterator[Metric]:
        engine, prefill, encoder, dropped = self._families()
        yield from [family for family, _ in engine + prefill + encoder] + [dropped]

    def collect(self) -> Iterator[Metric]:
        engine, prefill, encoder, dropped = self._families()
        for source, load in self.loads:
            labels = [source.stage, load.stage, source.replica]
            for family, attr in engine:
                family.add_metric(labels, float(getattr(load, attr)))
            if source.stage == _PREFILL_STAGE:
                for family, attr in prefill:
                    family.add_metric(labels, float(getattr(load, attr)))
                for reason, attr in _KV_STORE_DROP_REASONS:
                    dropped.add_metric([*labels, reason], float(getattr(load, attr)))
            if source.stage == _ENCODER_STAGE:
                for family, attr in encoder:
                    family.add_metric(labels, float(getattr(load, attr)))
        yield from [family for family, _ in engine + prefill + encoder] + [dropped]

    @staticmethod
    def _families() -> tuple[
        list[tuple[Family, str]], list[tuple[Family, str]], list[tuple[Family, str]], CounterMetricFamily
    ]:
        """(every core's families, the prefill cores' own, the encoder cores' own, the KV store's
        drops by reason), each family with the `EngineLoad` field it shows; empty, filled by `collect`."""

        def of(
            gauges: list[tuple[str, str, str]], counters: list[tuple[str, str, str]]
        ) -> list[tuple[Family, str]]:
            return [(GaugeMetricFamily(name, doc, labels=LABELS), attr) for name, doc, attr in gauges] + [
                (CounterMetricFamily(name, doc, labels=LABELS), attr) for name, doc, attr in counters
            ]

        dropped = CounterMetricFamily(*_KV_STORE_DROPPED, labels=[*LABELS, "reason"])
        return (
            of(_GAUGES, _COUNTERS),
            of(_PREFILL_GAUGES, _PREFILL_COUNTERS),
            of([], _ENCODER_COUNTERS),
            dropped,
        )
