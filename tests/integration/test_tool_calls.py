"""Tool calling (OpenAI's `tools` / `tool_choice`, vLLM's `--enable-auto-tool-choice
--tool-call-parser hermes`) over the tiny Qwen2-VL checkpoint saved with a Qwen2.5 / Qwen3-style
chat template that reads `tools` (`TOOL_TEMPLATE`, written here from the format those templates
use: the tools' JSON in the system turn, an assistant's calls as `<tool_call>` JSON, tools'
results as `<tool_response>` in a user turn).

In one process: the prompt of a conversation with tools, an assistant's tool calls (content null,
arguments JSON text) and a tool's result is the processor's own `apply_chat_template(...,
tools=...)` of it, token for token, and the answer generate()'s; /tokenize counts the same ids. A
template that does not read `tools` renders without them (vLLM's).

Through the real stack (four processes): the model's answer forced to a call (by a choice grammar
of the call's text under tool_choice "auto", by a named function's or "required"'s own grammar)
comes back as `message.tool_calls` with vLLM's finish reason, plain and streamed as vLLM's
`delta.tool_calls`; tool_choice "none" leaves the text unparsed; gRPC (the SDK) carries the tools
and the history into the same prompt and answers the raw text; without `--enable-auto-tool-choice`
"auto" is a 400 naming the flags."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import pytest

from epd.client import EpdClient
from epd.gateway.ask_types import AskRequest
from epd.gateway.embedded import build_embedded_pipeline
from epd.model_runtime.config import ModelConfig
from epd.model_runtime.sampling import GenerationConfig
from epd.stages.errors import InvalidRequest
from epd.stages.messages import ChatTemplateOptions, from_chat_template
from epd.stages.tokenize import TokenizeInput
from tests.embedded import request_summary
from tests.local_http import post_json, sse_chunks
from tests.reference import template_reference
from tests.stack import Stack, gateway_over
from tests.tool_data import (
    CALL_TEXT,
    FORECAST,
    HISTORY,
    QWEN3_CODER_CALL_TEXT,
    TIME,
    TOOLS,
    no_whitespace_bias,
    tool_template_model,
)

MAX_NEW_TOKENS = 8

TRANSFORMERS_HISTORY = [  # the same as a transformers user writes it: the arguments an object
    HISTORY[0],
    {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": "sunny"},
]  # fmt: skip


@pytest.fixture(scope="module")
def tool_model(tiny_models, tmp_path_factory):
    """The tiny Qwen2-VL checkpoint with `TOOL_TEMPLATE` as its chat template."""
    return tool_template_model(tiny_models["qwen2_vl"], tmp_path_factory.mktemp("tools") / "qwen2_vl_tools")


@pytest.fixture(scope="module")
def tool_stages(tool_model, tmp_path_factory):
    """The stages over `tool_model`, which the stack tests' gateways (each with its own parser
    flags, `gateway_over`) share: the template is prefill's, the flags the gateway's."""
    with Stack(tool_model, tmp_path_factory.mktemp("logs_tool_stages")) as stages:
        yield stages


def test_the_prompt_with_tools_and_tool_history_is_the_processors_own(tool_model, tiny_models):
    prompt_ids, want = template_reference(tool_model, TRANSFORMERS_HISTORY, MAX_NEW_TOKENS, tools=TOOLS)
    plain_ids, _ = template_reference(tool_model, TRANSFORMERS_HISTORY, 1)
    assert prompt_ids != plain_ids  # the template reads the tools
    template = ChatTemplateOptions(tools=tuple(TOOLS))
    with build_embedded_pipeline(ModelConfig(model=str(tool_model))) as pipeline:
        request = AskRequest(
            from_chat_template(HISTORY),
            None,
            generation=GenerationConfig(max_new_tokens=MAX_NEW_TOKENS),
            template=template,
        )
        got = asyncio.run(request_summary(pipeline, request))
        assert len(set(want)) > 2, "the tiny model repeats one token; the comparison proves little"
        assert (got.token_ids, got.num_prompt_tokens) == (want, len(prompt_ids))
        tokenize = TokenizeInput(
            messages=from_chat_template(HISTORY), add_special_tokens=False, template=template
        )
        assert asyncio.run(pipeline.prefill.tokenize(tokenize, "t")).token_ids == prompt_ids
        # The model's visual placeholder in a tool or a call's arguments would take the media's
        # embeddings (only a media part places it): refused, as in a text part.
        sneaky = {"type": "function", "function": {"name": "f", "description": "<|video_pad|>"}}
        with pytest.raises(
            InvalidRequest, match="a chat_template_kwargs value or a tool contains the model's visual"
        ):
            asyncio.run(
                pipeline.prefill.tokenize(
                    replace(tokenize, template=ChatTemplateOptions(tools=(sneaky,))), "t"
                )
            )
        history = json.loads(json.dumps(HISTORY).replace('\\"Paris\\"', '\\"<|video_pad|>\\"'))
        assert history[0] == HISTORY[0] and history[1] != HISTORY[1]
        with pytest.raises(
            InvalidRequest, match="a tool call's arguments contain the model's visual placeholder"
        ):
            asyncio.run(
                pipeline.prefill.tokenize(replace(tokenize, messages=from_chat_template(history)), "t")
            )
        answer = {**HISTORY[2], "tool_call_id": "call_<|video_pad|>"}  # templates may render it
        with pytest.raises(
            InvalidRequest, match="a tool message's tool_call_id contains the model's visual placeholder"
        ):
            asyncio.run(
                pipeline.prefill.tokenize(
                    replace(tokenize, messages=from_chat_template([*HISTORY[:2], answer])), "t"
                )
            )
    # A template that does not read `tools` (the stock tiny one) renders without them.
    with build_embedded_pipeline(ModelConfig(model=str(tiny_models["qwen2_vl"]))) as pipeline:
        messages = from_chat_template([HISTORY[0]])
        counts = [
            asyncio.run(
                pipeline.prefill.tokenize(
                    TokenizeInput(
                        messages=messages, add_special_tokens=False, template=ChatTemplateOptions(tools=tools)
                    ),
                    "t",
                )
            ).token_ids
            for tools in ((), tuple(TOOLS))
        ]
        assert counts[0] == counts[1]


def _body(**fields) -> dict:
    return {"model": "epd", "messages": HISTORY, "tools": TOOLS, "max_tokens": 48, **fields}


def _chat(port: int, body: dict) -> dict:
    status, reply = post_json(port, "/v1/chat/completions", body)
    assert status == 200, reply
    return reply["choices"][0]


def _stream(port: int, body: dict) -> list[dict]:
    return [c["choices"][0] for c in sse_chunks(port, "/v1/chat/completions", body) if c["choices"]]


def _streamed_calls(choices: list[dict]) -> tuple[list[dict], str, str]:
    """(the calls the deltas build, as a client accumulates them; the content joined; the finish reason)."""
    calls: dict[int, dict] = {}
    for choice in choices:
        for delta in choice["delta"].get("tool_calls", []):
            call = calls.setdefault(delta["index"], {"function": {"arguments": ""}})
            if "id" in delta:
                assert "name" in delta["function"] and not call.get("id")  # the id and name first, once
                call.update(id=delta["id"], type=delta["type"])
                call["function"]["name"] = delta["function"]["name"]
            call["function"]["arguments"] += delta["function"].get("arguments", "")
    content = "".join(c["delta"].get("content") or "" for c in choices)
    return [calls[i] for i in sorted(calls)], content, choices[-1]["finish_reason"]


def _num_argument_fragments(choices: list[dict]) -> int:
    return sum(
        bool(d["function"].get("arguments")) for c in choices for d in c["delta"].get("tool_calls", [])
    )


def _named(call: dict) -> tuple[str, str]:
    return call["function"]["name"], call["function"]["arguments"]


def test_the_stack_answers_tool_calls_plain_and_streamed(tool_model, tool_stages, tmp_path):
    compact = no_whitespace_bias(tool_model)
    flags = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    with gateway_over(tool_stages, tmp_path / "logs", flags, http=True) as stack:
        port = stack.http_port
        # "auto": the answer's text (forced to a call's by a choice grammar) parsed by hermes.
        forced_text = _body(structured_outputs={"choice": [CALL_TEXT]}, max_tokens=128)
        choice = _chat(port, forced_text)
        message = choice["message"]
        assert (message["content"], choice["finish_reason"]) == (None, "tool_calls")
        (call,) = message["tool_calls"]
        assert call["id"].startswith("chatcmpl-tool-") and call["type"] == "function"
        assert _named(call) == ("get_weather", '{"city": "Rome"}')
        chunks = _stream(port, forced_text)
        calls, content, finish = _streamed_calls(chunks)
        assert ([_named(c) for c in calls], content, finish) == ([_named(call)], "", "tool_calls")
        assert calls[0]["id"].startswith("chatcmpl-tool-")
        assert _num_argument_fragments(chunks) > 1  # the arguments as they were written, not whole

        # "none": the tools are in the prompt, the text is not parsed.
        none = _chat(port, {**forced_text, "tool_choice": "none"})
        assert (none["message"]["content"], none["message"].get("tool_calls"), none["finish_reason"]) == (
            CALL_TEXT,
            None,
            "stop",
        )

        # A named function: its parameters' grammar, the text its arguments (finish reason kept, as vLLM's).
        named = _body(
            tool_choice={"type": "function", "function": {"name": "get_weather"}}, logit_bias=compact
        )
        choice = _chat(port, named)
        (call,) = choice["message"]["tool_calls"]
        assert (choice["message"]["content"], call["function"]["name"]) == ("", "get_weather")
        assert choice["finish_reason"] == "stop"  # the grammar ended (not cut by max_tokens)
        assert json.loads(call["function"]["arguments"])["city"] in ("Paris", "Rome")
        chunks = _stream(port, {**named, "return_token_ids": True})
        calls, content, finish = _streamed_calls(chunks)
        assert ([_named(c) for c in calls], content, finish) == ([_named(call)], "", choice["finish_reason"])
        # One chunk a step, as vLLM's (its parsers give one DeltaMessage a step): the first step's
        # chunk is the call's id and name with that step's arguments, and every chunk after the
        # role's carries its step's tokens (the call's header was a chunk of its own, of no token).
        first = next(c["delta"]["tool_calls"] for c in chunks if c["delta"].get("tool_calls"))
        assert (
            len(first) == 1
            and first[0]["id"].startswith("chatcmpl-tool-")
            and first[0]["function"]["arguments"]
        )
        assert all(c.get("token_ids") for c in chunks[1:])

        # "required": an array of calls of the tools, by vLLM's schema.
        required = _body(tool_choice="required", max_tokens=160, logit_bias=compact)
        choice = _chat(port, required)
        assert (choice["finish_reason"], choice["message"]["content"]) == ("tool_calls", "")
        assert choice["message"]["tool_calls"]
        assert {c["function"]["name"] for c in choice["message"]["tool_calls"]} <= {"get_weather", "get_time"}
        assert all(
            isinstance(json.loads(c["function"]["arguments"]), dict) for c in choice["message"]["tool_calls"]
        )
        chunks = _stream(port, {**required, "return_token_ids": True})
        calls, _, finish = _streamed_calls(chunks)
        assert ([_named(c) for c in calls], finish) == (
            [_named(c) for c in choice["message"]["tool_calls"]],
            "tool_calls",
        )
        # As it is generated (vLLM's), not at the end: the first call's name goes out before the
        # chunk of the answer's last token.
        first_call = next(i for i, c in enumerate(chunks) if c["delta"].get("tool_calls"))
        last_token = max(i for i, c in enumerate(chunks) if c.get("token_ids"))
        assert first_call < last_token

        # Cut by max_tokens before the array's last token (the answer's last is the end of text): the
        # whole answer is no array of calls,
        # its text the content, "length" (vLLM's); streamed, the calls that went out stay, their
        # parameters as far as they were written, and the finish reason is "tool_calls" (vLLM's).
        status, reply = post_json(port, "/v1/chat/completions", required)
        assert status == 200, reply
        cut = {**required, "max_tokens": reply["usage"]["completion_tokens"] - 2}
        whole = _chat(port, cut)
        assert (whole["finish_reason"], whole["message"].get("tool_calls")) == ("length", None)
        assert whole["message"]["content"] and whole["message"]["content"][0] == "["
        calls, content, finish = _streamed_calls(_stream(port, cut))
        want = choice["message"]["tool_calls"]
        assert (finish, content, [c["function"]["name"] for c in calls]) == (
            "tool_calls",
            "",
            [c["function"]["name"] for c in want],
        )
        assert all(
            w["function"]["arguments"].startswith(c["function"]["arguments"]) for c, w in zip(calls, want)
        )

        # /tokenize renders the tools as the chat request's prompt.
        status, counted = post_json(port, "/tokenize", {"model": "epd", "messages": HISTORY, "tools": TOOLS})
        status_plain, plain = post_json(port, "/tokenize", {"model": "epd", "messages": HISTORY})
        usage = post_json(port, "/v1/chat/completions", _body(max_tokens=1, tool_choice="none"))[1]["usage"]
        assert (status, status_plain, counted["count"]) == (200, 200, usage["prompt_tokens"])
        assert plain["count"] < counted["count"]

        # gRPC (the SDK): the tools and the history into the same prompt; the raw text answered.
        with EpdClient(stack.gateway, timeout_s=120) as client:
            result = client.ask(
                None,
                messages=HISTORY,
                tools=TOOLS,
                max_new_tokens=128,
                structured_outputs={"choice": [CALL_TEXT]},
            )
            assert (result.answer, result.num_prompt_tokens) == (CALL_TEXT, usage["prompt_tokens"])
            assert client.tokenize(messages=HISTORY, tools=TOOLS).token_ids == counted["tokens"]

        # Refusals: an unknown function, malformed history; the stack keeps serving.
        status, reply = post_json(
            port,
            "/v1/chat/completions",
            _body(tool_choice={"type": "function", "function": {"name": "nope"}}),
        )
        assert (status, "which is not in 'tools'" in reply["error"]["message"]) == (400, True)
        bad = [HISTORY[0], {**HISTORY[1], "tool_calls": [{**HISTORY[1]["tool_calls"][0], "function": {"name": "get_weather", "arguments": "{"}}]}]  # fmt: skip
        status, reply = post_json(port, "/v1/chat/completions", _body(messages=bad))
        assert (status, "arguments is not JSON text" in reply["error"]["message"]) == (400, True)
        assert _chat(port, forced_text)["finish_reason"] == "tool_calls"


def test_auto_without_the_flag_is_a_400_naming_it(tool_stages, tmp_path):
    with gateway_over(tool_stages, tmp_path / "logs", [], http=True) as stack:
        port = stack.http_port
        status, reply = post_json(port, "/v1/chat/completions", _body())
        assert status == 400
        assert "--enable-auto-tool-choice and --tool-call-parser" in reply["error"]["message"]
        # "none" and a forced choice need no flag (vLLM's).
        assert _chat(port, _body(tool_choice="none", max_tokens=2))["finish_reason"] in ("stop", "length")
        choice = _chat(
            port, _body(tool_choice={"type": "function", "function": {"name": "get_time"}}, max_tokens=8)
        )
        assert choice["message"]["tool_calls"][0]["function"]["name"] == "get_time"


def test_the_stack_reads_qwen3_coder_calls_plain_and_streamed(tool_stages, tmp_path):
    """`--tool-call-parser qwen3_coder` (Qwen3-Coder's and Qwen3.5's form), the answer forced to a
    call's text by a choice grammar: the values typed by the tool's schema (`days` an integer),
    streamed as the name, then the parameters as they end, joining to the whole answer's arguments."""
    flags = ["--enable-auto-tool-choice", "--tool-call-parser", "qwen3_coder"]
    body = _body(
        tools=[FORECAST, TIME], structured_outputs={"choice": [QWEN3_CODER_CALL_TEXT]}, max_tokens=128
    )
    with gateway_over(tool_stages, tmp_path / "logs", flags, http=True) as stack:
        port = stack.http_port
        choice = _chat(port, body)
        (call,) = choice["message"]["tool_calls"]
        assert (choice["message"]["content"], choice["finish_reason"]) == (None, "tool_calls")
        assert _named(call) == ("get_forecast", '{"city": "Rome", "days": 3}')
        chunks = _stream(port, body)
        calls, content, finish = _streamed_calls(chunks)
        assert ([_named(c) for c in calls], content, finish) == ([_named(call)], "", "tool_calls")
        assert _num_argument_fragments(chunks) == 3  # "{" with the name, each parameter, then "}"
        # The hermes form is not this parser's: the text stays content.
        hermes = _chat(port, {**body, "structured_outputs": {"choice": [CALL_TEXT]}})
        assert (hermes["message"]["content"], hermes["finish_reason"]) == (CALL_TEXT, "stop")
