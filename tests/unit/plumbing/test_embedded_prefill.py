"""The prefill stage in the embedded pipeline, with the real tiny model: the handle it returns
(the engine's, with where its cache waits), and the bounds it checks (max_tokens before the media
is encoded; a conversation's length by its tokens).
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from epd.gateway.ask_types import AskSummary
from epd.model_runtime.sampling import GenerationConfig
from epd.prefill_svc.kv_store import KvStore
from epd.stages.contracts import MediaInput
from epd.stages.errors import InvalidRequest
from epd.stages.messages import Message, question_messages
from epd.video.types import SamplingOptions
from tests.unit.plumbing.pipeline_asks import _ask


def test_the_prefill_stage_returns_the_engines_handle_with_where_its_cache_waits(embedded, videos):
    """The engine builds the PrefillHandle; the stage stores the cache and adds only its place."""
    store: KvStore = embedded.prefill.kv_store

    async def scenario():
        media = await embedded.encoder.encode(
            MediaInput(videos["mp4"]), SamplingOptions(num_frames=4), lambda e: None, "r"
        )
        handle = await embedded.prefill.prefill(
            question_messages("what colour is the square?"), media, GenerationConfig(max_new_tokens=4), "r"
        )
        return handle, store.take(handle.kv_handle)

    handle, cache = asyncio.run(scenario())
    assert handle.kv_handle and handle.kv_address == "", "in-process: taken from the store, not pulled"
    assert (handle.num_cached_tokens, handle.kv_num_bytes) == (cache.num_cached_tokens, cache.num_bytes)
    assert handle.visual_entry_mask is None, "sent only when decode-stage eviction is on"
    assert (len(store), store.num_bytes) == (0, 0)


def test_max_tokens_over_the_stages_bound_is_refused_before_the_media_is_encoded(embedded, videos):
    """It was refused by prefill, after the encoder had decoded and encoded the video (whose
    stage events came first)."""

    async def scenario():
        events = []
        with pytest.raises(InvalidRequest, match="max_new_tokens must be between 1 and 4096"):
            async for item in embedded.ask(_ask(videos, max_new_tokens=4097)):
                events.append(item)
        return events

    assert asyncio.run(scenario()) == []


def test_a_long_conversation_is_bounded_by_its_tokens_not_4096_characters(embedded, videos):
    """A follow-up was refused at its 29th turn (4,197 characters, 2,730 prompt tokens of 32,768)."""
    request = _ask(videos, max_new_tokens=2)
    history = [Message.system("Answer briefly. " * 300)]  # 4,800 characters
    request = dataclasses.replace(request, messages=history + request.messages)

    async def scenario():
        return [item async for item in embedded.ask(request) if isinstance(item, AskSummary)][0]

    summary = asyncio.run(scenario())
    assert summary.num_prompt_tokens > 1000 and len(summary.token_ids) == 2
