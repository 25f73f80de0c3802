"""The stack's gateway learns the served model from prefill: it loads no model (nor torch), yet a
request naming a token id outside the vocabulary should be refused before its media costs a decode
and an encode, and /v1/models should say how long a request may be (`max_model_len`).

`watch_model_info` asks the prefill replicas (`PrefillService.GetModelInfo`, over the channel their
calls use) in the background, every 0.25 s until one has answered, then every
`--stage-check-interval` seconds those whose answer may be missing or stale: one that has not
answered yet (new, loading, down), one back in routing since its answer (the health checks found
it not serving, or a call unreachable, and then SERVING: `ReplicaChooser.returns`), perhaps a
restarted process with other limits, and one whose answer is `MODEL_INFO_MAX_AGE_S` (30 s) old (a
process replaced between two health checks, a rolling update behind one Service address). One
that answered and stayed up is not asked again sooner: it was, every second, one RPC each, idle or
not, for an answer that does not change while its process lives. The pipeline reads the result through the stage (`RemotePrefillStage.model_info`).
It starts once the gateway serves its probes, so a prefill still loading its model (UNAVAILABLE) or
not reachable delays nothing: until a replica answers, the info is not known, no early check is
made and prefill's own check refuses such ids (after the encode), as before. The model's sampling
defaults (`ModelInfo.generation_defaults`, --generation-config auto) are the exception: a request
waits for them (`Pipeline.request_defaults`), as no answer may take other defaults.

`ReplicaModelInfo` keeps each replica's last answer (a replica that does not answer keeps its
last; one that leaves the pool, through the replica file or a `dns:///` lookup, is forgotten)
and their common view (`epd.stages.model_info.common_model_info`: the bounds every replica
enforces when they disagree, which it logs once per change as a WARNING naming each replica).
Prefill's own checks stay whatever the gateway believes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence

import grpc

from epd.stages.model_info import ModelInfo, common_model_info
from epd.transport.aio_cancel import answer_or_none
from epd.transport.model_info import fetch_model_info
from epd.transport.remote_prefill import RemotePrefillStage
from epd.transport.replica_pool import unresolved

log = logging.getLogger(__name__)

MODEL_INFO_TIMEOUT_S = 2.0
"""How long a read waits for a replica (a small answer; a replica that is slower is read next time)."""

UNKNOWN_POLL_S = 0.25
"""Read interval until a replica has answered: early checks start as soon as prefill serves."""

MODEL_INFO_MAX_AGE_S = 30.0
"""A replica that answered is asked again once its answer is this old, even if the health checks
never saw it down: a process replaced behind the same address between two checks (a fast restart,
a rolling update behind one Service address) may serve other limits or defaults."""


class ReplicaModelInfo:
    """Each prefill replica's last model info, and the view of them all. No gRPC: unit-tested."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.by_address: dict[str, ModelInfo] = {}
        self._answered_at: dict[str, int] = {}  # by address: its `returns` when it last answered
        self._answered_s: dict[str, float] = {}  # by address: `clock()` when it last answered
        self._clock = clock
        self._disagreement: frozenset[tuple[str, ModelInfo]] = frozenset()
        self.common: ModelInfo | None = None

    def due(self, returns: Mapping[str, int]) -> list[str]:
        """Of the replicas in the pool now (`returns`: each one's `ReplicaChooser.returns`), those
        to ask: not answered yet, back in routing since their last answer, or whose answer is
        `MODEL_INFO_MAX_AGE_S` old."""
        stale_s = self._clock() - MODEL_INFO_MAX_AGE_S
        return [
            a
            for a, n in returns.items()
            if a not in self.by_address
            or self._answered_at.get(a) != n
            or self._answered_s.get(a, stale_s) <= stale_s
        ]

    def update(
        self,
        addresses: Sequence[str],
        answers: Mapping[str, ModelInfo | None],
        returns: Mapping[str, int] | None = None,
    ) -> ModelInfo | None:
        """Replicas now in the pool (`addresses`) and what those read answered (None: no answer,
        the last answer stays; not read: likewise); `returns`: each read one's `returns` as its
        read began. Returns the common view (None: no replica has answered)."""
        self.by_address = {
            address: info
            for address in addresses
            if (info := answers.get(address) or self.by_address.get(address)) is not None
        }
        self._answered_at = {
            address: (returns or {}).get(address, 0)
            if answers.get(address)
            else self._answered_at.get(address, 0)
            for address in self.by_address
        }
        now_s = self._clock()
        self._answered_s = {
            address: now_s if answers.get(address) else self._answered_s.get(address, now_s)
            for address in self.by_address
        }
        common = common_model_info(self.by_address.values())
        if len(set(self.by_address.values())) > 1:
            disagreement = frozenset(self.by_address.items())
            if disagreement != self._disagreement:
                log.warning(
                    "prefill replicas serve different models or limits (%s); the gateway refuses early only "
                    "what every one of them refuses and advertises what every one takes (%s)",
                    "; ".join(f"{address}: {_describe(info)}" for address, info in sorted(disagreement)),
                    _describe(common),
                )
            self._disagreement = disagreement
        else:
            self._disagreement = frozenset()
            if common is not None and common != self.common:
                log.info("prefill's model: %s", _describe(common))
        self.common = common
        return common


def _describe(info: ModelInfo | None) -> str:
    if info is None:
        return "not known"
    return (
        f"{info.model_type or 'model'}, vocabulary {info.vocab_size or 'not known'}, context "
        f"{info.context_tokens or 'not known'}, prompt limit {info.max_prompt_tokens}, "
        f"max_tokens limit {info.max_new_tokens}, max_model_len {info.max_model_len}, scheduling "
        f"{info.scheduling_policy}, sampling defaults {_defaults(info.generation_defaults)}"
    )


def _defaults(defaults: tuple[tuple[str, float | int], ...] | None) -> str:
    if defaults is None:
        return "not known"
    return ", ".join(f"{key}={value}" for key, value in defaults) or "none"


async def refresh_model_info(
    stage: RemotePrefillStage, known: ReplicaModelInfo, timeout_s: float = MODEL_INFO_TIMEOUT_S
) -> None:
    """Ask the replicas of `stage` whose answer is missing or stale (`ReplicaModelInfo.due`) once
    and give the stage the common view."""
    pool = stage.pool
    # A dns:/// name gets no call until found.
    returns = {a: pool.chooser.returns(a) for a in pool.addresses if not unresolved(a)}
    addresses = known.due(returns)

    async def read(channel: grpc.aio.Channel, address: str) -> ModelInfo | None:
        return await answer_or_none(
            fetch_model_info(channel, timeout_s), timeout_s, f"no model info from prefill {address}"
        )

    # Each channel taken now, with the list: a replica removed before its read starts (the replica
    # list reloaded, a name resolved again) has its read cancelled by its closing channel, an answer
    # of none, where looking its channel up then raised KeyError and ended the watch.
    answers = await asyncio.gather(*(read(pool.channel(address), address) for address in addresses))
    listed = [a for a in pool.addresses if not unresolved(a)]  # as now: the list may have changed
    stage.known_model_info = known.update(listed, dict(zip(addresses, answers)), returns)


async def watch_model_info(stage: RemotePrefillStage, interval_s: float) -> None:
    """`refresh_model_info` every `interval_s` (every `UNKNOWN_POLL_S` while nothing is known;
    `interval_s` 0: only until a replica has answered) until cancelled: with nothing due, it
    makes no call."""
    known = ReplicaModelInfo()
    while True:
        await refresh_model_info(stage, known)
        if stage.known_model_info is not None and interval_s <= 0:
            return
        await asyncio.sleep(UNKNOWN_POLL_S if stage.known_model_info is None else interval_s)
