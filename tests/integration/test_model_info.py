"""The served model's vocabulary and length limits at the front door: the stack's gateway learns
them from prefill (`PrefillService.GetModelInfo`), the colocated one from its own prefill stage.
A token id outside the vocabulary is refused before the media costs a decode and an encode,
So is a `max_tokens` over prefill's configured limit. `/v1/models` says `max_model_len` as vLLM's
does, and /tokenize and /detokenize answer with prefill's tokenizer."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from epd.client import EpdClient, EpdError
from epd.gateway.ask_types import AskRequest
from epd.gateway.config import GatewayConfig, HttpApiConfig
from epd.gateway.embedded import build_embedded_pipeline
from epd.gateway.http_server import start_http_api
from epd.gateway.metrics import GatewayMetrics, MeteredPipeline
from epd.model_runtime.config import ModelConfig
from epd.model_runtime.sampling import MAX_NEW_TOKENS, GenerationConfig
from epd.prefill_svc.config import PrefillConfig
from epd.stages.contracts import MediaInput
from epd.stages.errors import InvalidRequest
from epd.stages.messages import from_chat_template, question_messages, to_chat_template
from epd.stages.server_config import ServerConfig
from epd.v1 import load_pb2, load_pb2_grpc
from epd.video.types import SamplingOptions
from tests.integration.gateway_http import _chat, _get, _model_card
from tests.local_http import post_json
from tests.media import make_video
from tests.stack import Stack


def _text_config(model_dir) -> dict:
    config = json.loads((model_dir / "config.json").read_text())
    return config.get("text_config", config)


def _encoder_steps(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        reply = load_pb2_grpc.LoadServiceStub(channel).GetLoad(load_pb2.GetLoadRequest(), timeout=10)
    return sum(core.num_steps for core in reply.cores)


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
    assert card["max_model_len"] == min(
        text["max_position_embeddings"], PrefillConfig().max_prompt_tokens + MAX_NEW_TOKENS
    )
    video = make_video(tmp_path / "unseen.mp4", size=(64, 48), seconds=1.0, pattern="noise").read_bytes()
    encoder = shared_stack.address("encoder")
    before = _encoder_steps(encoder)

    status, body = _chat(port, video, logit_bias={str(vocab_size): 5})
    assert status == 400, body
    assert (
        f"logit_bias: token id {vocab_size} is outside 0 to {vocab_size - 1} (this model's vocabulary)"
        in body["error"]["message"]
    )
    with EpdClient(shared_stack.gateway, timeout_s=120) as client:
        with pytest.raises(EpdError) as refused:
            client.ask(
                video, "what happens?", num_frames=2, max_new_tokens=2, stop_token_ids=[vocab_size + 7]
            )
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
    limit plus max_tokens), shorter than the model's context; its /tokenize answers from its own
    prefill stage."""
    model = ModelConfig(model=str(tiny_models["qwen2_vl"]))
    prefill = PrefillConfig(model=model, max_prompt_tokens=1000)
    vocab_size = _text_config(tiny_models["qwen2_vl"])["vocab_size"]
    video = media_files["mp4"].read_bytes()
    events: list = []

    async def scenario(pipeline: MeteredPipeline) -> dict:
        request = AskRequest(
            question_messages("what happens?"),
            MediaInput(video),
            SamplingOptions(num_frames=2),
            GenerationConfig(max_new_tokens=2, logit_bias=((vocab_size, 1.0),)),
        )
        with pytest.raises(InvalidRequest, match=f"logit_bias: token id {vocab_size}"):
            async for item in pipeline.ask(request):
                events.append(item)
        config = GatewayConfig(server=ServerConfig(port=0), http=HttpApiConfig(port=0))
        http = await start_http_api(config, pipeline, pipeline.metrics)
        try:
            card = await asyncio.to_thread(_get, http.port, "/v1/models/epd")
            tokenized = await asyncio.to_thread(post_json, http.port, "/tokenize", {"messages": CONVERSATION})
            return card, tokenized
        finally:
            await http.stop(0.5)

    with build_embedded_pipeline(model, prefill=prefill) as embedded:
        card, (status, tokenized) = asyncio.run(scenario(MeteredPipeline(embedded, GatewayMetrics())))
        prompt = embedded.prefill.engine.adapter.build_prompt(
            to_chat_template(from_chat_template(CONVERSATION), ""), None
        )
    assert events == []  # no stage ran: nothing was decoded or encoded
    assert card["max_model_len"] == 1000 + MAX_NEW_TOKENS
    assert status == 200 and tokenized["max_model_len"] == card["max_model_len"], tokenized
    assert tokenized["tokens"] == prompt.input_ids[0].tolist()  # /tokenize there too: the prompt prefill runs


_OVER_THE_LIMIT = (
    "max_new_tokens must be between 1 and 16 (the OpenAI API's max_tokens or max_completion_tokens), got 17"
)
"""Prefill's refusal of max_tokens 17 with --max-new-tokens-limit 16 (`GenerationConfig.validate`)."""


def test_the_stack_gateway_refuses_max_tokens_over_prefills_limit_before_the_encode(tiny_models, tmp_path):
    """Prefill started with `--max-new-tokens-limit 16`: the gateway checked max_tokens against
    the stages' default (4,096) only, so a request asking 17 had its video decoded and encoded
    before prefill refused it. Now the gateway knows prefill's limit and refuses it first, on
    either API, with prefill's own message; a request within it is served (and encoded)."""
    extra = {"prefill": ["--max-new-tokens-limit", "16"]}
    video = make_video(tmp_path / "limit.mp4", size=(64, 48), seconds=1.0, pattern="noise").read_bytes()
    with Stack(tiny_models["qwen2_vl"], tmp_path / "logs", extra=extra, http=True) as stack:
        http_port = stack.http_port
        _model_card(http_port)  # the gateway has prefill's answer
        encoder = stack.address("encoder")
        before = _encoder_steps(encoder)

        status, body = _chat(http_port, video, max_tokens=17)
        assert (status, body["error"]["type"]) == (400, "invalid_request_error"), body
        assert _OVER_THE_LIMIT in body["error"]["message"]
        with EpdClient(stack.gateway, timeout_s=120) as client:
            with pytest.raises(EpdError) as refused:
                client.ask(video, "what happens?", num_frames=2, max_new_tokens=17)
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert _OVER_THE_LIMIT in str(refused.value)
        assert _encoder_steps(encoder) == before  # neither request reached the encoder

        status, body = _chat(http_port, video, max_tokens=16)
        assert status == 200, body
        assert _encoder_steps(encoder) > before  # and that one was encoded: the count above could move

        # A request that leaves max_tokens unset takes the gateway's default (32) fitted to the
        # limit, as vLLM fits its default to the model: served with 16 tokens, not refused.
        status, body = _chat(http_port, video, max_tokens=None, ignore_eos=True)
        assert status == 200 and body["usage"]["completion_tokens"] == 16, body
        with EpdClient(stack.gateway, timeout_s=120) as client:
            assert len(client.ask(video, "what happens?", num_frames=2, ignore_eos=True).token_ids) == 16


def test_the_colocated_front_door_refuses_max_tokens_over_its_prefills_limit_before_the_encode(
    tiny_models, media_files
):
    """The embedded pipeline reads its own prefill stage's limit: nothing is decoded or encoded
    for a request over it, and the message is prefill's."""
    model = ModelConfig(model=str(tiny_models["qwen2_vl"]))
    events: list = []

    async def scenario(pipeline: MeteredPipeline) -> None:
        request = AskRequest(
            question_messages("what happens?"),
            MediaInput(media_files["mp4"].read_bytes()),
            SamplingOptions(num_frames=2),
            GenerationConfig(max_new_tokens=17),
        )
        with pytest.raises(InvalidRequest) as refused:
            async for item in pipeline.ask(request):
                events.append(item)
        assert str(refused.value) == _OVER_THE_LIMIT

    with build_embedded_pipeline(
        model, prefill=PrefillConfig(model=model, max_new_tokens_limit=16)
    ) as embedded:
        asyncio.run(scenario(MeteredPipeline(embedded, GatewayMetrics())))
    assert events == []  # no stage ran: nothing was decoded or encoded


CONVERSATION = [
    {"role": "system", "content": "answer briefly"},
    {"role": "user", "content": [{"type": "text", "text": "what colour is the sky?"}]},
]


def test_tokenize_and_detokenize_through_the_stack_use_prefills_tokenizer(shared_stack, tiny_models):
    """A conversation's count is the prompt prefill runs (a chat answer's usage.prompt_tokens), its
    ids the processor's own template tokenised; a prompt's ids the tokenizer's; /detokenize gives
    the text back, special tokens kept; a video part and an id outside the vocabulary are 400s."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(str(tiny_models["qwen2_vl"]))
    tokenizer = processor.tokenizer
    port = shared_stack.http_port
    max_model_len = _model_card(port)["max_model_len"]

    status, body = post_json(port, "/tokenize", {"model": "epd", "messages": CONVERSATION})
    assert status == 200, body
    rendered = processor.apply_chat_template(
        [{"role": "system", "content": [{"type": "text", "text": "answer briefly"}]}, CONVERSATION[1]],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert body["tokens"] == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert (body["count"], body["max_model_len"], body["token_strs"]) == (
        len(body["tokens"]),
        max_model_len,
        None,
    )
    status, chat = post_json(
        port, "/v1/chat/completions", {"model": "epd", "max_tokens": 1, "messages": CONVERSATION}
    )
    assert status == 200, chat
    assert chat["usage"]["prompt_tokens"] == body["count"]
    status, without = post_json(port, "/tokenize", {"messages": CONVERSATION, "add_generation_prompt": False})
    assert status == 200 and without["count"] < body["count"]

    status, body = post_json(port, "/tokenize", {"prompt": "a red circle moves left"})
    assert status == 200 and body["tokens"] == tokenizer("a red circle moves left")["input_ids"], body
    status, body = post_json(port, "/detokenize", {"tokens": tokenizer(rendered)["input_ids"]})
    assert (status, body) == (200, {"prompt": tokenizer.decode(tokenizer(rendered)["input_ids"])})
    assert "<|im_start|>" in body["prompt"]  # special tokens kept, as vLLM's /detokenize

    video = {
        "role": "user",
        "content": [
            {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}},
            {"type": "text", "text": "what happens?"},
        ],
    }
    status, body = post_json(port, "/tokenize", {"messages": [video]})
    assert status == 400 and "tokenize counts text only" in body["error"]["message"], body
    vocab_size = _text_config(tiny_models["qwen2_vl"])["vocab_size"]
    status, body = post_json(port, "/detokenize", {"tokens": [1, vocab_size]})
    assert (
        status == 400
        and f"token id {vocab_size} is outside 0 to {vocab_size - 1}" in body["error"]["message"]
    ), body
    status, body = post_json(port, "/tokenize", {"model": "other", "prompt": "x"})
    assert status == 404, body


ANSWERED = [*CONVERSATION, {"role": "assistant", "content": "The sky is"}]
"""A conversation that ends with the assistant's (partial) answer."""


def test_tokenize_takes_an_answered_conversation_and_continues_its_last_message(shared_stack, tiny_models):
    """As vLLM's /tokenize: a conversation may end with the assistant's message, counted with its
    end of turn, or left open with continue_final_message (the processor's own renderings of it,
    tokenised). Asking for a generation prompt and a continued message at once is a 400, as
    vLLM's. The chat route's prompt of the same options is /tokenize's (its prompt_tokens)."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(str(tiny_models["qwen2_vl"]))
    tokenizer = processor.tokenizer
    port = shared_stack.http_port
    conversation = to_chat_template(from_chat_template(ANSWERED), "")

    def template_ids(**options) -> list[int]:
        rendered = processor.apply_chat_template(conversation, tokenize=False, **options)
        return tokenizer(rendered, add_special_tokens=False)["input_ids"]

    status, closed = post_json(port, "/tokenize", {"messages": ANSWERED, "add_generation_prompt": False})
    assert status == 200, closed
    assert closed["tokens"] == template_ids(add_generation_prompt=False) and closed["count"] == len(
        closed["tokens"]
    )
    status, opened = post_json(
        port,
        "/tokenize",
        {"messages": ANSWERED, "add_generation_prompt": False, "continue_final_message": True},
    )
    assert status == 200, opened
    assert opened["tokens"] == template_ids(add_generation_prompt=False, continue_final_message=True)
    assert tokenizer.decode(opened["tokens"]).endswith("<|im_start|>assistant\nThe sky is")  # no end of turn
    assert opened["count"] < closed["count"] and closed["tokens"][: opened["count"]] == opened["tokens"]

    for options in (
        {"continue_final_message": True},
        {"continue_final_message": True, "add_generation_prompt": True},
    ):
        status, body = post_json(port, "/tokenize", {"messages": ANSWERED, **options})
        assert status == 400, body
        assert (
            "add_generation_prompt and continue_final_message cannot both be true" in body["error"]["message"]
        )
    status, body = post_json(
        port,
        "/v1/chat/completions",
        {
            "model": "epd",
            "max_tokens": 1,
            "messages": ANSWERED,
            "add_generation_prompt": False,
            "continue_final_message": True,
        },
    )
    assert status == 200 and body["usage"]["prompt_tokens"] == opened["count"], body


def test_tokenize_gives_token_strs_when_asked(shared_stack, tiny_models):
    """vLLM's return_token_strs: the tokenizer's token of each id (`convert_ids_to_tokens`), for a
    prompt and for a conversation; null unless asked."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_models["qwen2_vl"]))
    port = shared_stack.http_port
    status, body = post_json(port, "/tokenize", {"prompt": "a red circle", "return_token_strs": True})
    assert status == 200 and body["tokens"] == tokenizer("a red circle")["input_ids"], body
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])
    # the vocabulary's tokens, not their text
    assert body["token_strs"] == ["a", "Ġ", "red", "Ġc", "ir", "cle"]
    status, body = post_json(
        port,
        "/tokenize",
        {
            "messages": ANSWERED,
            "add_generation_prompt": False,
            "continue_final_message": True,
            "return_token_strs": True,
        },
    )
    assert status == 200 and body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"]), body
    assert "<|im_start|>" in body["token_strs"] and len(body["token_strs"]) == body["count"]
    status, body = post_json(port, "/tokenize", {"prompt": "a red circle", "return_token_strs": False})
    assert status == 200 and body["token_strs"] is None, body
