"""Closing prefill's tokenizer threads (`close_tokenizer`, at `epd serve prefill`'s and the embedded
pipeline's shutdown) waits for a render that does not end only up to its bound, and an embedded
pipeline's close waits for all its parts within one bound; what is left running is named in a
warning."""

from __future__ import annotations

import asyncio
import logging
import threading

from epd.model_runtime.config import ModelConfig
from epd.prefill_svc.config import PrefillConfig
from epd.prefill_svc.engine import PrefillEngine
from epd.prefill_svc.kv_store import KvStore
from epd.prefill_svc.stage import REQUEST_TEMPLATE_THREAD_NAME, TOKENIZER_THREAD_NAME, LocalPrefillStage
from epd.stages.messages import ChatTemplateOptions, from_chat_template
from epd.stages.model_thread import ModelThread
from epd.stages.tokenize import TokenizeInput
from tests.integration.tokenize_off_model_thread.held_renders import (
    HANG_GUARD_S,
    SLOW_TEMPLATE,
    _conversation,
    _slow_renders_held,
)


def test_closing_the_tokenizer_threads_waits_for_a_held_render_only_up_to_the_bound(
    adapter, monkeypatch, caplog
):
    """A render that does not end (a trusted request's own chat template that loops; here held
    until the test lets it go) does not hold the close: `close_tokenizer`, as `epd serve prefill`
    and the embedded pipeline call it at shutdown, waits up to `CLOSE_WAIT_S` (made short here)
    and names the thread it leaves in a WARNING. Before, prefill's server waited for it without a
    bound and the embedded pipeline did not wait at all. The render is still held when the close
    returns: no time is measured."""
    from epd.prefill_svc import stage as stage_module

    monkeypatch.setattr(stage_module, "CLOSE_WAIT_S", 0.2, raising=False)
    model_thread = ModelThread()
    config = PrefillConfig(trust_request_chat_template=True)
    stage = LocalPrefillStage(PrefillEngine(config, adapter), KvStore(1 << 30, 600.0), model_thread)
    rendering, release = threading.Event(), threading.Event()

    async def scenario() -> bool:
        held = asyncio.ensure_future(
            stage.tokenize(
                TokenizeInput(
                    messages=from_chat_template(_conversation("what colour is the circle?")),
                    template=ChatTemplateOptions(chat_template=SLOW_TEMPLATE),
                ),
                "held",
            )
        )
        try:
            assert await asyncio.to_thread(rendering.wait, HANG_GUARD_S)
            with caplog.at_level(logging.WARNING, logger=stage_module.__name__):
                await asyncio.wait_for(asyncio.to_thread(stage.close_tokenizer), HANG_GUARD_S)
            return not held.done()
        finally:
            release.set()
            await asyncio.wait_for(held, HANG_GUARD_S)
            await stage.close()

    with _slow_renders_held(adapter, rendering, release, model_thread):
        still_rendering = asyncio.run(scenario())
    assert still_rendering  # the close returned while the render was held
    left = [
        r for r in caplog.records if r.levelno == logging.WARNING and "still render after close" in r.message
    ]
    assert len(left) == 1 and REQUEST_TEMPLATE_THREAD_NAME in left[0].message  # the request's template's


def test_closing_an_embedded_pipeline_waits_for_all_its_parts_within_one_bound(tiny_models, caplog):
    """An embedded pipeline's close waits for its parts in turn against one deadline, its
    `close_timeout_s` (`--close-timeout-s`; made short here): with a render held in a tokenizer thread (a looping trusted
    chat template) and a call held on the model thread, the model threads' close gets what the
    tokenizer threads' wait left of it, nothing, where each part had its own bound one after
    another (the encoder's 5 s, the tokenizer's 30 s, the model's 30 s: 65 s at worst). The close
    returns with both still held, and names both in warnings. The waits each part was given are
    recorded, not timed."""
    from epd.gateway.embedded import build_embedded_pipeline

    pipeline = build_embedded_pipeline(ModelConfig(model=str(tiny_models["qwen2_vl"])), close_timeout_s=0.2)
    started = threading.Semaphore(0)
    release = threading.Event()

    def held() -> None:
        started.release()
        release.wait(3 * HANG_GUARD_S)  # past the test's own waits: the test ends it

    given: dict[str, tuple] = {}

    def recorded(name: str, close):
        def close_and_record(*args):
            given[name] = args
            return close(*args)

        return close_and_record

    try:
        pipeline.prefill._tokenizer_pool.submit(held)  # what a looping chat template does to its thread
        threading.Thread(target=pipeline.model_thread.call, args=(held,), daemon=True).start()
        assert started.acquire(timeout=HANG_GUARD_S) and started.acquire(timeout=HANG_GUARD_S)
        pipeline.prefill.close_tokenizer = recorded("tokenizer", pipeline.prefill.close_tokenizer)
        pipeline.model_thread.close = recorded("model", pipeline.model_thread.close)
        with caplog.at_level(logging.WARNING):
            pipeline.close()
        still_held = not release.is_set()
    finally:
        release.set()
    assert still_held
    assert 0 < given["tokenizer"][0] <= 0.2
    assert given["model"] == (0.0,)  # the held render took all of the one bound
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(TOKENIZER_THREAD_NAME in w and "still render after close" in w for w in warned), warned
    assert any("model_0" in w and "still run a call after close" in w for w in warned), warned
