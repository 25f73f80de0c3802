"""/tokenize and /detokenize run on prefill's tokenizer threads, off its model thread: they answer
while a model call holds it. They used to run on it: each waited for the prefill step in progress,
and a flood of them took model time from prefill (docs/benchmarks.md, "/tokenize"). With the one
tokenizer the threads share, they answer with the tokenizer's ids while prompts are tokenised and
prefilled, even while a prompt is held inside its tokenisation."""

from __future__ import annotations

import asyncio
import threading

from epd.model_runtime.sampling import GenerationConfig
from epd.prefill_svc.config import PrefillConfig, PrefillSchedulerConfig
from epd.prefill_svc.engine import PrefillEngine
from epd.prefill_svc.kv_store import KvStore
from epd.prefill_svc.stage import LocalPrefillStage
from epd.stages.messages import from_chat_template
from epd.stages.model_thread import ModelThread
from epd.stages.raw_prompt import RawPrompt
from epd.stages.tokenize import TokenizeInput
from tests.integration.tokenize_off_model_thread.held_renders import (
    HANG_GUARD_S,
    _conversation,
)


def test_tokenize_answers_while_the_model_thread_is_busy(adapter):
    """A /tokenize and a /detokenize complete while a model call holds the model thread."""
    model_thread = ModelThread()
    stage = LocalPrefillStage(PrefillEngine(PrefillConfig(), adapter), KvStore(1 << 30, 600.0), model_thread)
    release = threading.Event()

    async def scenario() -> tuple[list[int], str, bool]:
        held = asyncio.ensure_future(model_thread.run(release.wait))
        try:
            request = TokenizeInput(
                messages=from_chat_template(_conversation("a red circle moves left")),
                add_special_tokens=False,
            )
            ids = (await asyncio.wait_for(stage.tokenize(request, "t"), HANG_GUARD_S)).token_ids
            text = await asyncio.wait_for(stage.detokenize(ids, "d"), HANG_GUARD_S)
            return ids, text, held.done()
        finally:
            release.set()
            await held
            await stage.close()

    try:
        ids, text, model_call_done = asyncio.run(scenario())
    finally:
        release.set()
        model_thread.close()
    assert not model_call_done  # both answered while the model thread was still held
    assert ids and "a red circle moves left" in text


class _HeldEncode:
    """transformers' Rust tokenizer (a fast tokenizer's `_tokenizer`) behind a stand-in that holds
    the first encode after it is installed (a prefill's prompt) at its start, until `release`:
    transformers has applied that call's truncation/padding settings, and its encode has not run.
    A change of settings by another thread now would reach that encode. Every other call and
    attribute goes to the tokenizer."""

    def __init__(self, backend) -> None:
        object.__setattr__(self, "_backend", backend)
        object.__setattr__(self, "entered", threading.Event())
        object.__setattr__(self, "release", threading.Event())

    def encode_batch(self, *args, **kwargs):
        if not self.entered.is_set():
            self.entered.set()
            self.release.wait(3 * HANG_GUARD_S)  # past the test's own waits: the test ends it
        return self._backend.encode_batch(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._backend, name)

    def __setattr__(self, name: str, value) -> None:
        setattr(self._backend, name, value)


def test_tokenize_runs_to_the_end_while_a_prompt_is_inside_its_tokenisation(adapter, processor):
    """The race a tokenizer shared by several threads could lose, made to happen: a prefill's
    prompt is held inside its tokenisation (`render`), between transformers applying the call's
    settings and the encode, while /tokenize and /detokenize calls run on the same tokenizer. They
    answer without waiting for it (no lock), with the tokenizer's ids; when the prompt's encode
    goes on, it is still exactly the tokenizer's (no /tokenize call changed the settings its encode
    runs with), and it prefills."""
    model_thread = ModelThread()
    stage = LocalPrefillStage(PrefillEngine(PrefillConfig(), adapter), KvStore(1 << 30, 600.0), model_thread)
    question = "a red circle moves left, " * 40
    conversation = _conversation(question)
    expected = processor.tokenizer(
        processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False),
        add_special_tokens=False,
    )["input_ids"]
    expected_raw = processor.tokenizer(question)["input_ids"]
    backend = adapter.tokenizer._tokenizer
    held = _HeldEncode(backend)

    async def scenario():
        prefill = asyncio.ensure_future(
            stage.prefill(from_chat_template(conversation), None, GenerationConfig(max_new_tokens=1), "p")
        )
        try:
            assert await asyncio.to_thread(held.entered.wait, HANG_GUARD_S)  # the prompt's encode is held
            answers = await asyncio.wait_for(
                asyncio.gather(
                    stage.tokenize(
                        TokenizeInput(messages=from_chat_template(conversation), add_special_tokens=False),
                        "t",
                    ),
                    stage.tokenize(TokenizeInput(prompt=question, return_token_strs=True), "s"),
                    stage.detokenize(expected, "d"),
                ),
                HANG_GUARD_S,
            )
            prompt_was_held = not prefill.done()
        finally:
            held.release.set()
        handle = await asyncio.wait_for(prefill, HANG_GUARD_S)
        await stage.release(handle, "done")
        await stage.close()
        return answers, prompt_was_held, handle

    adapter.tokenizer._tokenizer = held
    try:
        (chat, raw, text), prompt_was_held, handle = asyncio.run(scenario())
    finally:
        adapter.tokenizer._tokenizer = backend
        held.release.set()
        model_thread.close()
    assert prompt_was_held  # every /tokenize answered while the prompt's tokenisation was held
    assert chat.token_ids == expected
    assert raw.token_ids == expected_raw
    assert raw.token_strs == processor.tokenizer.convert_ids_to_tokens(expected_raw)
    assert text == processor.tokenizer.decode(expected)
    assert handle.num_prompt_tokens == len(expected)  # the held encode ran with the settings it asked for


def test_concurrent_tokenize_calls_during_prefill_give_the_prompts_ids(adapter, processor):
    """The race a shared tokenizer could lose: many /tokenize and /detokenize calls at once on the
    tokenizer threads while long chat and raw prompts are tokenised (`render`, on those threads
    too) and prefilled, all with the one tokenizer. Every answer and every prompt's length is exactly
    what the tokenizer gives alone, and no call fails (a call that changed the tokenizer's settings
    while the other thread encodes would alter that one's ids, or fail itself: "Already borrowed")."""
    model_thread = ModelThread()
    config = PrefillConfig(scheduler=PrefillSchedulerConfig(max_waiting_prefills=1024))  # all queue at once
    stage = LocalPrefillStage(PrefillEngine(config, adapter), KvStore(1 << 30, 600.0), model_thread)
    # Long prompts (the threads' encodes overlap) and many short ones (prompts are tokenised
    # often, with /tokenize's calls in between).
    lengths_words = [150 * (i + 1) for i in range(8)] + [10 + i % 20 for i in range(56)]
    questions = [
        f"question {i}: " + " ".join(f"word{j}" for j in range(n)) for i, n in enumerate(lengths_words)
    ]
    expected = [
        processor.tokenizer(
            processor.apply_chat_template(_conversation(q), add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        )["input_ids"]
        for q in questions
    ]
    expected_raw = [processor.tokenizer(q)["input_ids"] for q in questions]  # special tokens added

    async def scenario():
        prefills = [
            call
            for i, q in enumerate(questions)
            for call in (
                stage.prefill(
                    from_chat_template(_conversation(q)), None, GenerationConfig(max_new_tokens=1), f"p{i}"
                ),
                stage.prefill([], None, GenerationConfig(max_new_tokens=1), f"r{i}", raw_prompt=RawPrompt(q)),
            )
        ]
        tokenizes = [
            stage.tokenize(
                TokenizeInput(messages=from_chat_template(_conversation(q)), add_special_tokens=False),
                f"t{i}",
            )
            for _ in range(2)
            for i, q in enumerate(questions)
        ]
        raw_tokenizes = [
            stage.tokenize(TokenizeInput(prompt=q, return_token_strs=True), f"s{i}")
            for i, q in enumerate(questions)
        ]
        detokenizes = [stage.detokenize(ids, f"d{i}") for i, ids in enumerate(expected)]
        try:
            results = await asyncio.wait_for(
                asyncio.gather(*prefills, *tokenizes, *raw_tokenizes, *detokenizes), HANG_GUARD_S * 5
            )
            n, m, r = len(prefills), len(tokenizes), len(raw_tokenizes)
            handles = results[:n]
            for handle in handles:
                await stage.release(handle, "done")
            return handles, results[n : n + m], results[n + m : n + m + r], results[n + m + r :]
        finally:
            await stage.close()  # the core's loop runs on this event loop

    try:
        handles, ids, raw_ids, texts = asyncio.run(scenario())
    finally:
        model_thread.close()
    lengths = [n for e, r in zip(expected, expected_raw) for n in (len(e), len(r))]
    assert [h.num_prompt_tokens for h in handles] == lengths  # the model thread's prompts
    assert [out.token_ids for out in ids] == expected * 2
    assert [out.token_ids for out in raw_ids] == expected_raw
    assert [out.token_strs for out in raw_ids] == [
        processor.tokenizer.convert_ids_to_tokens(e) for e in expected_raw
    ]
    assert texts == [processor.tokenizer.decode(e) for e in expected]
