"""The encoder core's bookkeeping: which frame groups go through the vision tower together.

A *tower job* is one frame group (or the one image) of one media request, already preprocessed
into patches on its request's driver thread. Jobs wait in one queue, in arrival order or, under
`--scheduling-policy priority`, by their request's priority first (`epd.stages.scheduling`); each
step takes the first jobs, of any requests, while their patches fit `max_patches_per_step` (the first job
always, so a group larger than the budget still runs, alone). The runner encodes them in one
tower call and every job finishes in that step, so the running batch is empty again before the
next `schedule`. No torch and no gRPC here: unit-tested with plain counters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from epd.stages.engine_core import CoreRequest, EngineLoad, Scheduler
from epd.stages.errors import Busy
from epd.stages.scheduling import WaitingQueue

if TYPE_CHECKING:
    from epd.model_runtime.adapter import VisionInputs


@dataclass(eq=False)
class TowerJob(CoreRequest):
    """One frame group or image of one media request (`request_id` names the media request)."""

    num_patches: int = 0
    """Rows of `inputs.pixel_values`: what the step budget counts."""
    group_index: int = 0
    """Which frame group of its request (0 for an image), for logs."""
    inputs: VisionInputs | None = None
    """The preprocessed patches; None once encoded (the runner drops them)."""


class EncodeScheduler(Scheduler[TowerJob]):
    def __init__(
        self, max_patches_per_step: int, max_waiting_jobs: int, scheduling_policy: str = "fcfs"
    ) -> None:
        """`max_waiting_jobs`: the queue bound. Each driver has at most one job queued, so the
        stage sets it to the number of drivers and `add` never refuses an admitted request."""
        if max_patches_per_step < 1 or max_waiting_jobs < 1:
            raise ValueError(
                f"max_patches_per_step and max_waiting_jobs must be >= 1, "
                f"got {max_patches_per_step}, {max_waiting_jobs}"
            )
        self.max_patches_per_step = max_patches_per_step
        self.max_waiting_jobs = max_waiting_jobs
        self.waiting: WaitingQueue[TowerJob] = WaitingQueue(scheduling_policy)
        self.running: list[TowerJob] = []
        self.num_patches_waiting = 0

    def add(self, request: TowerJob) -> None:
        if len(self.waiting) >= self.max_waiting_jobs:
            raise Busy(
                f"the encoder's tower queue holds {len(self.waiting)} frame groups; retry shortly, or "
                "start the encoder with a larger --max-concurrent-decodes"
            )
        self.waiting.push(request, request.priority)
        self.num_patches_waiting += request.num_patches

    def reprioritize(self, job: TowerJob, priority: int) -> None:
        """`job` is served at `priority` from now (the shared work it belongs to runs for other
        requests, `encoder_svc/single_flight.py`): waiting, it moves to its place at that
        priority, keeping its arrival among equals; running, it only keeps the number."""
        job.priority = priority
        self.waiting.reprioritize(job, priority)

    def schedule(self) -> list[TowerJob]:
        batch: list[TowerJob] = []
        num_patches = 0
        while self.waiting and (
            not batch or num_patches + self.waiting.peek().num_patches <= self.max_patches_per_step
        ):
            job = self.waiting.pop()
            self.num_patches_waiting -= job.num_patches
            num_patches += job.num_patches
            batch.append(job)
        self.running.extend(batch)
        return batch

    def remove(self, request: TowerJob) -> None:
        if request in self.running:
            self.running.remove(request)
        elif self.waiting.remove(request):
            self.num_patches_waiting -= request.num_patches

    def requests(self) -> list[TowerJob]:
        return [*self.running, *self.waiting]

    def load(self) -> EngineLoad:
        return EngineLoad(stage="encode", num_running=len(self.running), num_waiting=len(self.waiting))
