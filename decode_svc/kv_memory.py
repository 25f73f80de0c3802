"""The decode service's KV memory budget: room is reserved before a cache is pulled.

A request reserves room for its whole life, its final length (cached prompt tokens + the tokens it
may still generate), *before* its KV cache is pulled from prefill (SGLang's decode side has a
prealloc queue for the same reason): a cache is never pulled into memory that does not exist, and a
running request never has to be preempted for lack of room. When there is no room, the request
waits in arrival order, or under `--scheduling-policy priority` by its priority first
(`epd.stages.scheduling`; a running request is never preempted for a waiting one, whatever their
priorities). The waiting head blocks the ones behind it (so large requests are not starved by
smaller ones of their priority); when
the wait queue is full too, `reserve` refuses at once with Busy (RESOURCE_EXHAUSTED, retry later;
HTTP 429). A request larger than the whole budget is a plain ResourceExhausted (send less: 413).

The cost model is the batch's real layout (`epd.model_runtime.batch_kv.BatchKv`): every running
row is as long as the longest final length, so

    bytes(reservations) = count * (max(final lengths) * bytes_per_token + fixed_bytes)

must stay within `budget_bytes`, and at most `max_running` requests hold room at once
(`fixed_bytes`: state a request holds whatever its length, e.g. a hybrid model's linear-attention
states; 0 for attention-only models).

No torch, no gRPC: unit-tested alone (tests/unit/decode/test_kv_memory.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from epd.stages.errors import Busy, ResourceExhausted
from epd.stages.scheduling import WaitingQueue


class KvMemory:
    def __init__(
        self,
        budget_bytes: int,
        bytes_per_token: int,
        max_running: int,
        max_waiting: int,
        fixed_bytes: int = 0,
        scheduling_policy: str = "fcfs",
    ) -> None:
        if budget_bytes <= 0 or bytes_per_token <= 0 or max_running < 1 or max_waiting < 0:
            raise ValueError(
                f"budget_bytes and bytes_per_token must be > 0, max_running >= 1, max_waiting >= 0; got "
                f"{budget_bytes}, {bytes_per_token}, {max_running}, {max_waiting}"
            )
        self.budget_bytes = budget_bytes
        self.bytes_per_token = bytes_per_token
        self.max_running = max_running
        self.max_waiting = max_waiting
        self.fixed_bytes = fixed_bytes
        self._held: dict[object, int] = {}  # owner -> final length in tokens
        self._waiting: WaitingQueue[tuple[object, int, asyncio.Future]] = WaitingQueue(scheduling_policy)

    # -- state --------------------------------------------------------------------------------

    @property
    def num_holding(self) -> int:
        return len(self._held)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def used_bytes(self) -> int:
        return self.cost_bytes(self._held.values())

    def cost_bytes(self, final_lengths) -> int:
        lengths = list(final_lengths)
        return len(lengths) * (max(lengths, default=0) * self.bytes_per_token + self.fixed_bytes)

    def fits(self, final_length: int) -> bool:
        """Whether one more request of `final_length` tokens fits next to those holding room."""
        return (
            len(self._held) < self.max_running
            and self.cost_bytes([*self._held.values(), final_length]) <= self.budget_bytes
        )

    # -- reserve / free -----------------------------------------------------------------------

    def check_admissible(self, final_length: int) -> None:
        """A request that could never fit, even alone, is refused outright (not queued forever)."""
        need = final_length * self.bytes_per_token + self.fixed_bytes
        if need > self.budget_bytes:
            raise ResourceExhausted(
                f"this request needs {need} bytes of KV memory ({final_length} tokens), more than the "
                f"decoder's whole budget of {self.budget_bytes}; lower max_new_tokens or the video's "
                "frames, or start the decoder with a larger --kv-budget-bytes"
            )

    async def reserve(self, owner: object, final_length: int, priority: int = 0) -> None:
        """Hold room for `owner` (waits its turn until there is room; cancelling the wait leaves
        the queue). ResourceExhausted when the wait queue is full."""
        self.check_admissible(final_length)
        # Room now, and no one waiting ahead of it (none, or, by priority, none of a value as low):
        # held at once, even when the wait queue is full (it never joins it). The waiting head does
        # not fit (each `_grant` leaves it so), so one that would queue behind it waits.
        if self.fits(final_length) and self._waiting.goes_first(priority):
            self._held[owner] = final_length
            return
        if len(self._waiting) >= self.max_waiting:
            raise Busy(
                f"the decoder's KV memory is full ({len(self._held)} requests hold "
                f"{self.used_bytes} of {self.budget_bytes} bytes) and {len(self._waiting)} more wait "
                "for room; retry shortly, or start the decoder with a larger --kv-budget-bytes, "
                "--max-running-requests or --max-waiting-requests"
            )
        future = asyncio.get_running_loop().create_future()
        entry = (owner, final_length, future)
        self._waiting.push(entry, priority)
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.free(owner)  # granted in the same instant it was cancelled
            else:
                self._waiting.remove(entry)  # unless _grant dropped it already
                self._grant()  # the head may have been the one blocking the rest
            raise

    def free(self, owner: object) -> None:
        if self._held.pop(owner, None) is not None:
            self._grant()

    @asynccontextmanager
    async def reservation(self, owner: object, final_length: int, priority: int = 0) -> AsyncIterator[None]:
        await self.reserve(owner, final_length, priority)
        try:
            yield
        finally:
            self.free(owner)

    def _grant(self) -> None:
        while self._waiting and self.fits(self._waiting.peek()[1]):
            owner, final_length, future = self._waiting.pop()
            if future.cancelled():
                continue
            self._held[owner] = final_length
            future.set_result(None)
