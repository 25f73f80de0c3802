"""The pipeline's part of vLLM's `return_token_ids` for the prompt: prefill sends the prompt's ids
when asked (`GenerationConfig.return_prompt_token_ids`), the pipeline emits them once before the
first token (`PromptTokenIds`, what a stream's first chunks carry) and keeps them in the summary;
a prefill again after a lost cache is not asked (the same prompt, the same ids); a prefill replica
that ignores the ask (older than the gateway) fails the request rather than answer without them.
Fake stages (no model, no gRPC), as tests/unit/gateway/test_prefill_again.py; the ids through real
processes are tests/integration/test_prompt_token_ids.py."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from epd.gateway.ask_types import AskRequest, AskSummary, PromptTokenIds
from epd.gateway.pipeline import Pipeline
from epd.model_runtime.sampling import GenerationConfig
from epd.stages.contracts import MediaInput, TokenStep
from epd.stages.messages import question_messages
from tests.unit.gateway.fake_stages import Decoder, Encoder, Prefill


class SendsTheIds(Prefill):
    """Answers the prompt's ids when asked, as prefill does (`answers`: False, a replica older
    than the ask, which ignores it); `asked`: each call's ask."""

    def __init__(self, answers: bool = True) -> None:
        super().__init__(0, "prefill-0:50052")
        self.answers = answers
        self.asked: list[bool] = []

    async def prefill(self, messages, media, generation, request_id, pruning=None, cache_salt="", **kwargs):
        handle = await super().prefill(messages, media, generation, request_id, pruning, cache_salt)
        self.asked.append(generation.return_prompt_token_ids)
        if not (generation.return_prompt_token_ids and self.answers):
            return handle
        return replace(handle, prompt_token_ids=[100 + i for i in range(handle.num_prompt_tokens)])


def _ask(prefill: Prefill, decoder: Decoder, asked: bool = True) -> list:
    pipeline = Pipeline(Encoder(0), prefill, decoder)
    request = AskRequest(
        question_messages("what colour?"),
        MediaInput(b"\0"),
        generation=GenerationConfig(return_prompt_token_ids=asked),
    )

    async def run() -> list:
        return [item async for item in pipeline.ask(request)]

    return asyncio.run(run())


def test_the_prompts_ids_come_once_before_the_first_token_and_in_the_summary():
    prefill = SendsTheIds()
    items = _ask(prefill, Decoder(num_lost=1))  # the first cache lost: prefilled again
    sent = [i for i in items if isinstance(i, PromptTokenIds)]
    summary = items[-1]
    assert isinstance(summary, AskSummary) and len(sent) == 1
    assert (
        sent[0].prompt_token_ids
        == summary.prompt_token_ids
        == [100 + i for i in range(summary.num_prompt_tokens)]
    )
    first_token = next(i for i, item in enumerate(items) if isinstance(item, TokenStep))
    assert items.index(sent[0]) < first_token
    assert prefill.asked == [True, False]  # the second prefill is not asked for the same ids


def test_not_asked_none_come():
    items = _ask(SendsTheIds(), Decoder(), asked=False)
    assert not [i for i in items if isinstance(i, PromptTokenIds)] and items[-1].prompt_token_ids is None


def test_a_prefill_that_ignores_the_ask_fails_the_request_saying_so():
    with pytest.raises(RuntimeError, match="prefill sent none: a prefill replica older than this gateway"):
        _ask(SendsTheIds(answers=False), Decoder())
