"""The served model's vocabulary and length limits at the front door: the stack's gateway learns
them from prefill (`PrefillService.GetModelInfo`), the colocated one from its own prefill stage.
A token id outside the vocabulary is refused before the media costs a decode and an encode, and
`/v1/models` says `max_model_len` as vLLM's does."""

from __future__ import annotations

import asyncio
import base64
import json
import time
import urllib.error
import urllib.request

import grpc
import pytest

from epd.client import EpdClient, EpdError
from epd.gateway.config import GatewayConfig, HttpApiConfig
from epd.gateway.embedded import build_embedded_pipeline
from epd.gateway.http_api import start_http_api
from epd.gateway.metrics import GatewayMetrics, MeteredPipeline
from epd.gateway.pipeline import AskRequest
from epd.model_runtime.config import ModelConfig
from epd.model_runtime.sampling import MAX_NEW_TOKENS, GenerationConfig
from epd.prefill_svc.config import PrefillConfig
from epd.stages.contracts import MediaInput
from epd.stages.errors import InvalidRequest
from epd.stages.messages import question_messages
from epd.stages.server_config import ServerConfig
from epd.v1 import load_pb2, load_pb2_grpc
from epd.video.types import SamplingOptions
from tests.media import make_video


def _text_config(model_dir) -> dict:
    config = json.loads((model_dir / "config.json").read_text())
    return config.get("text_config", config)


def _get(port: int, path: str) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as reply:
        return json.loads(reply.read())


def _chat(port: int, video: bytes, **fields) -> tuple[int, dict]:
    url = "data:video/mp4;base64," + base64.b64encode(video).decode()
    body = {"model": "epd", "max_tokens": 2, "media": {"num_frames": 2}, **fields,
            "messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                                      {"type": "text", "text": "what happens?"}]}]}  # fmt: skip
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _encoder_steps(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        reply = load_pb2_grpc.LoadServiceStub(channel).GetLoad(load_pb2.GetLoadRequest(), timeout=10)
    return sum(core.num_steps for core in reply.cores)


def _model_card(port: int, timeout_s: float = 30.0) -> dict:
    """/v1/models' one model, once the gateway has prefill's answer (it reads it in the background
    once it serves; the stack counts as started when the gateway serves)."""
    deadline = time.monotonic() + timeout_s
    while True:
        card = _get(port, "/v1/models")["data"][0]
        if card["max_model_len"] is not None or time.monotonic() > deadline:
            return card
        time.sleep(0.1)


def test_the_stack_gateway_refuses_a_token_id_outside_the_vocabulary_before_the_encode(
    shared_stack, tiny_models, tmp_path
):
    """Prefill's check came only after the video's decode and encode (the gateway loads no model);
    now the gateway knows the vocabulary from prefill and the encoder does no step for such a
    request, on either API. A video no other test sends: an encode would be a step, not a hit."""
    text = _text_config(tiny_models["qwen2_vl"])
    vocab_size = text["vocab_size"]
    port = shared_stack.http_port
    card = _model_card(port)
    assert card["id"] == "epd"
    assert card["max_model_len"] == min(text["max_position_embeddings"], PrefillConfig().max_prompt_tokens + MAX_NEW_TOKENS)
    video = make_video(tmp_path / "unseen.mp4", size=(64, 48), seconds=1.0, pattern="noise").read_bytes()
    encoder = shared_stack.address("encoder")
    before = _encoder_steps(encoder)

    status, body = _chat(port, video, logit_bias={str(vocab_size): 5})
    assert status == 400, body
    assert f"logit_bias: token id {vocab_size} is outside 0 to {vocab_size - 1} (this model's vocabulary)" in body["error"]["message"]
    with EpdClient(shared_stack.gateway, timeout_s=120) as client:
        with pytest.raises(EpdError) as refused:
            client.ask(video, "what happens?", num_frames=2, max_new_tokens=2, stop_token_ids=[vocab_size + 7])
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert f"stop_token_ids: token id {vocab_size + 7}" in str(refused.value)
    assert _encoder_steps(encoder) == before  # neither request reached the encoder

    status, body = _chat(port, video, logit_bias={str(vocab_size - 1): 5})  # the last id is served
    assert status == 200, body
    assert _encoder_steps(encoder) > before  # and that one was encoded: the count above could move


def test_the_colocated_front_door_checks_the_vocabulary_and_reports_max_model_len(tiny_models, media_files):
    """`epd serve --colocate` serves its embedded pipeline wrapped for metrics (MeteredPipeline),
    which had lost the embedded pipeline's vocabulary: the early check ran only in `epd ask`. Its
    /v1/models says the longest prompt plus answer: here epd's own limits (a 1,000-token prompt
    limit plus max_tokens), shorter than the model's context."""
    model = ModelConfig(model=str(tiny_models["qwen2_vl"]))
    prefill = PrefillConfig(model=model, max_prompt_tokens=1000)
    vocab_size = _text_config(tiny_models["qwen2_vl"])["vocab_size"]
    video = media_files["mp4"].read_bytes()
    events: list = []

    async def scenario(pipeline: MeteredPipeline) -> dict:
        request = AskRequest(question_messages("what happens?"), MediaInput(video), SamplingOptions(num_frames=2),
                             GenerationConfig(max_new_tokens=2, logit_bias=((vocab_size, 1.0),)))
        with pytest.raises(InvalidRequest, match=f"logit_bias: token id {vocab_size}"):
            async for item in pipeline.ask(request):
                events.append(item)
        config = GatewayConfig(server=ServerConfig(port=0), http=HttpApiConfig(port=0))
        http = await start_http_api(config, pipeline, pipeline.metrics)
        try:
            return await asyncio.to_thread(_get, http.port, "/v1/models/epd")
        finally:
            await http.stop(0.5)

    with build_embedded_pipeline(model, prefill=prefill) as embedded:
        card = asyncio.run(scenario(MeteredPipeline(embedded, GatewayMetrics())))
    assert events == []  # no stage ran: nothing was decoded or encoded
    assert card["max_model_len"] == 1000 + MAX_NEW_TOKENS
