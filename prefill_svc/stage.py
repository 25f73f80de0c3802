"""The prefill stage in this process: requests through the prefill core, caches kept in a `KvStore`.

    prefill(...)  -> engine.render on a tokenizer thread (validation, chat template, tokenisation,
                     positions: a bad request is refused here and never queues; a slow template
                     holds that thread only, never a prefill step)
                  -> engine.admit on the model thread (the prefix cache's lookup)
                  -> core.submit: waits in the scheduler, runs in batched/chunked steps
                  -> the finished cache goes into the KvStore under a new handle
    tokenize(...) / detokenize(...) -> a tokenizer thread, never the model thread, with the
                     model's one tokenizer: they never wait for a prefill step

Used by the prefill gRPC servicer and by the embedded mode. A cancelled prefill leaves the queue
at once (its chunks' cache is freed before the next step) and stores nothing.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from epd.model_runtime.grammar_state import CompiledGrammar
from epd.model_runtime.sampling import GenerationConfig, StructuredOutputs
from epd.model_runtime.structured_output import close_compiler, compile_for
from epd.model_runtime.threads import pin_torch_threads
from epd.prefill_svc.engine import PrefillEngine
from epd.prefill_svc.first_token import PrefillOutput
from epd.prefill_svc.kv_store import KvStore
from epd.prefill_svc.runner import PrefillRunner
from epd.prefill_svc.scheduler import PrefillRequest, PrefillScheduler
from epd.stages.contracts import EncodedMedia, MediaInput, PrefillHandle, PrefillStage
from epd.stages.deadline import client_deadline
from epd.stages.engine_core import EngineCore, EngineLoad
from epd.stages.errors import DeadlineExceeded
from epd.stages.messages import ChatTemplateOptions, Message
from epd.stages.model_info import ModelInfo
from epd.stages.model_thread import CLOSE_WAIT_S, ModelThread
from epd.stages.raw_prompt import RawPrompt
from epd.stages.tokenize import TokenizeInput, TokenizeOutput
from epd.token_pruning import PruningConfig

log = logging.getLogger(__name__)
T = TypeVar("T")

TOKENIZER_THREAD_NAME = "prefill_tokenize"
"""The threads that render prompts and answer /tokenize and /detokenize (py-spy and thread dumps
show them)."""

TOKENIZER_THREADS = 4
"""How many prompts (and /tokenize calls) render at once with the server's chat template
(--chat-template or the model's own), off the model thread. More than one, so that a slow render
(a long tool list) holds one thread and the requests behind it render on the others; when every
one is held, later requests wait for one (docs/architecture.md, "Prefill core"). Jinja renders in
Python, under the GIL, so more threads would not render faster."""

REQUEST_TEMPLATE_THREAD_NAME = "prefill_template"
"""The threads that render prompts with a request's own chat template."""

REQUEST_TEMPLATE_THREADS = TOKENIZER_THREADS - 1
"""How many renders of requests' own chat templates (--trust-request-chat-template) run at once,
on threads of their own: requests that bring no template never wait behind them, however slow
(a template that loops holds its thread until it ends). Before, they shared the tokenizer
threads, and four slow ones held every request and /tokenize (docs/benchmarks.md, "Render
threads"). One fewer than the server's, as the bound the requests' templates had there when one
thread was kept for the server's."""


class _RenderCancelled(Exception):
    """A render stopped between its steps: its caller went away (nobody sees it)."""


@dataclass
class _RenderTurn:
    """What a render on a tokenizer thread checks before it starts and between its steps."""

    request_id: str
    deadline_s: float | None
    """time.monotonic() at which the caller gives up; None: none."""
    cancelled: threading.Event = field(default_factory=threading.Event)
    """Set when the awaiting task is cancelled (its caller went away, or its deadline ended the call)."""

    def check(self) -> None:
        if self.cancelled.is_set():
            raise _RenderCancelled(self.request_id)
        if self.deadline_s is not None and time.monotonic() >= self.deadline_s:
            raise DeadlineExceeded(
                f"request {self.request_id} reached its deadline before its prompt was rendered (it waited "
                "for one of prefill's render threads, or its chat template renders slowly); retry with a "
                "longer deadline, or later"
            )


def build_prefill_core(engine: PrefillEngine, model_thread: ModelThread) -> EngineCore[PrefillRequest]:
    """The scheduler from `engine.config.scheduler` (chunking off for a model family that cannot
    prefill in chunks), the runner over `engine`, both on `model_thread`."""
    config = engine.config.scheduler
    if not engine.adapter.supports_chunked_prefill:
        config = replace(config, prefill_chunk_tokens=None)
    return EngineCore(PrefillScheduler(config), PrefillRunner(engine), model_thread)


class LocalPrefillStage(PrefillStage):
    def __init__(
        self,
        engine: PrefillEngine,
        kv_store: KvStore,
        model_thread: ModelThread,
        kv_address: str = "",
        core: EngineCore[PrefillRequest] | None = None,
    ) -> None:
        self.engine = engine
        self.kv_store = kv_store
        self.model_thread = model_thread
        self.kv_address = kv_address
        """host:port decoders pull this stage's caches from ("" when they take them in-process)."""
        self.core = core or build_prefill_core(engine, model_thread)
        self._tokenizer_pool = ThreadPoolExecutor(
            TOKENIZER_THREADS,
            thread_name_prefix=TOKENIZER_THREAD_NAME,
            # Positions are torch operations: one torch thread each, so that only the model
            # thread runs an OpenMP team (docs/architecture.md, "Concurrency").
            initializer=self._start_tokenizer_thread,
        )
        """Render prompts and answer /tokenize and /detokenize (started at the first call);
        `close_tokenizer` stops them."""
        self._template_pool = ThreadPoolExecutor(
            REQUEST_TEMPLATE_THREADS,
            thread_name_prefix=REQUEST_TEMPLATE_THREAD_NAME,
            initializer=self._start_tokenizer_thread,
        )
        """The same, for prompts and /tokenize calls rendered with the request's own chat template."""
        self._tokenizer_threads: list[threading.Thread] = []
        """The threads of both started, which `close_tokenizer` waits for."""

    async def prefill(
        self,
        messages: Sequence[Message],
        media: EncodedMedia | None,
        generation: GenerationConfig,
        request_id: str,
        pruning: PruningConfig = PruningConfig(),
        cache_salt: str = "",
        kv_handle: str = "",
        *,
        raw_prompt: RawPrompt | None = None,
        template: ChatTemplateOptions = ChatTemplateOptions(),
    ) -> PrefillHandle:
        """`kv_handle`: the caller's handle for the stored cache (`kv_store.check_handle`), so that
        it can release a cache whose answer it never got; "" = a new one. The request's client
        deadline (`epd.stages.deadline`: set by the prefill servicer from its gRPC call, by the
        gateway in front of an embedded pipeline): a render not started by then is refused,
        DeadlineExceeded, and one in progress stops at its next step; none set: no deadline but
        the caller's cancelling."""
        out: PrefillOutput | None = None
        try:
            # The chat template and tokenisation off the model thread (as vLLM renders in its
            # front end, off the engine): a slow template delays only its own request. The same
            # adapter calls as on the model thread, so the same token ids.
            render = functools.partial(
                self.engine.render,
                messages,
                media,
                generation,
                pruning,
                request_id,
                cache_salt=cache_salt,
                raw_prompt=raw_prompt,
                template=template,
            )
            rendered = await self._render(render, request_id, template.chat_template is not None)
            request = await self.model_thread.run(self.engine.admit, rendered)
            # Off the event loop and the model thread; a spec seen before (or compiled early,
            # `compile_structured_outputs`) comes from the cache.
            request.grammar = await self._compile(generation.structured_outputs)
            async for item in self.core.submit(request):
                out = item  # the one output: the finished prompt's handle and cache
        except asyncio.CancelledError:
            # Queued: it leaves the queue now; mid-way: its partial cache is freed before the next
            # step; finished but not yet stored: its cache goes with `out`.
            log.info("prefill of request %s cancelled by its caller; no KV cache is kept", request_id)
            raise
        if out is None:
            raise RuntimeError(f"the prefill core ended request {request_id} without an output")
        return replace(
            out.handle,
            kv_handle=self.kv_store.put(out.cache, kv_handle, num_choices=out.handle.num_choices),
            kv_address=self.kv_address,
        )

    async def compile_structured_outputs(
        self,
        spec: StructuredOutputs,
        messages: Sequence[Message],
        media: MediaInput,
        request_id: str,
        cache_salt: str = "",
    ) -> None:
        # One replica: the routing arguments (`messages`, `media`, `cache_salt`) choose nothing here.
        await self._compile(spec)

    async def _compile(self, spec: StructuredOutputs | None) -> CompiledGrammar | None:
        """`spec` compiled for this model (None: none), under --structured-compile-timeout-s."""
        return await compile_for(
            self.engine.adapter,
            spec,
            self.model_thread,
            self.engine.config.model.structured_compile_timeout_s,
        )

    async def release(self, handle: PrefillHandle, request_id: str) -> None:
        if self.kv_store.release(handle.kv_handle):
            log.info("released the KV cache of request %s: it ended before a decoder took it", request_id)

    def model_info(self) -> ModelInfo:
        return self.engine.model_info()

    async def tokenize(self, request: TokenizeInput, request_id: str) -> TokenizeOutput:
        # Off the model thread, on the tokenizer threads (which render prompts too): it never
        # waits for a prefill step nor takes model time from one. They share the model's one
        # tokenizer, without a lock: no call changes the tokenizer's settings
        # (`VLMAdapter.settle_tokenizer`), so the threads only read it, at once if they like, and
        # no copy is kept (a prefill process holds 46-141 MiB less with a Qwen2-sized vocabulary;
        # docs/benchmarks.md). Calls beyond the threads queue there, in arrival order. Checked as
        # a prompt's render is (`_render`): its deadline and its caller leaving.
        return await self._render(
            functools.partial(self.engine.tokenize, request),
            request_id,
            request.template.chat_template is not None,
        )

    async def detokenize(self, token_ids: Sequence[int], request_id: str) -> str:
        return await self._on_tokenizer_thread(self.engine.detokenize, token_ids)

    async def _render(
        self,
        render: Callable[..., T],
        request_id: str,
        requests_template: bool,
    ) -> T:
        """`render(checkpoint=...)` (`PrefillEngine.render`, `PrefillEngine.tokenize`) on a
        tokenizer thread, stopped between its steps once nobody waits for it: cancelling the await
        drops a render not started and stops one in progress at its next step
        (`RenderOptions.checkpoint`: a chat template's render in progress runs to its end); a
        render whose deadline (`epd.stages.deadline`) passed while it waited for a thread is
        refused unrendered, and one in progress stops at its next step, both DeadlineExceeded.
        That deadline is its call's, not always its client's: in a prefill server, the gRPC call's
        (`PrefillServicer`), the sooner of the gateway's client's deadline and the gateway's bound
        on one attempt (`ReplicaPool.call`: `stage_timeout_s`, --stage-attempt-timeout); in an
        embedded pipeline, the one its caller set (`epd ask --timeout`, `epd serve --colocate`'s
        gRPC front door)."""
        turn = _RenderTurn(request_id, client_deadline())

        def checked() -> T:
            try:
                turn.check()
            except DeadlineExceeded:
                log.info(
                    "the render of request %s was refused unrendered: its call's deadline passed while "
                    "it waited for a thread",
                    request_id,
                )
                raise
            try:
                return render(checkpoint=turn.check)
            except _RenderCancelled:
                log.info(
                    "the render of request %s stopped between its steps: its caller went away", request_id
                )
                raise
            except DeadlineExceeded:
                log.info(
                    "the render of request %s stopped between its steps: its call's deadline passed",
                    request_id,
                )
                raise

        try:
            return await self._on_tokenizer_thread(checked, requests_template=requests_template)
        except asyncio.CancelledError:
            turn.cancelled.set()
            raise

    async def _on_tokenizer_thread(
        self, fn: Callable[..., T], *args: Any, requests_template: bool = False
    ) -> T:
        """`fn(*args)` on a tokenizer thread (one of those for a request's own chat template when
        `requests_template`), in the caller's context (as `ModelThread.run`); cancelling the await
        drops a call that has not started."""
        call = functools.partial(contextvars.copy_context().run, fn, *args)
        pool = self._template_pool if requests_template else self._tokenizer_pool
        return await asyncio.wrap_future(pool.submit(call))

    def load(self) -> EngineLoad:
        """What the prefill core is doing now (running/waiting requests, last batch size, steps),
        its prefix cache (hits, misses, tokens queried and reused, evictions, entries, bytes) and its KV store (caches
        waiting for decoders, bytes, budget, caches dropped unpulled)."""
        prefix = self.engine.prefix_cache.stats()
        kv = self.kv_store.stats()
        return replace(
            self.core.load(),
            prefix_cache_hits=prefix.num_hits,
            prefix_cache_misses=prefix.num_misses,
            prefix_cache_query_tokens=prefix.num_query_tokens,
            prefix_cache_hit_tokens=prefix.num_hit_tokens,
            prefix_cache_evictions=prefix.num_evictions,
            prefix_cache_entries=prefix.num_entries,
            prefix_cache_bytes=prefix.num_bytes,
            kv_store_caches=kv.num_caches,
            kv_store_used_bytes=kv.num_bytes,
            kv_store_total_bytes=kv.max_bytes,
            kv_store_expired=kv.num_expired,
            kv_store_released=kv.num_released,
            kv_store_refused=kv.num_refused,
        )

    def _start_tokenizer_thread(self) -> None:
        """Each tokenizer thread's first act: one torch thread (positions are torch operations, and
        only the model thread runs an OpenMP team: docs/architecture.md, "Concurrency"), and known
        to `close_tokenizer` before it takes a call."""
        pin_torch_threads(1)
        self._tokenizer_threads.append(threading.current_thread())

    def close_tokenizer(self, wait_s: float | None = None) -> None:
        """Stop the tokenizer threads after the calls they run (queued calls are cancelled), and wait
        for them to end, for at most `wait_s` in all (default `CLOSE_WAIT_S`, as the model thread's
        close; 0: do not wait). It joins threads: not on the event loop. A thread still rendering
        then (a trusted request's own chat template that loops: Python cannot stop it) is named in
        a warning and left to end with its render or with the process. Idempotent."""
        self._stop_tokenizer()
        deadline_s = time.monotonic() + (CLOSE_WAIT_S if wait_s is None else wait_s)
        for thread in self._tokenizer_threads:
            thread.join(max(0.0, deadline_s - time.monotonic()))
        if running := [t.name for t in self._tokenizer_threads if t.is_alive()]:
            log.warning("prefill tokenizer threads %s still render after close", ", ".join(running))

    def close_compiles(self, wait_s: float = 0.0) -> None:
        """Take no structured-output compile after this and wait for those still running (one
        left past its deadline too) for at most `wait_s`; one still compiling then (xgrammar's
        compile cannot be stopped: a pathological regex runs for minutes) is named in a warning and
        left to the process's exit (`structured_output.close_compiler`). It joins threads: not on
        the event loop. Idempotent."""
        close_compiler(self.engine.adapter, wait_s)

    async def close(self) -> None:
        # On the event loop: no new render starts; the owner waits for the running ones after
        # (`close_tokenizer`, off the loop).
        self._stop_tokenizer()
        await self.core.close()

    def _stop_tokenizer(self) -> None:
        for pool in (self._tokenizer_pool, self._template_pool):
            pool.shutdown(wait=False, cancel_futures=True)
