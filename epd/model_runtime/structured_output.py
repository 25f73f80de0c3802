"""Structured outputs (constrained decoding) with xgrammar, vLLM's default backend.

A request's `StructuredOutputs` (one constraint: a JSON Schema, any JSON object, a regex, a list
of choices or an EBNF grammar) is compiled once against the model's vocabulary into a
`CompiledGrammar` (`GrammarCompiler`: one per loaded model, shared by the stages of a process, with
xgrammar's own cache bounded in bytes, so a spec seen before is not compiled again). Compiling
runs on the compiler's own thread, never on the event loop nor on the model thread (a schema
against a 152k-token vocabulary takes from milliseconds to seconds).

Each request's sampler then holds a `GrammarState` (an xgrammar matcher): before every token it
fills the [ceil(vocab / 32)] int32 bitmask of the tokens the constraint allows next and sets every
other logit to -inf (vLLM applies the bitmask before its logits processors and sampler too); the
token chosen advances the matcher. Prefill samples the first token with it; decode rebuilds the
matcher from the same spec and advances it by that token (`Sampler.seen`), so the state continues
across the hand-off without crossing it. The grammar's only end is the model's end-of-sequence
token (its stop token here), so a complete answer ends "stop" as any answer that reaches it; rows
without a constraint never build any of this.

Under a reasoning parser (`StructuredOutputs.after_reasoning`) the constraint waits, as vLLM's
does by default: nothing is masked until the model has generated its end-of-reasoning token
(`</think>`), which the grammar does not see; the tokens after it keep to the grammar. When the
prompt already closed the thinking block (vLLM's `is_reasoning_end` of the prompt: its last think
marker is `</think>`, e.g. Qwen3's `enable_thinking: false` renders an empty block) the grammar
holds from the first token. Prefill reads the prompt (`reasoning_ended`) and tells decode
(`PrefillHandle.prompt_ends_reasoning`), which has no prompt.

Compiling has a deadline (`ModelConfig.structured_compile_timeout_s`): a spec still compiling
then is refused with INVALID_ARGUMENT saying to simplify it. xgrammar's compile cannot be
interrupted, so it runs on to its end on a thread left to it (the next compiles get a new one), and
the spec is remembered so that asking again under that deadline does not start it again; once that
compile has finished, the spec is served from xgrammar's cache like any other. At most
`MAX_ABANDONED_COMPILES` such compiles run at once: past that, a spec that needs compiling is
refused at once with RESOURCE_EXHAUSTED to retry later (HTTP 429), so that pathological specs sent
again and again cannot start threads without bound.

xgrammar is an optional dependency (`pip install 'epd[structured]'`) of the services that run the
model: a server without it refuses a request that asks for structured outputs with INVALID_ARGUMENT
saying what to install. The front door needs none of it: it checks what needs no compiler
(`StructuredOutputs.validate`) and leaves the rest to prefill, whose refusal (the compiler's
reason) reaches the client as a 400.
"""

from __future__ import annotations

import asyncio
import atexit
import contextvars
import functools
import json
import logging
import math
import os
import re
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Collection
from concurrent.futures import Future
from dataclasses import replace
from typing import Any, Protocol

from epd.model_runtime.compile_thread import CompileThread
from epd.model_runtime.grammar_state import CompiledGrammar
from epd.model_runtime.reasoning_markers import REASONING_MARKERS
from epd.model_runtime.sampling import ConstraintBusy, InvalidConstraint, StructuredOutputs

log = logging.getLogger(__name__)


class _Runs(Protocol):
    """Where prompts are tokenised (`epd.stages.model_thread.ModelThread`, a layer above this one)."""

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any: ...


INSTALL_HINT = "pip install 'epd[structured]' (xgrammar)"

GRAMMAR_CACHE_BYTES = 256 * 1024 * 1024
"""Bound of a compiler's cache of compiled grammars (xgrammar's, least recently used out first)."""

MAX_ERROR_CHARS = 300
"""A compiler's message is cut to this many characters in the error sent to the client."""

COMPILE_TIMEOUT_S = 30.0
"""How long a constraint may take to compile by default (`ModelConfig.structured_compile_timeout_s`,
--structured-compile-timeout-s): a large JSON schema against a 152k-token vocabulary compiles in
seconds on a 2-core VM; a pathological one (a regex with large repetition counts) in minutes."""

REMEMBERED_TOO_SLOW = 256
"""Specs refused as too slow to compile that a compiler remembers (the least recent out first), so
that asking again under a deadline no longer is refused at once instead of starting another
compile that cannot be stopped."""

MAX_ABANDONED_COMPILES = 2
"""Compiles that ran past their deadline and still run (each on a thread left to it: xgrammar's
cannot be stopped) above which a spec that needs compiling is refused at once (`ConstraintBusy`):
each holds a core for as long as it runs, minutes for a pathological spec."""

REMEMBERED_COMPILED = 4096
"""Specs a compiler remembers having compiled (the least recent out first): xgrammar's cache most
likely holds them, so they are served even while `MAX_ABANDONED_COMPILES` compiles still run."""

_LOG_PREFIX = re.compile(r"^\[\d\d:\d\d:\d\d\] \S+?:\d+: ")
_CHECK_FAILED = re.compile(r"Check failed: \(.*?\) is false: ")


def import_xgrammar() -> Any:
    """The xgrammar module, or InvalidConstraint saying what to install."""
    try:
        import xgrammar
    except ImportError:
        raise InvalidConstraint(
            f"structured outputs need xgrammar, which this server does not have: {INSTALL_HINT}"
        ) from None
    return xgrammar


def compiler_message(exc: BaseException) -> str:
    """xgrammar's error as a client may read it: its first line, without the C++ log prefix
    ("[04:01:02] /project/cpp/regex_converter.cc:94: ") or its assertion text, printable, bounded."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = _CHECK_FAILED.sub("", _LOG_PREFIX.sub("", text))
    text = "".join(c if c.isprintable() else " " for c in text)
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 3] + "..."


def choice_grammar(choices: Collection[str]) -> str:
    """vLLM's choice as an EBNF grammar: root ::= "a" | "b" (each a JSON-escaped string literal,
    which xgrammar's EBNF reads: quotes, backslashes and control characters escaped)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _json_text(spec: StructuredOutputs) -> str:
    return '{"type": "object"}' if spec.json_object else spec.json_schema


def _kind_name(kind: str) -> str:
    return {"json_schema": "JSON schema", "json_object": "JSON object grammar"}.get(kind, kind)


def _invalid(kind: str, exc: BaseException) -> str:
    return f"the structured-output {_kind_name(kind)} does not compile: {compiler_message(exc)}"


def _too_slow(kind: str, timeout_s: float) -> str:
    return (
        f"the structured-output {_kind_name(kind)} took longer than {timeout_s:g} s to compile "
        "(this server's --structured-compile-timeout-s); simplify it: fewer or smaller repetition "
        "counts, fewer alternatives, a smaller schema"
    )


def _busy(num_running: int) -> str:
    return (
        f"too many slow structured-output specs are still compiling on this server ({num_running} ran "
        "past its --structured-compile-timeout-s and cannot be stopped); retry later"
    )


class GrammarCompiler:
    """Compiles constraints against one model's vocabulary, off the event loop and the model
    thread, with a byte-bounded cache of what it compiled."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Collection[int],
        cache_limit_bytes: int = GRAMMAR_CACHE_BYTES,
    ) -> None:
        """tokenizer: the model's Hugging Face tokenizer; vocab_size: the logits' width (may exceed
        the tokenizer's, the rest never allowed); eos_token_ids: the grammar's stop tokens."""
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos_token_ids = sorted(eos_token_ids)
        self._cache_limit_bytes = cache_limit_bytes
        self._compiler: Any = None
        self._reasoning_ids: tuple[int | None, int | None] = (None, None)
        self._lock = threading.Lock()
        self._threads: list[CompileThread] = []
        """The compile threads made and not known to have ended, the ones left to a compile past
        its deadline too: `close` waits for them."""
        self._thread = self._new_thread()
        # spec (`_compile_key`) -> (the timeout it ran past, its compile left running)
        self._too_slow: OrderedDict[StructuredOutputs, tuple[float, Future[CompiledGrammar]]] = OrderedDict()
        # specs (`_compile_key`) compiled, so most likely in xgrammar's cache
        self._compiled: OrderedDict[StructuredOutputs, None] = OrderedDict()
        self._abandoned: list[Future[CompiledGrammar]] = []  # left to their threads, maybe running
        self.num_abandoned = 0
        """Compiles that ran past their deadline, each left on its own thread to its end."""

    def compile_now(self, spec: StructuredOutputs) -> CompiledGrammar:
        """Compile here (on the calling thread); InvalidConstraint for a spec that does not compile."""
        try:
            spec.validate()
        except ValueError as exc:
            raise InvalidConstraint(str(exc)) from None
        compiler = self._xgrammar_compiler()
        reasoning_ids = self._reasoning_token_ids() if spec.after_reasoning else None
        kind = spec.kind
        try:
            if kind in ("json_schema", "json_object"):
                compiled = compiler.compile_json_schema(
                    _json_text(spec), any_whitespace=not spec.disable_any_whitespace
                )
            elif kind == "regex":
                compiled = compiler.compile_regex(spec.regex)
            elif kind == "grammar":
                compiled = compiler.compile_grammar(spec.grammar)
            else:
                compiled = compiler.compile_grammar(choice_grammar(spec.choice))
        except Exception as exc:  # noqa: BLE001 - a spec xgrammar refuses
            raise InvalidConstraint(_invalid(kind, exc)) from None
        return CompiledGrammar(compiled, self.vocab_size, reasoning_ids)

    def _reasoning_token_ids(self) -> tuple[int, int]:
        start, end = self._reasoning_ids
        if start is None or end is None:
            # The front door refuses chat requests under a parser the model cannot serve
            # (`epd.gateway.reasoning.parser_misfit`); this is a caller that did not ask it.
            raise InvalidConstraint(
                "the structured output is to start after the reasoning's end, but this model's "
                f"tokenizer does not have {' and '.join(REASONING_MARKERS)} as single tokens"
            )
        return start, end

    async def compile(self, spec: StructuredOutputs, timeout_s: float = COMPILE_TIMEOUT_S) -> CompiledGrammar:
        """`compile_now` on the compiler's thread, in the caller's context (log records keep the
        request's id); cancelling the await drops a compile that has not started (one that has
        keeps its deadline, `_keep_deadline`). InvalidConstraint when the compile runs for longer
        than timeout_s (0: no bound), counted from its start (a wait behind other compiles is not
        its fault); the compile goes on to its end on the thread, which this compiler leaves to it.
        ConstraintBusy for a spec not compiled before while `MAX_ABANDONED_COMPILES` such compiles
        still run."""
        key = _compile_key(spec)
        slow = self._too_slow.get(key)
        if slow is not None:
            ran_past, left_running = slow
            if _compiled_late(left_running):  # in xgrammar's cache now: served from there
                del self._too_slow[key]
                self._remember_compiled(key)
            elif 0 < timeout_s <= ran_past:  # a longer deadline may try again
                self._too_slow.move_to_end(key)
                raise InvalidConstraint(_too_slow(spec.kind, ran_past))
        if key not in self._compiled:
            running = self.num_abandoned_running
            if running >= MAX_ABANDONED_COMPILES:
                raise ConstraintBusy(_busy(running))
        loop = asyncio.get_running_loop()
        while True:
            started: asyncio.Future[None] = loop.create_future()

            def run(started: asyncio.Future[None] = started) -> CompiledGrammar:
                self._xgrammar_compiler()  # the vocabulary read once (`prepare`), before the clock
                loop.call_soon_threadsafe(_resolve, started)
                return self.compile_now(spec)

            thread = self._thread
            future = thread.submit(functools.partial(contextvars.copy_context().run, run))
            done = asyncio.wrap_future(future)
            try:
                await asyncio.wait((started, done), return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:
                if not future.cancel():  # one not started is dropped; one started keeps its deadline
                    self._keep_deadline(future, thread, key, timeout_s)
                raise
            if not future.cancelled():
                break
            # It was queued behind a compile that ran past its deadline, on a thread since left to
            # that compile: submitted again, to the new thread.
        bounded = 0 < timeout_s < math.inf
        ends_at = loop.time() + timeout_s if bounded else math.inf
        try:  # asyncio.wait: the deadline leaves `done` as it is (its compile cannot be stopped)
            finished, _ = await asyncio.wait((done,), timeout=timeout_s if bounded else None)
        except asyncio.CancelledError:
            done.cancel()
            # Nobody waits for it now, but the thread is still held: past its deadline it is left
            # to it, as when its request waits, so that the compiles behind it do not wait for
            # its end (a pathological spec sent and dropped would hold them all).
            self._keep_deadline(future, thread, key, timeout_s, ends_at - loop.time())
            raise
        if finished:
            compiled = done.result()
            self._remember_compiled(key)
            return compiled
        done.cancel()  # its compile's end, whenever it comes, is for no one
        self._ran_past(future, thread, key, timeout_s)
        raise InvalidConstraint(_too_slow(spec.kind, timeout_s))

    def _keep_deadline(
        self,
        future: Future[CompiledGrammar],
        thread: CompileThread,
        key: StructuredOutputs,
        timeout_s: float,
        left_s: float | None = None,
    ) -> None:
        """Enforce the deadline of a compile that nobody waits for any more (its request went
        away): `_ran_past` when it still runs `left_s` (default `timeout_s`) from now."""
        if not 0 < timeout_s < math.inf:
            return

        def check() -> None:
            if not future.done():
                self._ran_past(future, thread, key, timeout_s)

        asyncio.get_running_loop().call_later(max(0.0, timeout_s if left_s is None else left_s), check)

    def _ran_past(
        self,
        future: Future[CompiledGrammar],
        thread: CompileThread,
        key: StructuredOutputs,
        timeout_s: float,
    ) -> None:
        """The compile `future` on `thread` ran past its deadline: the thread is left to it, the
        spec remembered (until that compile has finished)."""
        self._leave_thread(future, thread)
        before = self._too_slow.get(key)
        self._too_slow[key] = (max(timeout_s, before[0] if before else 0.0), future)
        self._too_slow.move_to_end(key)
        while len(self._too_slow) > REMEMBERED_TOO_SLOW:
            self._too_slow.popitem(last=False)

    def _remember_compiled(self, key: StructuredOutputs) -> None:
        self._compiled[key] = None
        self._compiled.move_to_end(key)
        while len(self._compiled) > REMEMBERED_COMPILED:
            self._compiled.popitem(last=False)

    @property
    def num_abandoned_running(self) -> int:
        """Compiles that ran past their deadline and still run, each on the thread left to it."""
        self._abandoned = [future for future in self._abandoned if not future.done()]
        return len(self._abandoned)

    def _leave_thread(self, future: Future[CompiledGrammar], thread: CompileThread) -> None:
        """Leave `thread` to the compile it runs (`future`; xgrammar's cannot be stopped): the next
        compiles get a new thread, and those queued on this one are submitted again there."""
        if self._thread is thread:
            self.num_abandoned += 1
            self._abandoned.append(future)
            self._thread = self._new_thread()
            thread.shutdown()

    @property
    def ready(self) -> bool:
        """The vocabulary was read (`prepare`)."""
        return self._compiler is not None

    def prepare(self) -> None:
        """Read the tokenizer's vocabulary into xgrammar's compiler (once; the first compile does
        it too)."""
        self._xgrammar_compiler()

    def cache_size_bytes(self) -> int:
        return 0 if self._compiler is None else int(self._compiler.get_cache_size_bytes())

    def _xgrammar_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                xgr = import_xgrammar()
                info = xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self.vocab_size, stop_token_ids=self._eos_token_ids
                )
                self._compiler = xgr.GrammarCompiler(
                    info,
                    max_threads=max(1, min(4, os.cpu_count() or 1)),
                    cache_enabled=True,
                    cache_limit_bytes=self._cache_limit_bytes,
                )
                # as vLLM's reasoning parsers look them up (`vocab.get`)
                vocab = self._tokenizer.get_vocab()
                start, end = (vocab.get(marker) for marker in REASONING_MARKERS)
                self._reasoning_ids = (start, end)
            return self._compiler

    def _new_thread(self) -> CompileThread:
        """A compile thread (started at its first compile), known to `close`."""
        # those ended go (one is left behind per compile past its deadline)
        self._threads = [t for t in self._threads if t.running] + [CompileThread()]
        return self._threads[-1]

    def close(self, wait_s: float = 0.0) -> None:
        """Take no compile after this (queued ones are cancelled) and wait for the compiles still
        running, those left past their deadline too, for at most `wait_s` (0: do not wait). It joins
        threads: not on the event loop. A compile still running then (xgrammar's cannot be stopped)
        is named in a warning and left to end with its compile or with the process (`epd serve`
        leaves by `os._exit`, which does not wait for it)."""
        self._thread.shutdown()
        deadline_s = time.monotonic() + wait_s
        threads = list(self._threads)
        for thread in threads:
            thread.join(max(0.0, deadline_s - time.monotonic()))
        if running := [t.name for t in threads if t.running]:
            log.warning(
                "grammar compile threads %s still compile after close (a structured output's constraint; "
                "xgrammar's compile cannot be stopped)",
                ", ".join(running),
            )


EXIT_WAIT_S = 30.0
"""How long interpreter exit waits for the compiles of the compilers still open (a script that
closed nothing: `_close_at_exit`; `epd ask` closes its pipeline, and a closed compiler is not
waited for again), as long as a service's close gives them by default (`model_thread.CLOSE_WAIT_S`):
a daemon thread that comes back from xgrammar while the interpreter finalizes aborts the process
(as a torch call's does, `epd.stages.model_thread`), so a compile that ends soon is let end; one
that runs longer is named in a warning and ends with the process."""


_COMPILERS: weakref.WeakKeyDictionary[Any, GrammarCompiler] = weakref.WeakKeyDictionary()
_COMPILERS_LOCK = threading.Lock()


def grammar_compiler(adapter: Any) -> GrammarCompiler:
    """The compiler of a loaded model (one per adapter: the prefill and decode stages of one
    process share it and its cache). InvalidConstraint for a family that does not expose its
    tokenizer or vocabulary size."""
    with _COMPILERS_LOCK:
        compiler = _COMPILERS.get(adapter)
        if compiler is None:
            tokenizer = getattr(adapter, "tokenizer", None)
            vocab_size = adapter.vocab_size
            if tokenizer is None or vocab_size is None:
                raise InvalidConstraint(
                    f"{type(adapter).__name__} does not expose its tokenizer and vocabulary, which "
                    "structured outputs compile against"
                )
            compiler = GrammarCompiler(tokenizer, vocab_size, adapter.eos_token_ids)
            _COMPILERS[adapter] = compiler
        return compiler


def close_compiler(adapter: Any, wait_s: float = 0.0) -> None:
    """Close the compiler of `adapter` (`GrammarCompiler.close`: wait for its compiles for at most
    `wait_s`), if one was made; a later `grammar_compiler(adapter)` makes a new one (another
    pipeline built on the same loaded model)."""
    with _COMPILERS_LOCK:
        compiler = _COMPILERS.pop(adapter, None)
    if compiler is not None:
        compiler.close(wait_s)


@atexit.register
def _close_at_exit() -> None:
    """Close the compilers nobody closed, their compiles waited for together: `EXIT_WAIT_S` in all."""
    with _COMPILERS_LOCK:
        compilers = list(_COMPILERS.values())
    deadline_s = time.monotonic() + EXIT_WAIT_S
    for compiler in compilers:
        compiler.close(max(0.0, deadline_s - time.monotonic()))


async def compile_for(
    adapter: Any,
    spec: StructuredOutputs | None,
    model_thread: _Runs | None = None,
    timeout_s: float = COMPILE_TIMEOUT_S,
) -> CompiledGrammar | None:
    """A request's constraint compiled for `adapter`'s vocabulary (None: it has none), within
    timeout_s of compiling (`GrammarCompiler.compile`). The first one reads the tokenizer's
    vocabulary on `model_thread`, where the prompts are tokenised (the model's tokenizer is shared;
    reads of a settled one are safe from any thread, but this one read costs a model step
    nothing); compiling needs only xgrammar's copy of the vocabulary, on the compiler's thread."""
    if spec is None:
        return None
    import_xgrammar()  # the install hint before anything else
    compiler = grammar_compiler(adapter)
    if not compiler.ready and model_thread is not None:
        await model_thread.run(compiler.prepare)
    return await compiler.compile(spec, timeout_s)


def _compile_key(spec: StructuredOutputs) -> StructuredOutputs:
    """The key the compiler remembers a spec under (too slow, or compiled): its grammar, which its
    compile depends on, not whether it waits for the reasoning's end (a chat request under a
    reasoning parser, and the same spec from the SDK, compile alike)."""
    return replace(spec, after_reasoning=False)


def _compiled_late(future: Future[CompiledGrammar]) -> bool:
    """Whether a compile left to its thread has since finished and compiled (xgrammar cached it)."""
    return future.done() and not future.cancelled() and future.exception() is None


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
