"""The decode core's scheduler and its requests: which requests run in the next step. No torch,
no gRPC (unit-tested alone: tests/unit/decode/test_decode_scheduler.py).

A request reaches the scheduler only once its KV memory is reserved (`KvMemory`) and its cache
has arrived, so every request the scheduler holds can run: the next step takes all of them, the
running batch plus the newly arrived, which join it (continuous batching). Requests leave the
moment they finish or are cancelled (`remove`). Admission and back-pressure happen before, in
`KvMemory.reserve`, which bounds the batch by the memory budget and `max_running`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from epd.decode_svc.kv_memory import KvMemory
from epd.stages.contracts import PrefillHandle
from epd.stages.engine_core import CoreRequest, EngineLoad, Scheduler
from epd.token_pruning import PruningConfig


@dataclass(eq=False)
class DecodeRequest(CoreRequest):
    """One request in the decode core. The stage fills `kv` when the cache has arrived; the
    runner turns it into `generation` (and a row of its batch cache) when the request joins."""

    handle: PrefillHandle | None = None
    generation_config: Any = None  # GenerationConfig
    pruning: PruningConfig = field(default_factory=PruningConfig)
    final_length: int = 0
    """Cache columns the request may need: cached prompt tokens + max_new_tokens."""
    kv: Any = None  # KvCache, until the runner takes it
    kv_transfer_ms: float = 0.0
    kv_num_bytes: int = 0
    kv_confirmed: bool = False
    """Prefill was told it may drop its copy of the cache (after the first token; decode_svc/stage.py)."""
    grammar: Any = None
    """Its structured-output constraint compiled for this model (`CompiledGrammar`; None: none)."""
    generation: Any = None  # decode_svc.engine.Generation, owned by the runner
    row: int | None = None
    """Its row in the runner's BatchKv (None: not joined, or decoding alone)."""


class DecodeScheduler(Scheduler[DecodeRequest]):
    def __init__(self, memory: KvMemory) -> None:
        self.memory = memory
        self.running: list[DecodeRequest] = []
        self.arrived: list[DecodeRequest] = []  # cache here, joining at the next step

    def add(self, request: DecodeRequest) -> None:
        self.arrived.append(request)

    def schedule(self) -> list[DecodeRequest]:
        self.running += self.arrived
        self.arrived = []
        return list(self.running)

    def remove(self, request: DecodeRequest) -> None:
        for queue in (self.running, self.arrived):
            if request in queue:
                queue.remove(request)

    def requests(self) -> list[DecodeRequest]:
        return [*self.running, *self.arrived]

    def load(self) -> EngineLoad:
        return EngineLoad(
            stage="decode",  # the service role
            num_running=len(self.running),
            # Waiting for room in KV memory, or to join (their cache is here); those whose cache is
            # on its way are added by the stage (`LocalDecodeStage.load`).
            num_waiting=self.memory.num_waiting + len(self.arrived),
            memory_used_bytes=self.memory.used_bytes,
            memory_total_bytes=self.memory.budget_bytes,
        )
