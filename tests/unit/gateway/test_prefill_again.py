"""A request of n choices whose decoders lost the first prefill's cache (`KvSourceLost`) is
prefilled again once: when that second prefill fails, the choices waiting for it fail with its
error and none starts a third; the second is not asked for the prompt's logprobs again. Fake
stages (no model, no gRPC: tests/unit/gateway/fake_stages.py); the lost replica through real
processes is tests/integration/test_kv_source_lost.py."""

from __future__ import annotations

import asyncio
import gc
import weakref
from dataclasses import replace

import pytest

from epd.gateway.ask_types import AskRequest
from epd.gateway.pipeline import Pipeline
from epd.model_runtime.logprobs import TokenLogprob
from epd.model_runtime.sampling import GenerationConfig
from epd.stages.contracts import ChoiceStart, MediaInput
from epd.stages.errors import Unavailable
from epd.stages.messages import question_messages
from tests.unit.gateway.fake_stages import Decoder, Encoder, Prefill

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


class _Logprobs(list):
    """A prompt's logprobs list that a weak reference can follow."""


class ScoresThePrompt(Prefill):
    """Each prefill answers the prompt's logprobs when asked, as prefill does, a fresh list each
    time (`made`); `asked`: each call's `prompt_logprobs`."""

    def __init__(self) -> None:
        super().__init__(0, "prefill-0:50052")
        self.made: list[weakref.ref] = []
        self.asked: list[int | None] = []

    async def prefill(self, messages, media, generation, request_id, pruning=None, cache_salt="", **kwargs):
        handle = await super().prefill(messages, media, generation, request_id, pruning, cache_salt)
        self.asked.append(generation.prompt_logprobs)
        if generation.prompt_logprobs is None:
            return handle
        logprobs = _Logprobs(TokenLogprob(7, "a", -1.0, rank=1) for _ in range(handle.num_prompt_tokens))
        self.made.append(weakref.ref(logprobs))
        return replace(handle, prompt_logprobs=logprobs)


def test_a_second_prefill_does_not_ask_for_the_prompts_logprobs_again():
    """The gateway holds one list of them a request (the bound MAX_PROMPT_LOGPROB_ENTRIES is
    about): a prefill again, after a lost cache, would score the same prompt, so it is not asked
    to (which would cost prefill every position's logits and its prefix cache, and the gateway the
    list's transfer and join); the first's answers, and the decoders run on the second's cache."""
    prefill = ScoresThePrompt()
    decoded_from: list[str] = []

    class Looks(Decoder):
        async def generate(self, handle, generation, request_id, pruning=None):
            decoded_from.append(handle.kv_handle)
            async for step in super().generate(handle, generation, request_id, pruning):
                yield step

    pipeline = Pipeline(Encoder(0), prefill, Looks(num_lost=1))
    request = AskRequest(
        question_messages("what colour?"), MediaInput(b"\0"), generation=GenerationConfig(prompt_logprobs=0)
    )

    async def run() -> list:
        return [item async for item in pipeline.ask(request)]

    items = asyncio.run(run())
    assert prefill.num_calls == 2 and prefill.asked == [0, None] and len(prefill.made) == 1
    assert decoded_from == [f"{1:032x}", f"{2:032x}"]  # the first's cache lost, the second's decoded
    assert items[-1].prompt_logprobs is not None and len(items[-1].prompt_logprobs) == 20
    gc.collect()
    assert items[-1].prompt_logprobs is prefill.made[0]()
