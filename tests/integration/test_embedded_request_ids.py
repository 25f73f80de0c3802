"""The embedded pipeline's requests (`epd ask`, the stages of `epd serve --colocate`) come through
no front door, yet each runs under a request id of its own, set as a front door sets it
(`epd.transport.tracing.adopt_request_id`): the stages' log lines about it end in `request_id=`
as a stack's services' do, and the summary names the same id."""

from __future__ import annotations

import asyncio

from epd.gateway.embedded import build_embedded_pipeline
from epd.model_runtime.config import ModelConfig
from epd.stages.request_id import current_request_id
from epd.transport import tracing
from tests.embedded import ask_summary
from tests.log_records import log_records

ENCODE_LINE = "decoding and encoding media"


def test_each_embedded_request_logs_under_an_id_of_its_own(tiny_models, media_files):
    async def two_questions():
        first = await ask_summary(pipeline, media_files["mp4"], "what moves?", 2, 2)
        second = await ask_summary(pipeline, media_files["mp4_b"], "what moves?", 2, 2)
        return first, second, current_request_id()

    with build_embedded_pipeline(ModelConfig(model=str(tiny_models["qwen2_vl"]))) as pipeline:
        with log_records("epd.encoder_svc.engine") as records:
            first, second, caller_id = asyncio.run(two_questions())
    encodes = [r for r in records if r.getMessage().startswith(ENCODE_LINE)]
    assert [r.request_id for r in encodes] == [first.request_id, second.request_id]  # type: ignore[attr-defined]
    assert first.request_id and first.request_id != second.request_id
    assert (
        tracing.valid_request_id(first.request_id) and len(first.request_id) == 32
    )  # a front door's uuid4 hex
    assert caller_id == ""  # set in the request's task: the caller's next request is not under it


def test_an_embedded_request_keeps_the_id_it_names(tiny_models, media_files):
    """An `AskRequest.request_id` (the SDK's, vLLM's body field) is the id its lines carry."""
    from dataclasses import replace

    from epd.gateway.ask_types import AskRequest
    from epd.model_runtime.sampling import GenerationConfig
    from epd.stages.contracts import MediaInput
    from epd.stages.messages import question_messages
    from epd.video.types import SamplingOptions
    from tests.embedded import request_summary

    request = AskRequest(
        messages=question_messages("what moves?"),
        media=MediaInput(media_files["png"].read_bytes()),
        sampling=SamplingOptions(num_frames=2),
        generation=GenerationConfig(max_new_tokens=2),
    )
    with build_embedded_pipeline(ModelConfig(model=str(tiny_models["qwen2_vl"]))) as pipeline:
        with log_records("epd.encoder_svc.engine") as records:
            summary = asyncio.run(request_summary(pipeline, replace(request, request_id="mine-1")))
    assert summary.request_id == "mine-1"
    assert [r.request_id for r in records if r.getMessage().startswith(ENCODE_LINE)] == ["mine-1"]  # type: ignore[attr-defined]
