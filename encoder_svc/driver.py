"""A request's driver (`EncoderEngine.encode`, on its request-pool thread): how one encode
reaches the model (`run_model`, or `run_tower` for the vision tower's jobs), its wait for those jobs,
and its cancel flag, checked before every model call and while it waits. No gRPC, no asyncio here."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from epd.model_runtime.adapter import VisionInputs, VisualFeatures, VLMAdapter
from epd.stages.contracts import RequestCancelled
from epd.token_pruning import PruningStats

T = TypeVar("T")

RunModel = Callable[..., Any]
"""run_model(fn, *args) -> fn(*args), run where this process runs model work (the model thread),
blocking the caller until it is done."""


TOWER_POLL_S = 0.05
"""How often a driver waiting for a tower job looks at its work's cancel flag: a work that nobody
wants any more (its leader left, then its last waiter) stops within this even mid-wait."""


class PendingFeatures(Protocol):
    """A frame group submitted to the vision tower: `result(timeout_s)` blocks the driver until its
    features are back (raises TimeoutError past `timeout_s`, RequestCancelled when the request is
    cancelled meanwhile); `cancel()` takes it out of the tower's queue."""

    def result(self, timeout_s: float | None = None) -> VisualFeatures: ...

    def cancel(self) -> None: ...


RunTower = Callable[[VisionInputs, int], PendingFeatures]
"""run_tower(inputs, group_index) -> the group's pending features (embeddings [group_tokens,
hidden] and any DeepStack features of the same shape): queued with other requests' groups (and
this request's earlier ones) for the vision tower, without waiting."""


@dataclass
class _Done:
    """Features computed already (no engine core: tests, benchmarks)."""

    features: VisualFeatures

    def result(self, timeout_s: float | None = None) -> VisualFeatures:
        return self.features

    def cancel(self) -> None:
        pass


def run_here(fn: Callable[..., T], *args: Any) -> T:
    """The RunModel of a caller that owns the model outright (tests, benchmarks)."""
    return fn(*args)


@dataclass
class Request:
    """One encode on its driver thread: how to reach the model, and its cancel flag."""

    run_model: RunModel
    run_tower: RunTower | None
    cancel: threading.Event
    num_groups_done: int = 0
    model_s: float = 0.0
    """Wall time of this request's preprocessing and model calls (tower jobs, pruning), queueing
    for the model included."""
    stats: PruningStats = field(default_factory=PruningStats)
    source_duration_s: float = 0.0
    """The whole video's duration (0 for an image), kept with its cache entry (`CACHE_FACTS`)."""

    def check_cancelled(self) -> None:
        if self.cancel.is_set():
            raise RequestCancelled(f"cancelled after {self.num_groups_done} frame groups")

    def model(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` on the model thread, unless the request is (or gets, while queued) cancelled."""
        self.check_cancelled()

        def guarded() -> T:
            self.check_cancelled()  # cancelled while it waited for the model thread
            return fn(*args)

        t0 = time.perf_counter()
        try:
            return self.run_model(guarded)
        finally:
            self.model_s += time.perf_counter() - t0

    def submit_tower(self, adapter: VLMAdapter, inputs: VisionInputs) -> PendingFeatures:
        """Queue the group for the tower (a tower job of the stage's core), or encode it now, alone,
        on `run_model`."""
        if self.run_tower is None:
            return _Done(self.model(adapter.encode_features, inputs))
        self.check_cancelled()
        return self.run_tower(inputs, self.num_groups_done)

    def wait(self, pending: PendingFeatures) -> VisualFeatures:
        t0 = time.perf_counter()
        try:
            while True:
                try:
                    return pending.result(TOWER_POLL_S)
                except TimeoutError:
                    self.check_cancelled()
        finally:
            self.model_s += time.perf_counter() - t0
