"""Bad input through the front door gets the right status and a message naming the problem;
the stack keeps serving the next good request."""

from __future__ import annotations

import asyncio
import json
import shutil

import grpc
import pytest

from epd.client import EpdClient, EpdError
from epd.gateway.ask_types import AskRequest, AskSummary
from epd.gateway.embedded import build_embedded_pipeline
from epd.model_runtime.config import ModelConfig
from epd.model_runtime.sampling import GenerationConfig
from epd.prefill_svc.config import PrefillConfig, PrefillSchedulerConfig
from epd.stages.contracts import MediaInput
from epd.stages.errors import InvalidRequest, ResourceExhausted
from epd.stages.messages import question_messages
from epd.video.types import SamplingOptions
from tests.stack import gateway_over

UPLOAD_LIMIT_BYTES = 200_000


@pytest.fixture(scope="module")
def stack(shared_stack, tmp_path_factory):
    """A gateway of its own (the upload limit is the gateway's) over the session's stages."""
    flags = ["--max-upload-bytes", str(UPLOAD_LIMIT_BYTES)]
    with gateway_over(shared_stack, tmp_path_factory.mktemp("logs_bad"), flags) as s:
        yield s


@pytest.fixture(scope="module")
def client(stack):
    with EpdClient(stack.gateway, timeout_s=120) as c:
        yield c


def _bad_files(media_files, tmp_path):
    good = media_files["mp4"].read_bytes()
    return {
        "zero": b"",
        "truncated": good[: len(good) // 3],
        "text": b"this is not a video, just text named clip.mp4\n" * 20,
    }


@pytest.mark.parametrize(
    "kind,code,match",
    [
        ("zero", grpc.StatusCode.INVALID_ARGUMENT, "empty"),
        ("truncated", grpc.StatusCode.INVALID_ARGUMENT, "corrupt, truncated"),
        ("text", grpc.StatusCode.INVALID_ARGUMENT, "corrupt, truncated"),
    ],
)
def test_bad_media(client, media_files, tmp_path, kind, code, match):
    data = _bad_files(media_files, tmp_path)[kind]
    with pytest.raises(EpdError, match=match) as info:
        client.ask(data, "what happens?", max_new_tokens=4)
    assert info.value.code == code
    assert "0x" not in info.value.message  # no decoder internals or addresses leak


def test_absurd_max_frames(client, media_files):
    with pytest.raises(EpdError, match="at most 256") as info:
        client.ask(media_files["mp4"], "what happens?", max_frames=1_000_000)
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_empty_question(client, media_files):
    with pytest.raises(EpdError, match="question is empty") as info:
        client.ask(media_files["mp4"], "   ")
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_upload_over_limit(client):
    with pytest.raises(EpdError, match=f"at most {UPLOAD_LIMIT_BYTES}") as info:
        client.ask(b"\0" * (UPLOAD_LIMIT_BYTES + 1), "what happens?")
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_bad_generation_params(client, media_files):
    with pytest.raises(EpdError, match="max_new_tokens must be between") as info:
        client.ask(media_files["mp4"], "what happens?", max_new_tokens=100_000)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_unknown_media_hash(client):
    with pytest.raises(EpdError, match="not cached") as info:
        client.ask(None, "what happens?", media_sha256="ab" * 32)
    assert info.value.code == grpc.StatusCode.NOT_FOUND


def test_stack_still_serves_after_errors(stack, client, media_files):
    # Runs after the failures above (file order): every process is alive and answers.
    result = client.ask(media_files["mp4"], "what happens?", num_frames=4, max_new_tokens=6)
    assert len(result.token_ids) >= 1
    assert result.num_frames == 4
    assert stack.alive()


def test_decode_refuses_unlisted_kv_source(stack):
    """A client must not make the decoder connect anywhere: kv_address outside --allow-kv-from."""
    from epd.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2

    with grpc.insecure_channel(stack.address("decode")) as channel:
        stub = decode_pb2_grpc.DecodeServiceStub(channel)
        req = decode_pb2.GenerateRequest(
            prefill=prefill_pb2.PrefillResult(
                kv_handle="x", kv_address="10.1.2.3:80", next_position_ids=[1, 1, 1, 1]
            )
        )
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(req, timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "allow-kv-from" in info.value.details()


def test_prompt_and_max_tokens_beyond_the_models_context_is_invalid_argument(
    tiny_models, media_files, tmp_path
):
    """The checkpoint's max_position_embeddings bounds prompt + generated tokens (vLLM's
    max_model_len): a request that would pass it is refused before its prefill, as vLLM's 400,
    naming both counts; one within it is answered. Here a copy of the tiny model whose config
    says 100 (its weights do not depend on it)."""
    short = shutil.copytree(tiny_models["qwen2_vl"], tmp_path / "short-context")
    config = json.loads((short / "config.json").read_text())
    config["text_config"]["max_position_embeddings"] = 100
    (short / "config.json").write_text(json.dumps(config))

    def ask(pipeline, max_new_tokens: int) -> AskSummary:
        request = AskRequest(
            question_messages("what happens?"),
            MediaInput(media_files["mp4"].read_bytes()),
            SamplingOptions(num_frames=2),
            GenerationConfig(max_new_tokens=max_new_tokens),
        )

        async def run():
            return [item async for item in pipeline.ask(request)][-1]

        return asyncio.run(run())

    with build_embedded_pipeline(ModelConfig(model=str(short))) as pipeline:
        answered = ask(pipeline, 4)
        assert isinstance(answered, AskSummary) and answered.token_ids
        prompt = answered.num_prompt_tokens
        over = 100 - prompt + 1  # one token past the context with this prompt (a max_tokens of 100 or more,
        # which no prompt fits beside, the gateway refuses before the encode: test_max_model_len)
        assert prompt + 4 <= 100 < prompt + over and over < 100
        with pytest.raises(InvalidRequest) as refused:
            ask(pipeline, over)
        assert str(refused.value) == (
            f"this model's context is 100 tokens, but the request needs 101: {prompt} in the prompt "
            f"and up to {over} to generate (max_tokens); send a shorter conversation or fewer frames, or ask for "
            "fewer tokens"
        )
        assert ask(pipeline, 4).token_ids == answered.token_ids  # and it keeps serving


def test_a_prompt_over_the_limit_is_told_what_made_it_long(tiny_models, media_files):
    """RESOURCE_EXHAUSTED over --max-prompt-tokens: fewer frames when the media's tokens fill the
    prompt, a shorter conversation when its text does (it used to say fewer frames either way)."""
    model = ModelConfig(model=str(tiny_models["qwen2_vl"]))
    prefill = PrefillConfig(
        model=model, max_prompt_tokens=60, scheduler=PrefillSchedulerConfig(max_waiting_prompt_tokens=60)
    )

    def refusal(question: str, num_frames: int) -> str:
        request = AskRequest(
            question_messages(question),
            MediaInput(media_files["mp4"].read_bytes()),
            SamplingOptions(num_frames=num_frames),
            GenerationConfig(max_new_tokens=2),
        )

        async def run():
            return [item async for item in pipeline.ask(request)]

        with pytest.raises(ResourceExhausted) as refused:
            asyncio.run(run())
        return str(refused.value)

    with build_embedded_pipeline(model, prefill=prefill) as pipeline:
        assert refusal("what happens? " * 40, 2).endswith("over the limit of 60; send a shorter conversation")
        assert refusal("what happens?", 8).endswith(
            "over the limit of 60; lower max_frames, fps or max_pixels"
        )


def test_the_embedded_door_refuses_a_token_id_outside_the_vocabulary_before_the_encode(
    tiny_models, media_files
):
    """The embedded pipeline (`epd serve --colocate`, `epd ask`) holds the model, so it checks
    logit_bias and stop_token_ids ids against the vocabulary with the other fields: prefill's
    check came after a whole decode and encode of the media. (The stack's gateway learns the
    vocabulary from prefill: tests/integration/test_model_info.py.)"""
    model = ModelConfig(model=str(tiny_models["qwen2_vl"]))
    events: list = []

    async def run(generation: GenerationConfig):
        request = AskRequest(
            question_messages("what happens?"),
            MediaInput(media_files["mp4"].read_bytes()),
            SamplingOptions(num_frames=2),
            generation,
        )
        async for item in pipeline.ask(request):
            events.append(item)

    with build_embedded_pipeline(model) as pipeline:
        vocab_size = pipeline.prefill.engine.adapter.vocab_size
        for generation, field in (
            (GenerationConfig(max_new_tokens=2, stop_token_ids=(vocab_size,)), "stop_token_ids"),
            (GenerationConfig(max_new_tokens=2, logit_bias=((vocab_size, 1.0),)), "logit_bias"),
        ):
            with pytest.raises(InvalidRequest, match=f"{field}: token id {vocab_size}"):
                asyncio.run(run(generation))
        assert events == []  # no stage ran: nothing was decoded or encoded
        asyncio.run(run(GenerationConfig(max_new_tokens=2, stop_token_ids=(vocab_size - 1,))))
        assert isinstance(events[-1], AskSummary)  # and an id inside it is served
