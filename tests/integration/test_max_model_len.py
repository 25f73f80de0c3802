"""`--max-model-len` (vLLM's): the operator's cap on a request's prompt plus the tokens it may
generate, below the model's own context. Through real processes (`epd serve prefill
--max-model-len N` in a stack) and the embedded pipeline (`epd serve --colocate`): a request over
the cap is a 400 / INVALID_ARGUMENT naming both counts, one within it is answered with the tokens
`generate()` gives, one that leaves max_tokens unset gets the room the cap leaves after its prompt
(vLLM's default max_tokens), `/v1/models` reports the cap as `max_model_len`, and a cap above the
model's context is refused at start."""

from __future__ import annotations

import asyncio
import json
import re

import grpc
import pytest

from epd.client import EpdClient, EpdError
from epd.gateway.ask_types import AskRequest, AskSummary
from epd.gateway.config import GatewayConfig, HttpApiConfig
from epd.gateway.embedded import build_embedded_pipeline
from epd.gateway.http_server import start_http_api
from epd.gateway.metrics import GatewayMetrics, MeteredPipeline
from epd.model_runtime.config import ModelConfig
from epd.model_runtime.hf_reference import question_message, reference_inputs
from epd.model_runtime.loader import ModelLoadError
from epd.model_runtime.sampling import GenerationConfig
from epd.prefill_svc.config import PrefillConfig
from epd.stages.contracts import MediaInput
from epd.stages.errors import InvalidRequest, ResourceExhausted
from epd.stages.messages import question_messages
from epd.stages.raw_prompt import RawPrompt
from epd.stages.server_config import ServerConfig
from epd.video.types import SamplingOptions
from tests.embedded import request_summary
from tests.integration.gateway_http import _chat, _model_card
from tests.reference import decode_for_test, reference_tokens
from tests.stack import Stack, stage_replica

QUESTION = "what happens?"  # `_chat`'s question, after the video
NUM_FRAMES = 2
ROOM = 6
"""Tokens the cap leaves for the answer after this request's prompt."""


@pytest.fixture(scope="module")
def case(tiny_models, media_files) -> dict:
    """The tiny Qwen2-VL's context, this request's prompt, a cap leaving `ROOM` tokens after it,
    and generate()'s answer within that room."""
    from transformers import AutoProcessor

    model_dir = tiny_models["qwen2_vl"]
    video = decode_for_test(media_files["mp4"], NUM_FRAMES)
    processor = AutoProcessor.from_pretrained(str(model_dir))
    prompt = int(reference_inputs(processor, video, question_message(video, QUESTION))["input_ids"].shape[1])
    config = json.loads((model_dir / "config.json").read_text())
    context = config.get("text_config", config)["max_position_embeddings"]
    assert prompt + ROOM < context  # the cap lowers the model's context
    return {
        "model": model_dir,
        "video": media_files["mp4"].read_bytes(),
        "prompt": prompt,
        "context": context,
        "cap": prompt + ROOM,
        "tokens": reference_tokens(model_dir, video, QUESTION, ROOM),
    }


def _over_the_cap(case: dict) -> str:
    """Prefill's refusal of max_tokens ROOM + 1 under the cap: the context check's message, the cap
    as the context."""
    prompt, cap = case["prompt"], case["cap"]
    return (
        f"this model's context is {cap} tokens, but the request needs {cap + 1}: {prompt} in the prompt and up "
        f"to {ROOM + 1} to generate (max_tokens); send a shorter conversation or fewer frames, or ask for fewer "
        "tokens"
    )


def _no_room_for_a_prompt(case: dict) -> str:
    """The gateway's refusal, before the encode, of a max_tokens that fills the whole cap."""
    return (
        f"max_tokens is {case['cap']}, but this model's context is {case['cap']} tokens (max_model_len) and "
        "must hold the prompt too: ask for fewer tokens (the context less the prompt's), or leave max_tokens "
        "unset to get what the prompt leaves"
    )


def test_the_stack_serves_within_max_model_len_and_refuses_past_it(case, tmp_path):
    extra = {"prefill": ["--max-model-len", str(case["cap"])]}
    with Stack(case["model"], tmp_path / "logs", extra=extra, http=True) as stack:
        http_port = stack.http_port
        assert _model_card(http_port)["max_model_len"] == case["cap"]  # was the model's context
        status, body = _chat(http_port, case["video"], max_tokens=case["cap"])  # no room for any prompt
        assert status == 400 and _no_room_for_a_prompt(case) in body["error"]["message"], body

        status, body = _chat(http_port, case["video"], max_tokens=ROOM + 1)
        assert (status, body["error"]["type"]) == (400, "invalid_request_error"), body
        assert _over_the_cap(case) in body["error"]["message"]
        with EpdClient(stack.gateway, timeout_s=120) as client:
            with pytest.raises(EpdError) as refused:
                client.ask(case["video"], QUESTION, num_frames=NUM_FRAMES, max_new_tokens=ROOM + 1)
            assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert _over_the_cap(case) in str(refused.value)

            answered = client.ask(case["video"], QUESTION, num_frames=NUM_FRAMES, max_new_tokens=ROOM)
            unset = client.ask(case["video"], QUESTION, num_frames=NUM_FRAMES)  # max_new_tokens: the server's
        assert answered.token_ids == case["tokens"]  # the whole room, token for token generate()'s
        assert answered.num_prompt_tokens == case["prompt"]
        assert unset.token_ids == case["tokens"]  # the default fitted to the room (see below)
        status, body = _chat(http_port, case["video"], max_tokens=ROOM)
        assert status == 200, body
        assert (body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"]) == (
            case["prompt"],
            len(case["tokens"]),
        )
        _assert_the_default_fits_the_room(http_port, case)


def _assert_the_default_fits_the_room(http_port: int, case: dict) -> None:
    """max_tokens left unset: the default (32) does not fit after this prompt under the cap, and
    the request was refused as if the client had asked for 32. Prefill lowers it to the room the
    cap leaves, vLLM's default max_tokens (max_model_len minus the prompt), and answers."""
    status, body = _chat(http_port, case["video"], max_tokens=None, ignore_eos=True)
    assert status == 200, body
    assert (body["usage"]["completion_tokens"], body["choices"][0]["finish_reason"]) == (ROOM, "length")


def test_the_embedded_pipeline_serves_within_max_model_len_and_refuses_past_it(case):
    model = ModelConfig(model=str(case["model"]))

    def ask(pipeline, max_new_tokens: int, fit: bool = False, question: str = QUESTION) -> AskSummary:
        generation = GenerationConfig(max_new_tokens=max_new_tokens, fit_max_new_tokens=fit)
        request = AskRequest(
            question_messages(question),
            MediaInput(case["video"]),
            SamplingOptions(num_frames=NUM_FRAMES),
            generation,
        )

        async def run():
            return [item async for item in pipeline.ask(request)][-1]

        return asyncio.run(run())

    async def over_http(pipeline) -> tuple[dict, tuple[int, dict]]:
        config = GatewayConfig(server=ServerConfig(port=0), http=HttpApiConfig(port=0))
        metered = MeteredPipeline(pipeline, GatewayMetrics())
        http = await start_http_api(config, metered, metered.metrics)
        try:
            card = await asyncio.to_thread(_model_card, http.port)
            await asyncio.to_thread(_assert_the_default_fits_the_room, http.port, case)
            return card, await asyncio.to_thread(_chat, http.port, case["video"], max_tokens=ROOM + 1)
        finally:
            await http.stop(0.5)

    with build_embedded_pipeline(
        model, prefill=PrefillConfig(model=model, max_model_len=case["cap"])
    ) as pipeline:
        with pytest.raises(InvalidRequest) as refused:
            ask(pipeline, ROOM + 1)
        assert str(refused.value) == _over_the_cap(case)
        encodes = pipeline.encoder.core.num_steps
        with pytest.raises(InvalidRequest) as no_room:  # refused before the encode: prefill's words differ
            ask(pipeline, case["cap"])
        assert str(no_room.value) == _no_room_for_a_prompt(case)
        assert pipeline.encoder.core.num_steps == encodes
        answered = ask(pipeline, ROOM)
        assert answered.token_ids == case["tokens"] and answered.num_prompt_tokens == case["prompt"]
        assert ask(pipeline, ROOM + 1, fit=True).token_ids == case["tokens"]  # a ceiling, fitted to the room
        # A prompt longer than the cap is a prompt over the limit, the cap being the limit now.
        with pytest.raises(
            ResourceExhausted,
            match=rf"the prompt has \d+ tokens \(\d+ of them the media's\), over "
            rf"the limit of {case['cap']}; send a shorter conversation",
        ):
            ask(pipeline, 1, fit=True, question=QUESTION + " and then?" * 4 * ROOM)
        card, (status, body) = asyncio.run(over_http(pipeline))
    assert card["max_model_len"] == case["cap"]
    assert status == 400 and _over_the_cap(case) in body["error"]["message"], body


def test_an_unset_max_tokens_that_cannot_fit_is_refused_saying_what_would_help(case):
    """max_tokens left unset (fitted) but the room the cap leaves is under min_tokens, or is none
    (a prompt of exactly the cap's tokens, which the prompt limit lets in): a 400 that names the
    prompt and the room, and what the client can change; not "ask for fewer tokens", which it
    never asked for (the old message also named the default it never set)."""
    model = ModelConfig(model=str(case["model"]))
    prompt, cap = case["prompt"], case["cap"]

    def refusal(pipeline, min_tokens: int = 0) -> str:
        generation = GenerationConfig(max_new_tokens=32, min_tokens=min_tokens, fit_max_new_tokens=True)
        request = AskRequest(
            question_messages(QUESTION),
            MediaInput(case["video"]),
            SamplingOptions(num_frames=NUM_FRAMES),
            generation,
        )

        async def run():
            return [item async for item in pipeline.ask(request)]

        with pytest.raises(InvalidRequest) as refused:
            asyncio.run(run())
        return str(refused.value)

    with build_embedded_pipeline(model, prefill=PrefillConfig(model=model, max_model_len=cap)) as pipeline:
        assert refusal(pipeline, min_tokens=ROOM + 1) == (
            f"this model's context is {cap} tokens and the prompt has {prompt}, which leaves {ROOM} for the "
            f"answer, fewer than min_tokens ({ROOM + 1}): lower min_tokens, or send a shorter conversation or "
            "fewer frames"
        )
    with build_embedded_pipeline(model, prefill=PrefillConfig(model=model, max_model_len=prompt)) as pipeline:
        assert refusal(pipeline) == (
            f"this model's context is {prompt} tokens and the prompt has {prompt}, which "
            "leaves none for the answer: send a shorter conversation or fewer frames"
        )
        # A raw prompt has neither a conversation nor frames: the advice names the prompt.
        raw = RawPrompt(token_ids=[1] * prompt)
        for fit, says in (
            (True, f"the prompt has {prompt}, which leaves none for the answer: send a shorter prompt"),
            (False, "to generate (max_tokens); send a shorter prompt, or ask for fewer tokens"),
        ):
            request = AskRequest(
                [], generation=GenerationConfig(max_new_tokens=4, fit_max_new_tokens=fit), raw_prompt=raw
            )
            with pytest.raises(InvalidRequest, match=re.escape(says)):
                asyncio.run(request_summary(pipeline, request))


def test_a_max_model_len_above_the_models_context_is_refused_at_start(case, tmp_path):
    """As vLLM refuses it (positions past max_position_embeddings were never trained): the
    colocated pipeline raises the loader's error, and `epd serve prefill` exits 3 with one line
    saying what to pass."""
    model = ModelConfig(model=str(case["model"]))
    over = case["context"] + 1
    expected = (
        f"--max-model-len {over} is more than this model's context of {case['context']} tokens "
        "(config.json's max_position_embeddings); it may only lower it: pass at most "
        f"{case['context']}, or leave it out"
    )
    with pytest.raises(ModelLoadError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        build_embedded_pipeline(model, prefill=PrefillConfig(model=model, max_model_len=over))

    (tmp_path / "logs").mkdir()
    with stage_replica("prefill", case["model"], tmp_path / "logs", "--max-model-len", str(over)) as (
        _address,
        proc,
    ):
        assert proc.wait(timeout=120) == 3
    assert (
        f"epd: prefill cannot load {case['model']}: {expected}"
        in (tmp_path / "logs" / "prefill-2.log").read_text()
    )
