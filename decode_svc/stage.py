"""The decode stage in this process: the decode core (`EngineCore` with `DecodeScheduler` and
`DecodeRunner`, model calls on the `ModelThread`) behind the `DecodeStage` contract. Used by the
decode gRPC servicer and by the embedded mode.

The two differ only in where the KV cache comes from, `take_kv`: the embedded mode takes it from
the prefill stage's in-process `KvStore` (its in-memory 'transfer'); the decode service pulls it
from the prefill server over gRPC (`epd.decode_svc.kv_pull.KvPuller.take_kv`). Everything else is
this class. A request's life here:
  1. the generation-limits check, and the handle's token ids against the vocabulary (before
     anything is reserved or moved);
  2. `KvMemory.reserve`: room for its whole life (cached tokens + max_new_tokens), waiting in
     arrival order (or by priority first, `--scheduling-policy priority`) when the budget is taken, RESOURCE_EXHAUSTED when the wait queue is full too;
  3. the pull (`take_kv`), timed; prefill keeps its copy until the first token is out
     (`confirm_kv`), so a pull cut short, or a decoder lost before its first token, leaves it there
     for the gateway's retry on another decoder (`epd.decode_svc.kv_pull`);
  4. `core.submit`: it joins the running batch at the next step and streams a token per step;
  5. however it ends (finished, client gone, error), its row and its reservation are freed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import replace

from epd.decode_svc.config import DecodeConfig
from epd.decode_svc.engine import DecodeEngine
from epd.decode_svc.kv_memory import KvMemory
from epd.decode_svc.runner import DecodeRunner
from epd.decode_svc.scheduler import DecodeRequest, DecodeScheduler
from epd.model_runtime.kv_cache import KvCache
from epd.model_runtime.sampling import GenerationConfig
from epd.model_runtime.structured_output import compile_for
from epd.prefill_svc.kv_store import KvStore
from epd.stages.contracts import DecodeStage, PrefillHandle, TokenStep, check_generation_limits
from epd.stages.engine_core import EngineCore, EngineLoad
from epd.stages.errors import InvalidRequest
from epd.stages.model_thread import ModelThread
from epd.token_pruning import PruningConfig

log = logging.getLogger(__name__)

CONFIRM_WAIT_S = 2.0
"""How long `close` waits for the receipts still on their way to prefill: each is one small call."""

TakeKv = Callable[[PrefillHandle], Awaitable[KvCache]]
"""take_kv(handle) -> the KV cache of `handle`, handed over once: the caller owns it then."""

ConfirmKv = Callable[[PrefillHandle], Awaitable[None]]
"""confirm_kv(handle): the request's first token is out, prefill may drop its copy of the cache
(the service's `KvPuller.confirm_kv`; in-process, `take` already removed it)."""


def take_from_store(kv_store: KvStore) -> TakeKv:
    """The in-process 'transfer': take the cache out of the prefill stage's store."""

    async def take_kv(handle: PrefillHandle) -> KvCache:
        return kv_store.take(handle.kv_handle)

    return take_kv


def check_first_token_id(token_id: int, vocab_size: int | None) -> None:
    """The prefill's token, which the first batched step embeds: outside the vocabulary it would fail
    that step, and with it every request of the batch, so it is refused here (InvalidRequest)."""
    if token_id < 0 or (vocab_size is not None and token_id >= vocab_size):
        upper = f"{vocab_size - 1}" if vocab_size is not None else "the vocabulary's last id"
        raise InvalidRequest(
            f"first_token_id {token_id} is outside this model's vocabulary (0 to {upper}): prefill and "
            "decode serve different models"
        )


def check_prompt_token_ids(token_ids: list[int], vocab_size: int | None) -> None:
    """The prompt ids a repetition penalty covers (`PrefillHandle.distinct_prompt_token_ids`): distinct
    and in the vocabulary, so at most `vocab_size` of them, or InvalidRequest."""
    if not token_ids or vocab_size is None:
        return
    if len(token_ids) > vocab_size or not 0 <= min(token_ids) <= max(token_ids) < vocab_size:
        raise InvalidRequest(
            f"distinct_prompt_token_ids must be at most {vocab_size} token ids of this model's vocabulary "
            f"(0 to {vocab_size - 1}): prefill and decode serve different models"
        )


class LocalDecodeStage(DecodeStage):
    def __init__(
        self,
        engine: DecodeEngine,
        take_kv: TakeKv,
        model_thread: ModelThread,
        config: DecodeConfig | None = None,
        confirm_kv: ConfirmKv | None = None,
    ) -> None:
        """take_kv: `take_from_store(kv_store)` in-process, `KvPuller.take_kv` in the service, with
        `KvPuller.confirm_kv` as `confirm_kv`. `config` gives the generation limits and the KV
        memory budget (default: DecodeConfig's)."""
        self.engine = engine
        self.take_kv = take_kv
        self.confirm_kv = confirm_kv
        self._confirming: set[asyncio.Task] = set()
        self.num_pulling = 0
        """Requests holding room whose cache is on its way (`take_kv`)."""
        self.model_thread = model_thread
        self.config = config or DecodeConfig()
        c = self.config
        self.memory = KvMemory(
            c.kv_budget_bytes,
            engine.adapter.kv_bytes_per_token,
            c.max_running_requests,
            c.max_waiting_requests,
            engine.adapter.decode_state_bytes,  # fixed state per request (hybrid models: linear states)
            c.scheduling_policy,
        )
        self.core = EngineCore(DecodeScheduler(self.memory), DecodeRunner(engine), model_thread)

    def load(self) -> EngineLoad:
        """The core's load; requests whose cache is being pulled hold room and wait for their first
        step, but are not in the core yet: they count as waiting (routers and /metrics see them)."""
        load = self.core.load()
        return replace(load, num_waiting=load.num_waiting + self.num_pulling)

    async def close(self) -> None:
        """After the drain: stop the core's loop, and give the receipts to prefill still on their
        way (`confirm_kv`) up to `CONFIRM_WAIT_S` before they are cancelled (prefill then drops
        those copies at their TTL). Not the model thread: its owner's."""
        await self.core.close()
        if self._confirming:
            await asyncio.wait(set(self._confirming), timeout=CONFIRM_WAIT_S)
            for task in list(self._confirming):
                task.cancel()
            await asyncio.gather(*self._confirming, return_exceptions=True)

    def _confirm(self, request: DecodeRequest, handle: PrefillHandle) -> None:
        """The first token is out: nothing retries this request any more, so prefill's copy of its
        cache can go. In the background: the next token does not wait for prefill's answer."""
        assert self.confirm_kv is not None
        request.kv_confirmed = True
        task = asyncio.ensure_future(self.confirm_kv(handle))
        self._confirming.add(task)
        task.add_done_callback(self._confirming.discard)

    async def generate(
        self,
        handle: PrefillHandle,
        generation: GenerationConfig,
        request_id: str,
        pruning: PruningConfig = PruningConfig(),
    ) -> AsyncIterator[TokenStep]:
        vocab_size = self.engine.adapter.vocab_size
        check_generation_limits(
            generation,
            self.config.max_new_tokens_limit,
            vocab_size,
            scheduling_policy=self.config.scheduling_policy,
        )
        check_first_token_id(handle.first_token_id, vocab_size)
        check_prompt_token_ids(handle.distinct_prompt_token_ids, vocab_size)
        # Off the event loop and the model thread; a spec seen before comes from the cache.
        grammar = await compile_for(
            self.engine.adapter,
            generation.structured_outputs,
            self.model_thread,
            self.config.model.structured_compile_timeout_s,
        )
        request = DecodeRequest(
            request_id,
            priority=generation.priority,
            handle=handle,
            generation_config=generation,
            pruning=pruning,
            final_length=handle.num_cached_tokens + generation.max_new_tokens,
            grammar=grammar,
        )
        num_tokens = 0
        try:
            # Room first, then the cache: a cache is never pulled into memory that is not there.
            async with self.memory.reservation(request, request.final_length, request.priority):
                t0 = time.perf_counter()
                self.num_pulling += 1
                try:
                    kv = await self.take_kv(handle)
                finally:
                    self.num_pulling -= 1
                request.kv_transfer_ms = (time.perf_counter() - t0) * 1e3
                if kv.num_cached_tokens != handle.num_cached_tokens:
                    raise InvalidRequest(
                        f"the KV cache holds {kv.num_cached_tokens} tokens, its handle says "
                        f"{handle.num_cached_tokens}: prefill and decode disagree"
                    )
                request.kv, request.kv_num_bytes = kv, kv.num_bytes
                del kv  # the core owns it now and frees it when the request ends, however it ends
                steps = self.core.submit(request)
                async with aclosing(steps):
                    async for out in steps:
                        for step in out:
                            num_tokens += len(step.token_ids)
                            yield step
                            if num_tokens and self.confirm_kv is not None and not request.kv_confirmed:
                                self._confirm(request, handle)
        except (asyncio.CancelledError, GeneratorExit):  # cancelled waiting, or closed at a yield
            # A pull in flight is cancelled too: prefill keeps the cache (it was never confirmed)
            # until the gateway releases it or its TTL, so a retry elsewhere can pull it again.
            log.info(
                "generation of request %s cancelled by its caller after %d tokens; its KV cache is freed",
                request_id,
                num_tokens,
            )
            raise
        finally:
            if num_tokens and self.confirm_kv is not None and not request.kv_confirmed:
                self._confirm(request, handle)  # ended (or its client left) right at its first token
            request.kv = None
