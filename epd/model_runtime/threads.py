"""torch threads per model call that follow the load (`--num-threads auto`).

A stack's three model processes run at the same time only when several requests are in flight.
With one request in flight they take turns (encode, then prefill, then decode), and one thread
per call leaves the other cores idle while one stage works; with many in flight, every process
is busy and more threads than cores only make them fight over the cores. So, per model call:
every core when the call serves one request and nothing else waits in that service, one thread
otherwise. A fixed `--num-threads N` keeps N for every call.
"""

from __future__ import annotations

import os

AUTO = 0
"""`ModelConfig.num_threads` value meaning "follow the load"."""


def num_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class StepThreads:
    """Sets torch's intra-op threads before each batched step (on the model thread)."""

    def __init__(self, num_threads: int) -> None:
        self.auto = num_threads == AUTO
        self.fixed = num_threads
        self.cores = num_cores()
        self.current: int | None = None

    def for_step(self, num_in_step: int, num_waiting: int) -> int:
        if not self.auto:
            return self.fixed
        return self.cores if num_in_step <= 1 and num_waiting == 0 else 1

    def apply(self, num_in_step: int, num_waiting: int) -> None:
        n = self.for_step(num_in_step, num_waiting)
        if n != self.current:
            import torch

            torch.set_num_threads(n)
            self.current = n
