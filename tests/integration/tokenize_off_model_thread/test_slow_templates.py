"""Prompts are rendered (chat template, tokenisation) on prefill's tokenizer threads, off its model
thread: a trusted request's own chat template that renders for a long time holds only its own
request, and such templates render on threads of their own (`REQUEST_TEMPLATE_THREADS` at once),
never on all of the server's. When prompts rendered on the model thread, a slow template held
every prefill."""

from __future__ import annotations

import asyncio
import threading

from epd.model_runtime.sampling import GenerationConfig
from epd.prefill_svc.config import PrefillConfig
from epd.prefill_svc.engine import PrefillEngine
from epd.prefill_svc.kv_store import KvStore
from epd.prefill_svc.stage import LocalPrefillStage
from epd.stages.messages import ChatTemplateOptions, from_chat_template
from epd.stages.model_thread import ModelThread
from epd.stages.tokenize import TokenizeInput
from tests.integration.tokenize_off_model_thread.held_renders import (
    HANG_GUARD_S,
    SLOW_TEMPLATE,
    _conversation,
    _Entered,
    _slow_prefill,
    _slow_renders_held,
    _trusting_stage,
)


async def _served_meanwhile(stage: LocalPrefillStage, conversation: list[dict]):
    """A prefill and a /tokenize of `conversation` with the server's template, each within the hang guard."""
    fast = await asyncio.wait_for(
        stage.prefill(from_chat_template(conversation), None, GenerationConfig(max_new_tokens=1), "f"),
        HANG_GUARD_S,
    )
    counted = await asyncio.wait_for(
        stage.tokenize(
            TokenizeInput(messages=from_chat_template(conversation), add_special_tokens=False), "t"
        ),
        HANG_GUARD_S,
    )
    return fast, counted


def test_a_slow_chat_template_holds_no_other_requests_prefill(adapter, processor):
    """A trusted request's own chat template that renders for a long time (here: held inside its
    rendering until the test lets it go) does not delay another request: that one is rendered,
    prefilled and answered while the first is still rendering, on another thread than the model
    thread (when prompts rendered on the model thread, the second waited for the first's template;
    with one render thread, too). A /tokenize answers meanwhile. Then the slow one finishes, its
    prompt exactly the processor's rendering with that template."""
    model_thread = ModelThread()
    config = PrefillConfig(trust_request_chat_template=True)
    stage = LocalPrefillStage(PrefillEngine(config, adapter), KvStore(1 << 30, 600.0), model_thread)
    slow_conversation = _conversation("what colour is the circle?")
    fast_conversation = _conversation("a red circle moves left")
    expected_slow = processor.tokenizer(
        processor.apply_chat_template(
            slow_conversation, chat_template=SLOW_TEMPLATE, add_generation_prompt=True, tokenize=False
        ),
        add_special_tokens=False,
    )["input_ids"]
    expected_fast = processor.tokenizer(
        processor.apply_chat_template(fast_conversation, add_generation_prompt=True, tokenize=False),
        add_special_tokens=False,
    )["input_ids"]
    rendering, release = threading.Event(), threading.Event()

    async def scenario():
        slow = asyncio.ensure_future(
            stage.prefill(
                from_chat_template(slow_conversation),
                None,
                GenerationConfig(max_new_tokens=1),
                "slow",
                template=ChatTemplateOptions(chat_template=SLOW_TEMPLATE),
            )
        )
        try:
            assert await asyncio.to_thread(rendering.wait, HANG_GUARD_S)  # the slow one is rendering
            fast, counted = await _served_meanwhile(stage, fast_conversation)
            slow_was_rendering = not slow.done()
        finally:
            release.set()
        slow_handle = await asyncio.wait_for(slow, HANG_GUARD_S)
        for handle in (fast, slow_handle):
            await stage.release(handle, "done")
        await stage.close()
        return fast, counted, slow_was_rendering, slow_handle

    with _slow_renders_held(adapter, rendering, release, model_thread):
        fast, counted, slow_was_rendering, slow_handle = asyncio.run(scenario())
    assert slow_was_rendering  # the other request was answered while the slow template rendered
    assert fast.num_prompt_tokens == len(expected_fast) and counted.token_ids == expected_fast
    assert slow_handle.num_prompt_tokens == len(expected_slow)


def test_requests_own_templates_never_hold_every_render_thread(adapter, processor):
    """Trusted requests' own templates render on threads of their own, at most
    `REQUEST_TEMPLATE_THREADS` at once: with more slow ones than the server has tokenizer threads
    (here held inside their render until the test lets them go), a request with the server's
    template is prefilled and a /tokenize answered while they are held, and the one beyond the
    bound has not started. Before, they shared the four tokenizer threads: four slow ones held
    every request and /tokenize until one ended."""
    from epd.prefill_svc.stage import REQUEST_TEMPLATE_THREADS, TOKENIZER_THREADS

    model_thread = ModelThread()
    stage = _trusting_stage(adapter, model_thread)
    fast_conversation = _conversation("a red circle moves left")
    expected_fast = processor.tokenizer(
        processor.apply_chat_template(fast_conversation, add_generation_prompt=True, tokenize=False),
        add_special_tokens=False,
    )["input_ids"]
    entered, release = _Entered(), threading.Event()

    async def scenario():
        slow = [_slow_prefill(stage, f"slow{i}") for i in range(TOKENIZER_THREADS)]
        try:
            assert await asyncio.to_thread(entered.wait_for, REQUEST_TEMPLATE_THREADS)
            fast, counted = await _served_meanwhile(stage, fast_conversation)
            held = (entered.num_renders, sum(not s.done() for s in slow))
        finally:
            release.set()
        for handle in [fast, *await asyncio.wait_for(asyncio.gather(*slow), HANG_GUARD_S)]:
            await stage.release(handle, "done")
        await stage.close()
        return fast, counted, held

    with _slow_renders_held(adapter, entered, release, model_thread):
        fast, counted, held = asyncio.run(scenario())
    assert held == (REQUEST_TEMPLATE_THREADS, TOKENIZER_THREADS)  # the bound's renders held, the rest waiting
    assert fast.num_prompt_tokens == len(expected_fast) and counted.token_ids == expected_fast
