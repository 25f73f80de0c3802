"""A prefilled request whose decoders are all full (`Busy` before the first decode step) waits for
room instead of failing after its first token went out; a decoder's other errors, a busy error
after a step, and a wait past `decode_room_wait_s` are passed on as they are. Fake stages (no
model, no gRPC): the stages' side is tests/unit/plumbing/test_stage_retries.py and the whole path
tests/integration/test_decode_admission.py."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from epd.gateway.ask_types import AskRequest, AskSummary
from epd.gateway.pipeline import Pipeline
from epd.stages import contracts
from epd.stages.contracts import MediaInput, TokenStep
from epd.stages.errors import Busy, ResourceExhausted
from epd.stages.messages import question_messages
from tests.unit.gateway.fake_stages import Encoder, Prefill


class Decoder(contracts.DecodeStage):
    """Full for its first `num_full` calls; then the script's steps, raising `then` after them if set."""

    def __init__(self, num_full: int, then: Exception | None = None, error: Exception | None = None) -> None:
        self.num_full = num_full
        self.then = then
        self.error = error or Busy("the decoder's KV memory is full")
        self.num_calls = 0

    async def generate(self, handle, generation, request_id, pruning=None):
        self.num_calls += 1
        if self.num_full:
            self.num_full -= 1
            raise self.error
        yield TokenStep([7], "a", "", kv_transfer_ms=1.0, kv_num_bytes=64)
        if self.then is not None:
            raise self.then
        yield TokenStep([8], "b", "stop")


class Released(Prefill):
    """Its handle carries the first token's text: that token goes to the client before decode."""

    def __init__(self) -> None:
        super().__init__(0, "prefill-0:50052")
        self.num_released = 0

    async def prefill(
        self,
        messages,
        media,
        generation,
        request_id,
        pruning=None,
        cache_salt="",
        *,
        raw_prompt=None,
        template=None,
    ):
        handle = await super().prefill(messages, media, generation, request_id, pruning, cache_salt)
        return replace(handle, first_text="a")

    async def release(self, handle, request_id):
        self.num_released += 1


def _ask(decoder: Decoder, wait_s: float) -> tuple[list[object], Released]:
    prefill = Released()
    pipeline = Pipeline(Encoder(0), prefill, decoder, decode_room_wait_s=wait_s)
    events: list[object] = []

    async def run() -> None:
        async for item in pipeline.ask(AskRequest(question_messages("what colour?"), MediaInput(b"\0"))):
            events.append(item)

    try:
        asyncio.run(run())
    except Exception as exc:  # noqa: BLE001 - returned with what was streamed before it
        events.append(exc)
    return events, prefill


def test_a_request_waits_for_a_full_decoder_and_gets_all_its_tokens():
    decoder = Decoder(num_full=3)
    events, prefill = _ask(decoder, wait_s=30.0)
    summary = events[-1]
    assert isinstance(summary, AskSummary), summary
    assert summary.token_ids == [7, 8] and summary.answer == "ab"  # prefill's token once, then the decoder's
    assert decoder.num_calls == 4
    assert prefill.num_released == 0  # the decoder took the cache


def test_a_decoder_full_past_the_wait_is_its_busy_error_and_the_cache_is_released():
    decoder = Decoder(num_full=1000)
    events, prefill = _ask(decoder, wait_s=0.3)
    assert isinstance(events[-1], Busy)
    tokens = [e for e in events if isinstance(e, TokenStep)]
    assert [t.token_ids for t in tokens] == [[7]]  # the first token had gone out from prefill
    assert 2 <= decoder.num_calls < 20  # asked again with a growing delay, not in a tight loop
    assert prefill.num_released == 1


@pytest.mark.parametrize(
    "error", [ResourceExhausted("needs more KV memory than the decoder has"), RuntimeError("boom")]
)
def test_a_decoders_other_errors_are_not_waited_on(error):
    decoder = Decoder(num_full=1, error=error)
    events, _ = _ask(decoder, wait_s=30.0)
    assert events[-1] is error and decoder.num_calls == 1


def test_busy_after_a_decode_step_is_not_retried():
    """Once the decoder has sent a step it holds the request: asking again would repeat tokens."""
    decoder = Decoder(num_full=0, then=Busy("full"))
    events, _ = _ask(decoder, wait_s=30.0)
    assert isinstance(events[-1], Busy) and decoder.num_calls == 1
