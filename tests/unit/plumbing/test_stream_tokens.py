"""`stream_tokens` with the real tiny Qwen2-VL: every model call runs on the model thread, the
first step carries the transfer figures, and the request's cache is freed and no further step
runs however the stream ends (to the end, closed early, its reader cancelled, a step failing).
"""

from __future__ import annotations

import asyncio
import gc
import threading
import weakref
from contextlib import aclosing

import pytest
import torch

from epd.decode_svc.engine import DecodeEngine, Generation, stream_tokens
from epd.model_runtime.adapter import VisualMeta
from epd.model_runtime.config import ModelConfig
from epd.model_runtime.kv_cache import KvCache
from epd.model_runtime.loader import load_adapter
from epd.model_runtime.sampling import GenerationConfig
from epd.stages.contracts import PrefillHandle, TokenStep
from epd.stages.messages import question_messages, to_chat_template
from epd.stages.model_thread import ModelThread

HANG_GUARD_S = 30.0


@pytest.fixture(scope="module")
def adapter(tiny_models):
    return load_adapter(ModelConfig(model=str(tiny_models["qwen2_vl"])), "all")


class RecordingEngine(DecodeEngine):
    """The real engine; remembers each Generation it starts and a weak reference to its cache."""

    def __init__(self, adapter) -> None:
        super().__init__(adapter)
        self.generations: list[Generation] = []
        self.cache_refs: list[weakref.ref] = []

    def start(self, *args, **kwargs) -> Generation:
        gen = super().start(*args, **kwargs)
        self.generations.append(gen)
        self.cache_refs.append(weakref.ref(gen.cache))
        return gen


class Calls:
    """Counts the adapter's decode steps and the threads they ran on."""

    def __init__(self, adapter, monkeypatch, fail_at: int | None = None) -> None:
        self.threads: list[int] = []
        step = adapter.decode_step

        def decode_step(*args):
            self.threads.append(threading.get_ident())
            if fail_at is not None and len(self.threads) == fail_at:
                raise RuntimeError("step failed")
            return step(*args)

        monkeypatch.setattr(adapter, "decode_step", decode_step)


def _prefilled(adapter) -> tuple[KvCache, PrefillHandle, weakref.ref]:
    """A real prefill of a one-image prompt; returns only the cache (no other reference kept),
    its handle and a weak reference to it."""
    grid = (1, 4, 4)
    n = adapter.num_visual_tokens(grid)
    messages = to_chat_template(question_messages("what colour is the square?"), "image")
    prompt = adapter.build_prompt(messages, VisualMeta("image", grid, 0.0, n))
    state = adapter.prefill(prompt, torch.randn(n, adapter.hidden_size, generator=torch.Generator().manual_seed(0)))
    cache = state.cache
    handle = PrefillHandle(
        kv_handle="h",
        kv_address="",
        first_token_id=int(state.last_logits.argmax()),
        num_prompt_tokens=state.num_prompt_tokens,
        num_cached_tokens=cache.num_cached_tokens,
        next_position_ids=[int(x) for x in state.next_position_ids],
        kv_num_bytes=cache.num_bytes,
        prefill_ms=0.0,
    )
    return cache, handle, weakref.ref(cache)


def _stream(engine, thread, adapter, generation: GenerationConfig):
    cache, handle, cache_ref = _prefilled(adapter)
    num_bytes = cache.num_bytes
    tokens = stream_tokens(engine, thread, cache, handle, generation, 12.5)
    del cache  # as the callers do: the stream owns it now
    return tokens, cache_ref, num_bytes


def _assert_freed(engine: RecordingEngine, cache_ref: weakref.ref, finish_reason: str) -> None:
    (gen,) = engine.generations
    assert gen.cache is None and gen.finish_reason == finish_reason
    gc.collect()
    assert cache_ref() is None, "the transferred cache is no longer referenced"
    assert engine.cache_refs[0]() is None, "the decode cache is no longer referenced"


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, HANG_GUARD_S))


@pytest.fixture
def thread():
    model_thread = ModelThread()
    yield model_thread
    model_thread.close()


def test_to_the_end_every_step_on_the_model_thread_and_the_cache_freed(adapter, thread, monkeypatch):
    calls = Calls(adapter, monkeypatch)
    engine = RecordingEngine(adapter)
    tokens, cache_ref, num_bytes = _stream(engine, thread, adapter, GenerationConfig(max_new_tokens=5, ignore_eos=True))

    async def scenario():
        return [step async for step in tokens], await thread.run(threading.get_ident)

    steps, model_ident = _run(scenario())
    assert all(isinstance(s, TokenStep) and len(s.token_ids) == 1 for s in steps)
    assert [s.finish_reason for s in steps] == ["", "", "", "", "length"]
    assert (steps[0].kv_transfer_ms, steps[0].kv_num_bytes) == (12.5, num_bytes)
    assert [(s.kv_transfer_ms, s.kv_num_bytes) for s in steps[1:]] == [(0.0, 0)] * 4
    assert calls.threads == [model_ident] * 4, "the first token is prefill's; 4 steps, all on the model thread"
    _assert_freed(engine, cache_ref, "length")


@pytest.mark.parametrize("num_read", [1, 3])
def test_closing_early_runs_no_further_step_and_frees_the_cache(adapter, thread, monkeypatch, num_read):
    calls = Calls(adapter, monkeypatch)
    engine = RecordingEngine(adapter)
    tokens, cache_ref, _ = _stream(engine, thread, adapter, GenerationConfig(max_new_tokens=20, ignore_eos=True))

    async def scenario():
        read = []
        async with aclosing(tokens):
            async for step in tokens:
                read.append(step)
                if len(read) == num_read:
                    break
        await thread.run(lambda: None)  # anything still queued would have run by now
        return read

    read = _run(scenario())
    assert len(read) == num_read
    assert len(calls.threads) == num_read - 1
    _assert_freed(engine, cache_ref, "cancelled")


def test_cancelling_the_reader_drops_its_queued_step_and_frees_the_cache(adapter, thread, monkeypatch):
    """The reader's next step waits behind another request's model call; the reader's task is
    cancelled (its client went away): the step never runs and the cache goes at once."""
    calls = Calls(adapter, monkeypatch)
    engine = RecordingEngine(adapter)
    tokens, cache_ref, _ = _stream(engine, thread, adapter, GenerationConfig(max_new_tokens=20, ignore_eos=True))
    started, release = threading.Event(), threading.Event()

    def other_request():
        started.set()
        assert release.wait(HANG_GUARD_S)

    async def scenario():
        got_first, read_on = asyncio.Event(), asyncio.Event()

        async def reader():
            async for _ in tokens:
                got_first.set()
                await read_on.wait()

        task = asyncio.ensure_future(reader())
        await got_first.wait()
        other = asyncio.ensure_future(thread.run(other_request))
        assert await asyncio.to_thread(started.wait, HANG_GUARD_S)
        read_on.set()
        for _ in range(3):
            await asyncio.sleep(0)  # the reader queues its next step behind `other`
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        (gen,) = engine.generations
        assert gen.cache is None, "freed when the reader was cancelled, not when the thread got to it"
        release.set()
        await other
        await thread.run(lambda: None)

    _run(scenario())
    assert calls.threads == []
    _assert_freed(engine, cache_ref, "cancelled")


def test_a_failing_step_reaches_the_reader_and_frees_the_cache(adapter, thread, monkeypatch):
    Calls(adapter, monkeypatch, fail_at=2)
    engine = RecordingEngine(adapter)
    tokens, cache_ref, _ = _stream(engine, thread, adapter, GenerationConfig(max_new_tokens=20, ignore_eos=True))
    read: list[TokenStep] = []

    async def scenario():
        try:
            async for step in tokens:
                read.append(step)
        except RuntimeError as exc:
            # Only the message is kept: the error's traceback holds the failed call's frames.
            error = str(exc)
        # The model thread lets go of the failed call's work item once it takes the next one.
        await thread.run(lambda: None)
        return error

    assert _run(scenario()) == "step failed"
    assert len(read) == 2
    _assert_freed(engine, cache_ref, "cancelled")
