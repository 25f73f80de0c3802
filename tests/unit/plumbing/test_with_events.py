"""`with_events`: what a call reports reaches the consumer while the call runs, the result comes
last as `Finished`, and a failing call's error propagates after the events it reported first.

Every scenario runs under a hang guard so a broken build fails instead of hanging; nothing
asserts on time.
"""

from __future__ import annotations

import asyncio

import pytest

from epd.stages.errors import InvalidRequest, ResourceExhausted
from epd.stages.events import Finished, with_events

HANG_GUARD_S = 30.0


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, HANG_GUARD_S))


def test_events_reach_the_consumer_while_the_call_runs_then_the_result():
    """The call waits for the consumer to have seen each event before reporting the next: this
    only finishes if events are delivered as they are reported, not batched at the end."""
    log: list[str] = []

    async def scenario():
        seen = {name: asyncio.Event() for name in ("a", "b")}

        async def call(emit):
            for name in ("a", "b"):
                log.append(f"emit {name}")
                emit(name)
                await seen[name].wait()
            log.append("return")
            return {"answer": 42}

        items = []
        async for item in with_events(call):
            items.append(item)
            if isinstance(item, str):
                log.append(f"got {item}")
                seen[item].set()
        return items

    items = _run(scenario())
    assert items[:2] == ["a", "b"]
    assert len(items) == 3 and isinstance(items[2], Finished) and items[2].value == {"answer": 42}
    assert log == ["emit a", "got a", "emit b", "got b", "return"]


def test_a_call_that_reports_nothing_yields_only_its_result():
    async def call(emit):
        return None

    async def scenario():
        return [item async for item in with_events(call)]

    items = _run(scenario())
    assert len(items) == 1 and isinstance(items[0], Finished) and items[0].value is None


async def _fails_at_once(emit):
    """Reports and fails before the consumer has read anything: the events wait in the queue."""
    emit(1)
    emit(2)
    raise ResourceExhausted("too many frames; lower --max-frames")


async def _fails_after_awaiting(emit):
    emit(1)
    await asyncio.sleep(0)
    emit(2)
    await asyncio.sleep(0)
    raise ResourceExhausted("too many frames; lower --max-frames")


@pytest.mark.parametrize("call", [_fails_at_once, _fails_after_awaiting])
def test_events_before_a_failure_are_delivered_then_the_error_propagates(call):
    items: list[object] = []

    async def scenario():
        async for item in with_events(call):
            items.append(item)

    with pytest.raises(ResourceExhausted, match="lower --max-frames"):
        _run(scenario())
    assert items == [1, 2], "no Finished after a failure, and no event lost before it"


def test_a_failure_before_any_event_propagates_and_the_next_stream_works():
    async def failing(emit):
        raise InvalidRequest("the question is empty")

    async def ok(emit):
        emit("x")
        return "fine"

    async def scenario():
        with pytest.raises(InvalidRequest, match="the question is empty"):
            async for _ in with_events(failing):
                pytest.fail("a failing call that reported nothing yields nothing")
        return [item async for item in with_events(ok)]

    items = _run(scenario())
    assert items[0] == "x" and items[1] == Finished("fine")


def test_the_consumer_raising_mid_stream_cancels_the_call():
    """A consumer that fails while handling an event leaves the stream; the call is cancelled
    (not left running) and the consumer's own error is the one that propagates."""
    cancelled: list[bool] = []

    async def call(emit):
        emit("first")
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def scenario():
        stream = with_events(call)
        try:
            async for _ in stream:
                raise KeyError("consumer bug")
        finally:
            await stream.aclose()

    with pytest.raises(KeyError, match="consumer bug"):
        _run(scenario())
    assert cancelled == [True]


async def _reporting_call(cancelled: asyncio.Event, emit) -> str:
    emit("first")
    try:
        await asyncio.Event().wait()  # works until it is cancelled
    except asyncio.CancelledError:
        cancelled.set()
        raise
    return "never"


@pytest.mark.parametrize("how", ["stream_closed", "consumer_cancelled", "consumer_task_ended"])
def test_with_events_cancels_its_call_however_the_consumer_leaves(how):
    async def scenario():
        cancelled, got_first = asyncio.Event(), asyncio.Event()
        stream = with_events(lambda emit: _reporting_call(cancelled, emit))
        kept: list[object] = [stream]  # an unclosed stream stays referenced: no GC rescue

        async def consume():
            async for item in stream:
                assert item == "first"
                got_first.set()
                if how == "consumer_task_ended":
                    return  # leaves without closing the stream
                if how == "stream_closed":
                    break
                # consumer_cancelled: read on; the next read waits inside the stream
            await stream.aclose()

        consumer = asyncio.ensure_future(consume())
        await got_first.wait()  # the consumer runs on until its next wait before we resume
        if how == "consumer_cancelled":
            consumer.cancel()
        await asyncio.gather(consumer, return_exceptions=True)
        await asyncio.wait_for(cancelled.wait(), HANG_GUARD_S)
        return kept

    asyncio.run(scenario())


def test_with_events_yields_the_result_and_raises_the_calls_error():
    async def ok(emit):
        emit(1)
        emit(2)
        return "done"

    async def failing(emit):
        emit(1)
        raise InvalidRequest("bad")

    async def collect(call):
        return [item async for item in with_events(call)]

    items = asyncio.run(collect(ok))
    assert items[:2] == [1, 2] and isinstance(items[2], Finished) and items[2].value == "done"
    with pytest.raises(InvalidRequest, match="bad"):
        asyncio.run(collect(failing))
