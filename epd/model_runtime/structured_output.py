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

xgrammar is an optional dependency (`pip install 'epd[structured]'`): a server without it refuses
a request that asks for structured outputs with INVALID_ARGUMENT saying what to install.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import json
import os
import re
import sys
import threading
import weakref
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from epd.model_runtime.sampling import InvalidConstraint, SamplingFailed, StructuredOutputs

if TYPE_CHECKING:
    import torch  # the front door checks specs without torch


class _Runs(Protocol):
    """Where prompts are tokenised (`epd.stages.model_thread.ModelThread`, a layer above this one)."""

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any: ...


INSTALL_HINT = "pip install 'epd[structured]' (xgrammar)"

GRAMMAR_CACHE_BYTES = 256 * 1024 * 1024
"""Bound of a compiler's cache of compiled grammars (xgrammar's, least recently used out first)."""

COMPILE_THREAD_NAME = "grammar_compile"
"""The thread that compiles constraints (py-spy and thread dumps show it)."""

MAX_ERROR_CHARS = 300
"""A compiler's message is cut to this many characters in the error sent to the client."""

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


def check_structured_outputs(spec: StructuredOutputs) -> None:
    """InvalidConstraint when the constraint does not parse (a schema, regex or grammar xgrammar
    cannot read), with xgrammar's reason; needs no vocabulary, so the front door checks before a
    video is encoded. Also InvalidConstraint when xgrammar is missing."""
    try:
        spec.validate()
    except ValueError as exc:
        raise InvalidConstraint(str(exc)) from None
    xgr = import_xgrammar()
    kind = spec.kind
    try:
        if kind in ("json_schema", "json_object"):
            xgr.Grammar.from_json_schema(_json_text(spec), any_whitespace=not spec.disable_any_whitespace)
        elif kind == "regex":
            xgr.Grammar.from_regex(spec.regex)
        elif kind == "grammar":
            xgr.Grammar.from_ebnf(spec.grammar)
        else:
            xgr.Grammar.from_ebnf(choice_grammar(spec.choice))
    except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError / ValueError for a bad spec
        raise InvalidConstraint(_invalid(kind, exc)) from None


def _invalid(kind: str, exc: BaseException) -> str:
    name = {"json_schema": "JSON schema", "json_object": "JSON object grammar"}.get(kind, kind)
    return f"the structured-output {name} does not compile: {compiler_message(exc)}"


class CompiledGrammar:
    """A constraint compiled against one vocabulary; immutable, shared by every request with the
    same spec (xgrammar's cache hands the same one back)."""

    def __init__(self, compiled: Any, vocab_size: int) -> None:
        self._compiled = compiled
        self.vocab_size = vocab_size

    def matcher(self) -> GrammarState:
        return GrammarState(self._compiled, self.vocab_size)


class GrammarState:
    """One request's place in its constraint (an xgrammar matcher) and its token bitmask."""

    def __init__(self, compiled: Any, vocab_size: int) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self._matcher = xgr.GrammarMatcher(compiled)
        self.vocab_size = vocab_size
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)  # [1, ceil(vocab / 32)] int32

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [vocab] float32 -> a copy with every token the constraint does not allow next at
        -inf (the input, maybe a row of decode's batch, is left as it is)."""
        import torch

        self._matcher.fill_next_token_bitmask(self._bitmask)
        if logits.device.type == "cpu" and sys.byteorder == "little":
            # Bit i of int32 word j is token 32 j + i: the words' bytes unpacked little-endian
            # first are the tokens in order. 7x faster than xgrammar's CPU kernel on a 152k
            # vocabulary (bench/bench_structured.py), the same result (tested).
            bits = np.unpackbits(
                self._bitmask.numpy().view(np.uint8), count=logits.shape[-1], bitorder="little"
            )
            return torch.where(torch.from_numpy(bits.view(np.bool_)), logits, float("-inf"))
        masked = logits.clone().unsqueeze(0)  # [1, vocab]
        self._xgr.apply_token_bitmask_inplace(
            masked, self._bitmask.to(masked.device), vocab_size=self.vocab_size
        )  # CUDA: xgrammar's kernel
        return masked[0]

    def accept(self, token_id: int, chosen_here: bool = True) -> None:
        """Advance by the token the sampler chose (`chosen_here`), or by one chosen elsewhere
        (decode's first token, prefill's choice): SamplingFailed when the constraint refuses it."""
        if self._matcher.accept_token(token_id):
            return
        if not chosen_here:
            raise InvalidConstraint(
                f"token {token_id} does not keep to the structured-output constraint: prefill and decode "
                "serve different models"
            )
        raise self.nothing_allowed()

    @staticmethod
    def nothing_allowed() -> SamplingFailed:
        """Every token the constraint allows was held back by another setting (min_tokens holds
        back the end-of-sequence token a complete answer needs)."""
        return SamplingFailed(
            "no token both keeps to the structured-output constraint and passes this request's other "
            "settings at this step; lower min_tokens (it holds back the end-of-sequence token that "
            "ends a complete answer) or drop the stop_token_ids the constraint needs"
        )

    @property
    def terminated(self) -> bool:
        """The constraint is complete and its end (the end-of-sequence token) was accepted."""
        return bool(self._matcher.is_terminated())


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
        self._lock = threading.Lock()
        self._thread = ThreadPoolExecutor(1, thread_name_prefix=COMPILE_THREAD_NAME)

    def compile_now(self, spec: StructuredOutputs) -> CompiledGrammar:
        """Compile here (on the calling thread); InvalidConstraint for a spec that does not compile."""
        check_structured_outputs(spec)
        compiler = self._xgrammar_compiler()
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
        return CompiledGrammar(compiled, self.vocab_size)

    async def compile(self, spec: StructuredOutputs) -> CompiledGrammar:
        """`compile_now` on the compiler's thread, in the caller's context (log records keep the
        request's id); cancelling the await drops a compile that has not started."""
        call = functools.partial(contextvars.copy_context().run, self.compile_now, spec)
        return await asyncio.wrap_future(self._thread.submit(call))

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
            return self._compiler

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)


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


async def compile_for(
    adapter: Any, spec: StructuredOutputs | None, model_thread: _Runs | None = None
) -> CompiledGrammar | None:
    """A request's constraint compiled for `adapter`'s vocabulary (None: it has none). The first
    one reads the tokenizer's vocabulary on `model_thread`, where the prompts are tokenised (the
    model's tokenizer is shared; reads of a settled one are safe from any thread, but this one
    read costs a model step nothing); compiling needs only xgrammar's copy of the vocabulary, on
    the compiler's thread."""
    if spec is None:
        return None
    import_xgrammar()  # the install hint before anything else
    compiler = grammar_compiler(adapter)
    if not compiler.ready and model_thread is not None:
        await model_thread.run(compiler.prepare)
    return await compiler.compile(spec)
