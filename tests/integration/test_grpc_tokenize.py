"""The gRPC API's Tokenize and Detokenize (`GatewayService`, the SDK's `tokenize` / `detokenize`)
against a real stack with an API key: the answers equal the HTTP API's /tokenize and /detokenize
(the same pipeline calls, answered by prefill's tokenizer) and the processor's own tokenisation;
bad input is INVALID_ARGUMENT saying what to change; the key is enforced as on `Ask`. The
colocated front door (the embedded pipeline) answers both APIs alike too."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from epd.client import AsyncEpdClient, EpdClient, EpdError, Message, TokenizeResult
from epd.gateway.config import GatewayConfig, HttpApiConfig
from epd.gateway.embedded import build_embedded_pipeline
from epd.gateway.http_server import start_http_api
from epd.gateway.metrics import GatewayMetrics, MeteredPipeline
from epd.gateway.readiness import InProcessHealth
from epd.gateway.server import start
from epd.model_runtime.config import ModelConfig
from epd.stages.server_config import ServerConfig
from epd.stages.tokenize import MAX_DETOKENIZE_TOKENS
from epd.v1 import gateway_pb2, gateway_pb2_grpc, messages_pb2
from tests.stack import Stack

API_KEY = "tokenize-test-key"
CONVERSATION = [
    {"role": "system", "content": "answer briefly"},
    {"role": "user", "content": [{"type": "text", "text": "what colour is the sky?"}]},
]
ANSWERED = [*CONVERSATION, {"role": "assistant", "content": "The sky is"}]
"""Ends with the assistant's (partial) answer: counted whole, or left open to continue."""
VIDEO_MESSAGE = {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "what happens?"}]}


@pytest.fixture(scope="module")
def stack(tiny_models, tmp_path_factory):
    extra = {"gateway": ["--api-key", API_KEY]}
    with Stack(
        tiny_models["qwen2_vl"], tmp_path_factory.mktemp("logs_tokenize"), extra=extra, http=True
    ) as s:
        yield s


@pytest.fixture(scope="module")
def client(stack):
    with EpdClient(stack.gateway, timeout_s=120, api_key=API_KEY) as c:
        yield c


@pytest.fixture(scope="module")
def processor(tiny_models):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(tiny_models["qwen2_vl"]))


def _post(port: int, path: str, body: dict, key: str = API_KEY) -> tuple[int, dict]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _http_tokenize(port: int, body: dict) -> dict:
    status, answer = _post(port, "/tokenize", body)
    assert status == 200, answer
    return answer


def _wait_for_max_model_len(port: int, timeout_s: float = 30.0) -> int:
    """/v1/models' max_model_len, once the gateway has prefill's model info (read in the
    background once it serves)."""
    deadline = time.monotonic() + timeout_s
    while True:
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}
        )
        with urllib.request.urlopen(request, timeout=30) as reply:
            max_model_len = json.loads(reply.read())["data"][0]["max_model_len"]
        if max_model_len is not None or time.monotonic() > deadline:
            return max_model_len
        time.sleep(0.1)


def _template_ids(processor, messages: list[dict], **options) -> list[int]:
    """The processor's own rendering of `messages`, tokenised without special tokens (the
    template writes its own), as a chat request's prompt is."""
    conversation = [
        {**m, "content": [{"type": "text", "text": m["content"]}]} if isinstance(m["content"], str) else m
        for m in messages
    ]
    rendered = processor.apply_chat_template(conversation, tokenize=False, **options)
    return processor.tokenizer(rendered, add_special_tokens=False)["input_ids"]


def test_grpc_tokenize_answers_what_http_tokenize_and_the_processor_do(stack, client, processor):
    """For a conversation (vLLM's defaults), an answered one counted whole or continued, a prompt
    with and without special tokens and with token strings: the SDK's answer is the HTTP API's
    /tokenize answer field for field, and the processor's tokens; a conversation's count is its
    chat answer's prompt tokens over gRPC."""
    tokenizer = processor.tokenizer
    max_model_len = _wait_for_max_model_len(stack.http_port)
    assert max_model_len is not None
    cases = [
        (
            {"messages": CONVERSATION},
            {"messages": CONVERSATION},
            _template_ids(processor, CONVERSATION, add_generation_prompt=True),
        ),
        (
            {"messages": ANSWERED, "add_generation_prompt": False},
            {"messages": ANSWERED, "add_generation_prompt": False},
            _template_ids(processor, ANSWERED, add_generation_prompt=False),
        ),
        (
            {"messages": ANSWERED, "add_generation_prompt": False, "continue_final_message": True},
            {"messages": ANSWERED, "add_generation_prompt": False, "continue_final_message": True},
            _template_ids(processor, ANSWERED, add_generation_prompt=False, continue_final_message=True),
        ),
        (
            {"prompt": "a red circle moves left", "return_token_strs": True},
            {"prompt": "a red circle moves left", "return_token_strs": True},
            tokenizer("a red circle moves left")["input_ids"],
        ),
        (
            {"prompt": "<|im_start|>hi", "add_special_tokens": False},
            {"prompt": "<|im_start|>hi", "add_special_tokens": False},
            tokenizer("<|im_start|>hi", add_special_tokens=False)["input_ids"],
        ),
    ]
    for http_body, sdk_options, expected_ids in cases:
        http = _http_tokenize(stack.http_port, http_body)
        prompt = sdk_options.pop("prompt", None)
        result = client.tokenize(prompt, **sdk_options)
        assert isinstance(result, TokenizeResult)
        assert result.to_dict() == http, (http_body, result)
        assert result.token_ids == expected_ids, http_body
        assert (result.num_tokens, result.max_model_len) == (len(expected_ids), max_model_len)
    assert client.tokenize(
        "a red circle", return_token_strs=True
    ).token_strs == tokenizer.convert_ids_to_tokens(tokenizer("a red circle")["input_ids"])
    assert client.tokenize("a red circle").token_strs is None  # not asked for

    # SDK `Message`s render as the chat-form dicts do, and the count is the prompt `ask` runs.
    messages = [Message.system("answer briefly"), Message.user("what colour is the sky?")]
    counted = client.tokenize(messages=messages)
    assert counted.token_ids == _template_ids(processor, CONVERSATION, add_generation_prompt=True)
    assert client.ask(None, messages=messages, max_new_tokens=1).num_prompt_tokens == counted.num_tokens

    # The wire's own fields, for callers without the SDK.
    with grpc.insecure_channel(stack.gateway) as channel:
        reply = gateway_pb2_grpc.GatewayServiceStub(channel).Tokenize(
            gateway_pb2.GatewayServiceTokenizeRequest(prompt="a red circle"),
            metadata=(("authorization", f"Bearer {API_KEY}"),),
            timeout=60,
        )
    assert list(reply.token_ids) == tokenizer("a red circle")["input_ids"]
    assert (reply.num_tokens, reply.max_model_len, list(reply.token_strs)) == (
        len(reply.token_ids),
        max_model_len,
        [],
    )


def test_detokenize_round_trips_and_equals_http_detokenize(stack, client, processor):
    """Ids back to their text, special tokens kept, as /detokenize gives it; on the async client too."""
    tokenizer = processor.tokenizer
    text = "a red circle moves left"
    ids = client.tokenize(text).token_ids
    assert client.detokenize(ids) == text == tokenizer.decode(ids)
    chat_ids = client.tokenize(messages=CONVERSATION).token_ids
    detokenized = client.detokenize(chat_ids)
    assert detokenized == tokenizer.decode(chat_ids) and "<|im_start|>" in detokenized
    assert _post(stack.http_port, "/detokenize", {"tokens": chat_ids}) == (200, {"prompt": detokenized})
    assert client.tokenize(detokenized, add_special_tokens=False).token_ids == chat_ids  # and back again

    async def on_the_async_client() -> tuple[TokenizeResult, str]:
        async with AsyncEpdClient(stack.gateway, timeout_s=120, api_key=API_KEY) as c:
            result = await c.tokenize(messages=CONVERSATION)
            return result, await c.detokenize(result.token_ids)

    result, again = asyncio.run(on_the_async_client())
    assert (result.token_ids, again) == (chat_ids, detokenized)


def test_bad_input_is_invalid_argument_saying_what_to_change(stack, client, tiny_models):
    """The refusals of the HTTP API's 400s, with their messages, as INVALID_ARGUMENT."""
    config = json.loads((tiny_models["qwen2_vl"] / "config.json").read_text())
    vocab_size = config.get("text_config", config)["vocab_size"]
    refusals = [
        (
            lambda: client.tokenize(messages=[VIDEO_MESSAGE]),
            "counts text only: a video or image part's tokens depend on the frames",
        ),
        (
            lambda: client.tokenize(messages=ANSWERED, continue_final_message=True),
            "add_generation_prompt and continue_final_message cannot both be true",
        ),
        (lambda: client.tokenize("x" * 262_145), "the prompt has 262145 characters; the limit is 262144"),
        (
            lambda: client.tokenize("hi", chat_template_kwargs={"enable_thinking": False}),
            "a prompt is tokenised as it is, without the template: leave them unset",
        ),
        (
            lambda: client.tokenize("hi", continue_final_message=True),
            "a prompt is tokenised as it is, without the template: leave them unset",
        ),
        (
            lambda: client.detokenize([1, vocab_size]),
            f"token id {vocab_size} is outside 0 to {vocab_size - 1}",
        ),
        (lambda: client.detokenize([-1]), f"token id -1 is outside 0 to {vocab_size - 1}"),
        (
            lambda: client.detokenize([0] * (MAX_DETOKENIZE_TOKENS + 1)),
            f"'tokens' has {MAX_DETOKENIZE_TOKENS + 1} ids; the limit is {MAX_DETOKENIZE_TOKENS}",
        ),
    ]
    for call, message in refusals:
        with pytest.raises(EpdError) as refused:
            call()
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT, refused.value
        assert message in refused.value.message, refused.value
    status, body = _post(stack.http_port, "/tokenize", {"messages": ANSWERED, "continue_final_message": True})
    assert status == 400 and "cannot both be true" in body["error"]["message"]  # the HTTP API's, alike

    # What the SDK will not send, sent on the wire: both a prompt and messages, or neither.
    chat = messages_pb2.ChatMessage(role="user", parts=[messages_pb2.ContentPart(type="text", text="hi")])
    with grpc.insecure_channel(stack.gateway) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        for request in (
            gateway_pb2.GatewayServiceTokenizeRequest(prompt="hi", messages=[chat]),
            gateway_pb2.GatewayServiceTokenizeRequest(),
        ):
            with pytest.raises(grpc.RpcError) as refused_rpc:
                stub.Tokenize(request, metadata=(("authorization", f"Bearer {API_KEY}"),), timeout=60)
            assert refused_rpc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "send exactly one of 'prompt' (a text) and 'messages'" in refused_rpc.value.details()


def _grpc_responses(port: int) -> dict[tuple[str, str], float]:
    """epd_grpc_responses_total's samples by (method, code), read from the gateway's GET /metrics."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/metrics", headers={"Authorization": f"Bearer {API_KEY}"}
    )
    with urllib.request.urlopen(request, timeout=60) as reply:
        text = reply.read().decode()
    return {
        (sample.labels["method"], sample.labels["code"]): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "epd_grpc_responses_total"
    }


def test_grpc_calls_are_counted_by_method_and_status(stack, client):
    """Every GatewayService call, answered or refused (by the servicer or by the API key check
    before it), is one epd_grpc_responses_total{method,code} (epd_requests_total counts pipeline
    runs only: Tokenize and Detokenize were in no metric)."""
    before = _grpc_responses(stack.http_port)
    ids = client.tokenize("hello there").token_ids
    client.tokenize(messages=CONVERSATION)
    client.detokenize(ids)
    with pytest.raises(EpdError):
        client.detokenize([-1])
    client.ask(None, messages=[Message.user("hello")], max_new_tokens=2)
    # Refused by the API key check, before the servicer: counted once each, by their own method.
    with EpdClient(stack.gateway, timeout_s=60, api_key="wrong-key") as stranger:
        for call in (
            lambda: stranger.tokenize("hi"),
            lambda: stranger.ask(None, messages=[Message.user("hello")], max_new_tokens=2),
        ):
            with pytest.raises(EpdError, match="missing or wrong API key"):
                call()
    expected = {
        ("Tokenize", "OK"): 2,
        ("Detokenize", "OK"): 1,
        ("Detokenize", "INVALID_ARGUMENT"): 1,
        ("Ask", "OK"): 1,
        ("Tokenize", "UNAUTHENTICATED"): 1,
        ("Ask", "UNAUTHENTICATED"): 1,
    }
    # A streamed call is counted when its handler ends, just after its last message went out: the
    # SDK may have returned with the answer a moment before, so the count is waited for.
    deadline = time.monotonic() + 30
    while True:
        after = _grpc_responses(stack.http_port)
        added = {k: after[k] - before.get(k, 0.0) for k in after if after[k] != before.get(k, 0.0)}
        if added == expected or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert added == expected


@pytest.mark.parametrize("key", ["", "wrong-key"])
def test_tokenize_and_detokenize_need_the_api_key(stack, key):
    with EpdClient(stack.gateway, timeout_s=60, api_key=key) as c:
        for call in (lambda: c.tokenize("hi"), lambda: c.detokenize([1, 2])):
            with pytest.raises(EpdError, match="missing or wrong API key") as refused:
                call()
            assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED


def test_the_colocated_front_door_answers_grpc_tokenize_as_its_http_tokenize(tiny_models, processor):
    """`epd serve --colocate`: both APIs over one embedded pipeline, whose own prefill stage
    tokenises (`Pipeline.tokenize`, the call each makes)."""
    model = ModelConfig(model=str(tiny_models["qwen2_vl"]))

    async def scenario(pipeline: MeteredPipeline) -> tuple[TokenizeResult, tuple[int, dict], str]:
        config = GatewayConfig(server=ServerConfig(port=0), http=HttpApiConfig(port=0))
        http = await start_http_api(config, pipeline, pipeline.metrics)
        server = await start(config, pipeline, health=InProcessHealth())
        try:
            async with AsyncEpdClient(f"127.0.0.1:{server.port}", timeout_s=120) as c:
                result = await c.tokenize(messages=CONVERSATION, return_token_strs=True)
                text = await c.detokenize(result.token_ids)
            body = {"messages": CONVERSATION, "return_token_strs": True}
            answer = await asyncio.to_thread(_post, http.port, "/tokenize", body)
            return result, answer, text
        finally:
            await server.stop(0.5)
            await http.stop(0.5)

    with build_embedded_pipeline(model) as embedded:
        result, (status, http), text = asyncio.run(scenario(MeteredPipeline(embedded, GatewayMetrics())))
    assert status == 200 and result.to_dict() == http, http
    assert result.token_ids == _template_ids(processor, CONVERSATION, add_generation_prompt=True)
    assert result.max_model_len is not None and text == processor.tokenizer.decode(result.token_ids)
