"""A request of n choices whose decoders lost the first prefill's cache (`KvSourceLost`) is
prefilled again once: when that second prefill fails, the choices waiting for it fail with its
error and none starts a third. Fake stages (no model, no gRPC), as tests/unit/gateway/
test_transfer_bytes.py; the lost replica through real processes is
tests/integration/test_kv_source_lost.py."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from epd.gateway.pipeline import AskRequest, Pipeline
from epd.model_runtime.sampling import GenerationConfig
from epd.stages.contracts import ChoiceStart, MediaInput
from epd.stages.errors import Unavailable
from epd.stages.messages import question_messages
from tests.unit.gateway.test_transfer_bytes import Decoder, Encoder, Prefill

NUM_CHOICES = 3


class FailsAgain(Prefill):
    """The first prefill answers n first tokens; every later one fails (the other replica is gone too)."""

    def __init__(self) -> None:
        super().__init__(0, "prefill-0:50052")

    async def prefill(self, messages, media, generation, request_id, pruning=None, cache_salt="", **kwargs):
        handle = await super().prefill(messages, media, generation, request_id, pruning, cache_salt)
        if self.num_calls > 1:
            raise Unavailable("no prefill replica answers")
        return replace(handle, other_choices=[ChoiceStart(7, "")] * (NUM_CHOICES - 1))


def test_a_failed_second_prefill_fails_the_waiting_choices_without_a_third():
    """Every choice's decoder finds the cache gone: the first to find it prefills again, the others
    wait for that prefill; it fails, and so does the request, with its error, after two prefills."""
    prefill = FailsAgain()
    pipeline = Pipeline(Encoder(0), prefill, Decoder(num_lost=NUM_CHOICES))
    request = AskRequest(
        question_messages("what colour?"), MediaInput(b"\0"), generation=GenerationConfig(n=NUM_CHOICES)
    )

    async def run() -> None:
        async for _ in pipeline.ask(request):
            pass

    with pytest.raises(Unavailable, match="no prefill replica answers"):
        asyncio.run(run())
    assert prefill.num_calls == 2
