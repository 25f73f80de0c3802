"""Asking the embedded pipeline (the three stages in one process: `build_embedded_pipeline`, what
`epd serve --colocate` and `epd ask` without `--endpoint` run) from tests and checkout-only benches."""

from __future__ import annotations

import asyncio
from pathlib import Path

from epd.gateway.ask_types import AskRequest, AskSummary
from epd.gateway.pipeline import Pipeline
from epd.model_runtime.sampling import GenerationConfig
from epd.stages.contracts import MediaInput
from epd.stages.messages import question_messages
from epd.video.types import SamplingOptions


async def ask_tokens(
    pipeline: Pipeline, media: Path, question: str, num_frames: int, max_new_tokens: int, delay_s: float = 0.0
) -> list[int]:
    """One question about `media` (after `delay_s`): the answer's token ids."""
    return (await ask_summary(pipeline, media, question, num_frames, max_new_tokens, delay_s)).token_ids


async def ask_summary(
    pipeline: Pipeline, media: Path, question: str, num_frames: int, max_new_tokens: int, delay_s: float = 0.0
) -> AskSummary:
    """One question about `media` (after `delay_s`): the answer's summary (tokens, prompt and
    visual token counts)."""
    await asyncio.sleep(delay_s)
    request = AskRequest(
        messages=question_messages(question),
        media=MediaInput(media.read_bytes()),
        sampling=SamplingOptions(num_frames=num_frames),
        generation=GenerationConfig(max_new_tokens=max_new_tokens),
    )
    return await request_summary(pipeline, request)


async def request_summary(pipeline: Pipeline, request: AskRequest) -> AskSummary:
    """Any request's summary (a conversation, text alone, pruning...)."""
    async for item in pipeline.ask(request):
        if isinstance(item, AskSummary):
            return item
    raise RuntimeError("the pipeline ended without a summary")
