"""vLLM's /tokenize and /detokenize bodies, and the routes over a stand-in prefill stage (no model:
the real tokenizer is tested through the stack in tests/integration/test_model_info.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import replace

import aiohttp
import grpc
import pytest
from aiohttp import web

from epd.gateway.admission import Admission
from epd.gateway.config import GatewayConfig, HttpApiConfig
from epd.gateway.http_api import HttpApi
from epd.gateway.metrics import GatewayMetrics
from epd.gateway.pipeline import Pipeline
from epd.gateway.readiness import InProcessHealth
from epd.gateway.server import start
from epd.gateway.tokenize_api import parse_detokenize_request, parse_tokenize_request
from epd.stages.contracts import PrefillStage
from epd.stages.errors import InvalidRequest, NotFound
from epd.stages.messages import ChatTemplateOptions, ContentPart, Message, from_chat_template, text
from epd.stages.model_info import ModelInfo
from epd.stages.server_config import ServerConfig
from epd.stages.tokenize import MAX_DETOKENIZE_TOKENS, TokenizeInput, TokenizeOutput, check_token_ids
from epd.transport.message_convert import messages_to_proto, template_to_proto
from epd.transport.model_info import public_tokenize_input_from_proto
from epd.v1 import gateway_pb2, gateway_pb2_grpc

USER = {"role": "user", "content": "hi"}
ASSISTANT = {"role": "assistant", "content": "hello"}
CONTINUE = ChatTemplateOptions(add_generation_prompt=False, continue_final_message=True)


def test_a_prompt_adds_special_tokens_and_messages_a_generation_prompt_by_default_as_vllms():
    assert parse_tokenize_request({"prompt": "hi"}, "epd") == TokenizeInput(
        prompt="hi", add_special_tokens=True
    )
    parsed = parse_tokenize_request({"model": "epd", "messages": [USER]}, "epd")
    assert (parsed.prompt, parsed.add_special_tokens, parsed.template) == (None, False, ChatTemplateOptions())
    assert parsed.messages == [Message("user", (text("hi"),))]
    parsed = parse_tokenize_request(
        {"messages": [USER], "add_generation_prompt": False, "add_special_tokens": True}, "epd"
    )
    assert (parsed.add_special_tokens, parsed.template) == (
        True,
        ChatTemplateOptions(add_generation_prompt=False),
    )
    assert (parsed.template.continue_final_message, parsed.return_token_strs) == (False, False)


def test_continue_final_message_and_return_token_strs_are_read_as_vllms():
    parsed = parse_tokenize_request(
        {
            "messages": [USER, ASSISTANT],
            "add_generation_prompt": False,
            "continue_final_message": True,
            "return_token_strs": True,
        },
        "epd",
    )
    assert (parsed.template, parsed.return_token_strs) == (CONTINUE, True)
    assert parse_tokenize_request({"prompt": "a", "return_token_strs": True}, "epd").return_token_strs


@pytest.mark.parametrize(("body", "message"), [
    ({"prompt": "a", "messages": [USER]}, "exactly one of 'prompt'"),
    ({}, "send 'prompt' \\(a string\\) or 'messages'"),
    ({"prompt": 3}, "send 'prompt'"),
    ({"prompt": "a", "return_token_strs": 2}, "'return_token_strs' must be true or false"),
    ({"messages": [USER], "chat_template": 3}, "'chat_template' must be a string"),
    ({"messages": [USER], "continue_final_message": "go on"}, "'continue_final_message' must be true or false"),
    ({"messages": [USER], "tools": [{"type": "function"}]}, r"tools\[0\].function must be an object"),
    ({"messages": "hi"}, "'messages' must be a non-empty list"),
    ({"prompt": "a", "add_special_tokens": "with"}, "'add_special_tokens' must be true or false"),
    ([1], "the request body must be a JSON object"),
])  # fmt: skip
def test_bad_tokenize_bodies_are_refused_naming_what_to_change(body, message):
    with pytest.raises(InvalidRequest, match=message):
        parse_tokenize_request(body, "epd")


@pytest.mark.parametrize(
    ("body", "fields"),
    [
        ({"prompt": "hi"}, {"prompt": "hi"}),
        ({"prompt": "hi", "add_special_tokens": False}, {"prompt": "hi", "add_special_tokens": False}),
        ({"messages": [USER]}, {"messages": [USER]}),
        ({"messages": [USER], "add_special_tokens": True}, {"messages": [USER], "add_special_tokens": True}),
        (
            {"messages": [USER, ASSISTANT], "add_generation_prompt": False, "continue_final_message": True},
            {"messages": [USER, ASSISTANT], "template": CONTINUE},
        ),
        ({"prompt": "hi", "return_token_strs": True}, {"prompt": "hi", "return_token_strs": True}),
    ],
)
def test_the_grpc_request_reads_as_the_http_body_does(body, fields):
    """`GatewayService.Tokenize`'s request means what the /tokenize body means: vLLM's
    add_special_tokens default (a prompt's on, a conversation's off) when it is unset."""
    if "messages" in fields:
        fields["messages"] = messages_to_proto(from_chat_template(fields["messages"]))
    if "template" in fields:
        fields["template"] = template_to_proto(fields["template"])
    read = public_tokenize_input_from_proto(gateway_pb2.GatewayServiceTokenizeRequest(**fields))
    parsed = parse_tokenize_request(body, "epd")
    assert replace(read, messages=list(read.messages)) == replace(parsed, messages=list(parsed.messages))


def test_detokenize_takes_a_bounded_list_of_token_ids():
    assert parse_detokenize_request({"tokens": [0, 5, 7]}, "epd") == [0, 5, 7]
    for tokens, message in (
        ("1 2", "'tokens' must be a list of token ids"),
        ([1, 1.5], "tokens\\[\\]"),
        ([-1], "tokens\\[\\]"),
        ([0] * (MAX_DETOKENIZE_TOKENS + 1), "at most"),
    ):
        with pytest.raises(InvalidRequest, match=message):
            parse_detokenize_request({"tokens": tokens}, "epd")
    with pytest.raises(NotFound, match="GET /v1/models lists 'epd'"):
        parse_detokenize_request({"model": "other", "tokens": []}, "epd")


def test_the_stage_side_checks_text_only_and_the_vocabulary():
    TokenizeInput(messages=[Message("user", (text("what happens?"),))]).check(100)
    # Any last role, as vLLM's /tokenize: an assistant's turn is counted, or left open.
    answered = [Message.user("what happens?"), Message.assistant("a circle")]
    TokenizeInput(messages=answered, template=ChatTemplateOptions(add_generation_prompt=False)).check(100)
    TokenizeInput(messages=answered, template=CONTINUE).check(100)
    TokenizeInput(messages=answered[:1], template=CONTINUE).check(100)  # the user's message left open too
    with pytest.raises(
        InvalidRequest, match="add_generation_prompt and continue_final_message cannot both be true"
    ):
        TokenizeInput(messages=answered, template=ChatTemplateOptions(continue_final_message=True)).check(100)
    with pytest.raises(InvalidRequest, match="^tokenize counts text only"):
        TokenizeInput(messages=[Message("user", (ContentPart("video"), text("what happens?")))]).check(100)
    with pytest.raises(InvalidRequest, match="the prompt has 5 characters; the limit is 4"):
        TokenizeInput(prompt="hello").check(4)
    with pytest.raises(InvalidRequest, match="exactly one of 'prompt'"):
        TokenizeInput().check(4)
    check_token_ids([0, 9], 10, 2)
    with pytest.raises(InvalidRequest, match="token id 10 is outside 0 to 9"):
        check_token_ids([0, 10], 10, 2)
    with pytest.raises(InvalidRequest, match="'tokens' has 3 ids; the limit is 2"):
        check_token_ids([0, 1, 2], 10, 2)


class _Prefill(PrefillStage):
    """Tokens are the characters' code points: enough to see the routes carry them."""

    async def prefill(self, *args, **kwargs):
        raise AssertionError("the tokenizer routes never prefill")

    async def release(self, handle, request_id):
        pass

    def model_info(self) -> ModelInfo:
        return ModelInfo(vocab_size=200, context_tokens=None, max_prompt_tokens=100, max_new_tokens=28)

    async def tokenize(self, request: TokenizeInput, request_id: str) -> TokenizeOutput:
        token_ids = [ord(c) for c in request.prompt or ""]
        return TokenizeOutput(token_ids, [chr(t) for t in token_ids] if request.return_token_strs else None)

    async def detokenize(self, token_ids: Sequence[int], request_id: str) -> str:
        return "".join(chr(t) for t in token_ids)


def test_the_routes_answer_vllms_shapes_behind_the_api_key():
    async def scenario():
        config = GatewayConfig(http=HttpApiConfig(port=0, api_keys=("k1",)))
        api = HttpApi(config, Pipeline(None, _Prefill(), None), GatewayMetrics())  # type: ignore[arg-type]
        runner = web.AppRunner(api.app())
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        key = {"Authorization": "Bearer k1"}
        try:
            async with aiohttp.ClientSession(f"http://127.0.0.1:{runner.addresses[0][1]}") as session:
                out = []
                for path, body, headers in (
                    ("/tokenize", {"prompt": "hi"}, {}),
                    ("/tokenize", {"prompt": "hi"}, key),
                    ("/detokenize", {"tokens": [104, 105]}, key),
                    ("/tokenize", {"prompt": 1}, key),
                    ("/tokenize", {"prompt": "hi", "return_token_strs": True}, key),
                ):
                    async with session.post(path, json=body, headers=headers) as resp:
                        out.append((resp.status, await resp.json()))
                return out
        finally:
            await runner.cleanup()

    no_key, tokens, prompt, bad, strs = asyncio.run(scenario())
    assert no_key[0] == 401
    assert tokens == (200, {"count": 2, "max_model_len": 128, "tokens": [104, 105], "token_strs": None})
    assert prompt == (200, {"prompt": "hi"})
    assert bad[0] == 400 and "send 'prompt'" in bad[1]["error"]["message"]
    assert strs == (200, {"count": 2, "max_model_len": 128, "tokens": [104, 105], "token_strs": ["h", "i"]})


def test_grpc_tokenize_is_admitted_as_the_http_routes_are():
    """`GatewayService.Tokenize` / `Detokenize` over the same stand-in prefill: a client with its
    requests in flight is refused RESOURCE_EXHAUSTED naming the limit, as the HTTP routes are
    (one `Admission` for both APIs); a call gives back its slot and reserved bytes."""

    async def scenario():
        config = GatewayConfig(server=ServerConfig(port=0), max_requests_per_client=1)
        admission = Admission.of_gateway(config)
        server = await start(config, Pipeline(None, _Prefill(), None), admission, InProcessHealth())  # type: ignore[arg-type]
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                stub = gateway_pb2_grpc.GatewayServiceStub(channel)
                held = admission.admit("127.0.0.1")  # the client's one request in flight (an Ask)
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.Tokenize(gateway_pb2.GatewayServiceTokenizeRequest(prompt="hi"))
                held.close()
                answer = await stub.Tokenize(gateway_pb2.GatewayServiceTokenizeRequest(prompt="hi"))
                text = await stub.Detokenize(
                    gateway_pb2.GatewayServiceDetokenizeRequest(token_ids=[104, 105])
                )
                return refused.value, answer, text, (admission.num_requests, admission.num_reserved_bytes)
        finally:
            await server.stop(0.5)

    refused, answer, text, held_after = asyncio.run(scenario())
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--max-requests-per-client" in refused.details()
    assert (list(answer.token_ids), answer.num_tokens, answer.max_model_len) == ([104, 105], 2, 128)
    assert text.text == "hi"
    assert held_after == (0, 0)
