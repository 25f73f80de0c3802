"""A render for a request that is gone stops: a prefill or a /tokenize whose deadline passed while
it waited for a render thread is refused unrendered (DEADLINE_EXCEEDED), one cancelled while its
chat template renders stops at the render's next step, and every family's `build_prompt` checks
again after its media expansion, before the positions."""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest

from epd.model_runtime.adapter import RenderOptions
from epd.model_runtime.config import ModelConfig
from epd.model_runtime.hf_reference import question_message
from epd.model_runtime.loader import load_adapter
from epd.stages.model_thread import ModelThread
from tests.families import FAMILIES, load_video, visual_meta
from tests.integration.tokenize_off_model_thread.held_renders import (
    HANG_GUARD_S,
    _Entered,
    _slow_prefill,
    _slow_renders_held,
    _slow_tokenize,
    _trusting_stage,
)


def test_a_render_whose_deadline_passed_while_it_waited_is_refused_unrendered(adapter, caplog):
    """A prefill whose deadline (its gRPC call's) passes while it waits for a render thread (every
    one held here by a slow request template) is refused, DEADLINE_EXCEEDED, when a thread takes
    it, and its template never renders: before, it was rendered for nobody. The deadline is in the
    past when the threads are let go: nothing is timed. Its log line names the call's deadline,
    not the client's: in a prefill server it is often the gateway's bound on one attempt."""
    import logging
    import time

    import grpc

    from epd.prefill_svc.stage import REQUEST_TEMPLATE_THREADS
    from epd.stages.errors import DeadlineExceeded
    from epd.transport.errors import status_of

    model_thread = ModelThread()
    stage = _trusting_stage(adapter, model_thread)
    entered, release = _Entered(), threading.Event()

    async def scenario():
        held = [_slow_prefill(stage, f"held{i}") for i in range(REQUEST_TEMPLATE_THREADS)]
        try:
            assert await asyncio.to_thread(entered.wait_for, REQUEST_TEMPLATE_THREADS)
            deadline_s = time.monotonic() + 0.05
            late = _slow_prefill(stage, "late", deadline_s)
            while time.monotonic() <= deadline_s:  # past its deadline before a thread is free
                await asyncio.sleep(0.05)
        finally:
            release.set()
        with pytest.raises(
            DeadlineExceeded, match="reached its deadline before its prompt was rendered"
        ) as info:
            await asyncio.wait_for(late, HANG_GUARD_S)
        for handle in await asyncio.wait_for(asyncio.gather(*held), HANG_GUARD_S):
            await stage.release(handle, "done")
        await stage.close()
        return info.value

    with (
        _slow_renders_held(adapter, entered, release, model_thread),
        caplog.at_level(logging.INFO, logger="epd.prefill_svc.stage"),
    ):
        refused = asyncio.run(scenario())
    assert entered.num_renders == REQUEST_TEMPLATE_THREADS  # the late one's template never rendered
    assert status_of(refused)[0] == grpc.StatusCode.DEADLINE_EXCEEDED
    said = [r.getMessage() for r in caplog.records if "request late was refused" in r.getMessage()]
    assert said == ["the render of request late was refused unrendered: its call's deadline passed while it "
                    "waited for a thread"]  # fmt: skip


class _CountingTokenizer:
    """The adapter's tokenizer, counting the calls that tokenise a text containing `marker`."""

    def __init__(self, tokenizer, marker: str) -> None:
        self.tokenizer, self.marker, self.num_calls = tokenizer, marker, 0

    def __call__(self, text, *args, **kwargs):
        self.num_calls += isinstance(text, str) and self.marker in text
        return self.tokenizer(text, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


@pytest.mark.parametrize("call", ["prefill", "tokenize"])
def test_a_cancelled_render_stops_after_its_template(adapter, caplog, call):
    """A prefill or a /tokenize cancelled (its caller went away) while its chat template renders
    (held here) stops at the render's next step: its template's text is never tokenised nor given
    positions, and the stop is logged. The template's render itself runs to its end (Python cannot
    stop a thread). Before, the render ran to its end for nobody."""
    model_thread = ModelThread()
    stage = _trusting_stage(adapter, model_thread)
    entered, release = _Entered(), threading.Event()
    counting = _CountingTokenizer(adapter.tokenizer, "what colour is the circle?")

    async def scenario():
        slow = (_slow_prefill if call == "prefill" else _slow_tokenize)(stage, "gone")
        try:
            assert await asyncio.to_thread(entered.wait_for, 1)
            slow.cancel()
            with pytest.raises(asyncio.CancelledError):
                await slow
        finally:
            release.set()
        await asyncio.to_thread(stage.close_tokenizer)  # the render's thread has ended
        await stage.close()

    adapter.tokenizer = counting
    try:
        with _slow_renders_held(adapter, entered, release, model_thread):
            with caplog.at_level(logging.INFO, logger="epd.prefill_svc.stage"):
                asyncio.run(scenario())
    finally:
        adapter.tokenizer = counting.tokenizer
    assert counting.num_calls == 0
    assert any("render of request gone stopped between its steps" in r.getMessage() for r in caplog.records)


class _Gone(Exception):
    """What a render's checkpoint raises for a request that went away (the stage's own is private)."""


@pytest.mark.parametrize("media,num_frames", [("mp4", 8), ("png", 1)])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_familys_render_stops_after_its_media_expansion(
    checkpoints, media_files, family, media, num_frames
):
    """Every family's `build_prompt` of a media prompt calls the render's checkpoint twice: after
    the chat template (`_render`, shared) and again after its own expansion and tokenisation of the
    media placeholder, before the positions (get_rope_index on a long video's prompt); a checkpoint
    that raises the second time leaves `build_prompt` with its exception. A family that forgets its
    own call renders a gone request's positions to their end."""
    adapter = load_adapter(ModelConfig(model=str(checkpoints[family])), "all")
    video = load_video(media_files, media, num_frames)
    meta = visual_meta(adapter, adapter.preprocess(video))
    calls = 0

    def checkpoint() -> None:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise _Gone

    with pytest.raises(_Gone):
        adapter.build_prompt(
            question_message(video, "what moves?"), meta, RenderOptions(checkpoint=checkpoint)
        )
    assert calls == 2
    calls = -10  # never raises: a whole render calls it exactly twice
    adapter.build_prompt(question_message(video, "what moves?"), meta, RenderOptions(checkpoint=checkpoint))
    assert calls == -8


def test_a_tokenize_whose_deadline_passed_while_it_waited_is_refused_unrendered(adapter):
    """/tokenize gets its gRPC call's deadline and a prompt's checks (`LocalPrefillStage._render`):
    one whose deadline passes while every render thread is held is refused, DEADLINE_EXCEEDED,
    and its template never renders. Before, it had no deadline and was rendered for nobody. The
    deadline is in the past when the threads are let go: nothing is timed."""
    import time

    import grpc

    from epd.prefill_svc.stage import REQUEST_TEMPLATE_THREADS
    from epd.stages.errors import DeadlineExceeded
    from epd.transport.errors import status_of

    model_thread = ModelThread()
    stage = _trusting_stage(adapter, model_thread)
    entered, release = _Entered(), threading.Event()

    async def scenario():
        held = [_slow_tokenize(stage, f"held{i}") for i in range(REQUEST_TEMPLATE_THREADS)]
        try:
            assert await asyncio.to_thread(entered.wait_for, REQUEST_TEMPLATE_THREADS)
            deadline_s = time.monotonic() + 0.05
            late = _slow_tokenize(stage, "late", deadline_s)
            while time.monotonic() <= deadline_s:  # past its deadline before a thread is free
                await asyncio.sleep(0.05)
        finally:
            release.set()
        with pytest.raises(
            DeadlineExceeded, match="reached its deadline before its prompt was rendered"
        ) as info:
            await asyncio.wait_for(late, HANG_GUARD_S)
        answers = await asyncio.wait_for(asyncio.gather(*held), HANG_GUARD_S)
        await stage.close()
        return info.value, answers

    with _slow_renders_held(adapter, entered, release, model_thread):
        refused, answers = asyncio.run(scenario())
    assert entered.num_renders == REQUEST_TEMPLATE_THREADS  # the late one's template never rendered
    assert status_of(refused)[0] == grpc.StatusCode.DEADLINE_EXCEEDED
    assert all(a.token_ids for a in answers)
