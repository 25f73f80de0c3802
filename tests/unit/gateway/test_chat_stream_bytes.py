"""The bytes of streamed chat and legacy completion answers, pinned whole: each scenario's SSE text
as a real HttpApi over real sockets sends it, its pipeline a script of the events a real one
emits (prefill's event, the prompt's logprobs and token ids, token steps of n choices, the summary). Only
`created` (the clock's second) is blanked. The chunk shapes are vLLM's and are asserted field by
field elsewhere (test_http_streams.py, test_http_token_ids.py, tests/integration/test_completions.py,
test_n_choices.py, ...); this pins their exact order and spelling, so that moving the stream's code changes no byte."""

from __future__ import annotations

import asyncio
import json
import os
import re
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from epd.gateway.ask_types import AskSummary, ChoiceSummary, PromptLogprobs, PromptTokenIds
from epd.gateway.config import GatewayConfig, HttpApiConfig
from epd.gateway.http_api import HttpApi
from epd.gateway.metrics import GatewayMetrics
from epd.gateway.pipeline import Pipeline
from epd.model_runtime.logprobs import TokenLogprob, TopLogprob
from epd.stages.contracts import StageEvent, TokenStep
from epd.stages.names import Stage
from epd.transport.errors import broken_stream


def _lp(token_id: int, token: str, logprob: float) -> TokenLogprob:
    return TokenLogprob(
        token_id, token, logprob, (TopLogprob(token_id, token, logprob), TopLogprob(9, "z", -3.0))
    )


def _summary(answer: str, token_ids: list[int], finish: str = "stop", **kw: Any) -> AskSummary:
    return AskSummary("req-1", answer, token_ids, finish, 2, 4, 30, {}, 0, False, "", [], **kw)


class _Script(Pipeline):
    """Answers with `events`, then raises `error` when one is given (a decode replica lost)."""

    def __init__(self, events: list, error: Exception | None = None) -> None:
        super().__init__(None, None, None)  # type: ignore[arg-type]  # no stage: ask is the fake's
        self.events = events
        self.error = error

    async def ask(self, req):  # type: ignore[override]
        for event in self.events:
            yield event
        if self.error is not None:
            raise self.error


PREFILL = StageEvent(Stage.PREFILL, "finished", 1.0, {"num_prompt_tokens": "30"})
# What a pipeline sends when the request asks (return_token_ids); the scenarios that do not ask get
# it too, and must show none of it.
PROMPT_IDS = PromptTokenIds([101, 102, 103])
ANSWER = [
    PREFILL,
    PROMPT_IDS,
    TokenStep([5], "a", logprobs=[_lp(5, "a", -0.5)]),
    TokenStep([6, 7], "bc", finish_reason="stop", stop_reason="###", logprobs=[_lp(6, "b", -1.0), _lp(7, "c", -1.5)]),
    _summary("abc", [5, 6, 7], stop_reason="###", logprobs=[_lp(5, "a", -0.5), _lp(6, "b", -1.0), _lp(7, "c", -1.5)]),
]  # fmt: skip
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TWO_THINKING = [
    PREFILL,
    TokenStep([5], "hm</thi", index=0),
    TokenStep([6], "ok</think>It is", index=1),
    TokenStep([7], "nk><tool", index=0),
    TokenStep([8], "_call>" + CALL[len("<tool_call>") : 30], index=0),
    TokenStep([9], " sunny.", index=1),
    TokenStep([10], CALL[30:] + "\n", finish_reason="stop", index=0),
    _summary(
        "hm</think>" + CALL + "\n",
        [5, 7, 8, 10],
        choices=[
            ChoiceSummary(0, "hm</think>" + CALL + "\n", [5, 7, 8, 10], "stop"),
            ChoiceSummary(1, "ok</think>It is sunny.", [6, 9], "length"),
        ],
    ),
]
PROMPT_LOGPROBS = [TokenLogprob(1, "name", 0.0), _lp(2, " a", -2.0), _lp(3, " colour", -0.25)]
TWO_COMPLETIONS = [
    PREFILL,
    PromptLogprobs(PROMPT_LOGPROBS),
    TokenStep([5], " red", logprobs=[_lp(5, " red", -0.5)], index=0),
    TokenStep([6], " blue", logprobs=[_lp(6, " blue", -0.75)], index=1),
    TokenStep([7], ".", finish_reason="stop", stop_reason=13, logprobs=[_lp(7, ".", -0.1)], index=1),
    TokenStep([8], "!", finish_reason="length", logprobs=[_lp(8, "!", -0.2)], index=0),
    _summary(
        " red!",
        [5, 8],
        finish="length",
        choices=[
            ChoiceSummary(0, " red!", [5, 8], "length", logprobs=[_lp(5, " red", -0.5), _lp(8, "!", -0.2)]),
            ChoiceSummary(1, " blue.", [6, 7], "stop", 13, logprobs=[_lp(6, " blue", -0.75), _lp(7, ".", -0.1)]),
        ],
        prompt_logprobs=PROMPT_LOGPROBS,
    ),
]  # fmt: skip
NAMED_CALL = [
    TokenStep([5], '{"city": '),
    TokenStep([6], '"Paris"}', finish_reason="stop"),
    _summary('{"city": "Paris"}', [5, 6]),
]
END_OF_SEQUENCE = [
    PREFILL,
    TokenStep([5], "a"),
    TokenStep([2], "", finish_reason="stop"),
    _summary("a", [5, 2]),
]
ECHO_ALONE = [
    PREFILL,
    PromptLogprobs(PROMPT_LOGPROBS),
    PROMPT_IDS,
    TokenStep([5], " red", finish_reason="length", logprobs=[_lp(5, " red", -0.5)]),
    _summary(" red", [5], finish="length", logprobs=[_lp(5, " red", -0.5)], prompt_logprobs=PROMPT_LOGPROBS),
]
USER = {"role": "user", "content": "name a colour"}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
USAGE = {"include_usage": True}
THINKING_TOOLS = HttpApiConfig(
    port=0, reasoning_parser="qwen3", enable_auto_tool_choice=True, tool_call_parser="hermes"
)

SCENARIOS: dict[str, tuple[HttpApiConfig, str, dict, _Script]] = {
    "chat, logprobs, token ids, continuous usage": (
        HttpApiConfig(port=0),
        "/v1/chat/completions",
        {"messages": [USER], "logprobs": True, "top_logprobs": 1, "return_token_ids": True,
         "stream_options": {**USAGE, "continuous_usage_stats": True}},
        _Script(ANSWER),
    ),
    "chat, echo of the assistant's message, usage": (
        HttpApiConfig(port=0),
        "/v1/chat/completions",
        {"messages": [USER, {"role": "assistant", "content": "The colour is"}], "echo": True, "logprobs": True,
         "add_generation_prompt": False, "continue_final_message": True, "stream_options": USAGE},
        _Script(ANSWER),
    ),
    "chat n=2, reasoning and tool calls, usage": (
        THINKING_TOOLS,
        "/v1/chat/completions",
        {"messages": [USER], "tools": [TOOL], "n": 2, "stream_options": USAGE},
        _Script(TWO_THINKING),
    ),
    "chat n=2, reasoning and tool calls, continuous usage": (
        THINKING_TOOLS,
        "/v1/chat/completions",
        {"messages": [USER], "tools": [TOOL], "n": 2, "stream_options": {**USAGE, "continuous_usage_stats": True}},
        _Script(TWO_THINKING),
    ),
    "chat n=2, reasoning left out": (
        HttpApiConfig(port=0, reasoning_parser="qwen3"),
        "/v1/chat/completions",
        {"messages": [USER], "n": 2, "include_reasoning": False},
        _Script(TWO_THINKING),
    ),
    "chat, a named tool's arguments": (
        HttpApiConfig(port=0),
        "/v1/chat/completions",
        {"messages": [USER], "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
        _Script(NAMED_CALL),
    ),
    "chat, the end-of-sequence token's step, usage": (
        HttpApiConfig(port=0),
        "/v1/chat/completions",
        {"messages": [USER], "stream_options": USAGE},
        _Script(END_OF_SEQUENCE),
    ),
    "chat, an error after the first token": (
        HttpApiConfig(port=0),
        "/v1/chat/completions",
        {"messages": [USER]},
        _Script(ANSWER[:3], broken_stream("decode", 1, "req-1")),
    ),
    "chat, an error after the last token's step, before the summary": (
        HttpApiConfig(port=0),
        "/v1/chat/completions",
        {"messages": [USER]},
        _Script(ANSWER[:4], broken_stream("decode", 3, "req-1")),
    ),
    "responses, reasoning and a tool call": (
        THINKING_TOOLS,
        "/v1/responses",
        {"input": "name a colour", "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]},
        _Script(TWO_THINKING[:1] + [s for s in TWO_THINKING if isinstance(s, TokenStep) and s.index == 0] + [
            _summary("hm</think>" + CALL + "\n", [5, 7, 8, 10])]),
    ),
    "responses, an error after the first token": (
        HttpApiConfig(port=0),
        "/v1/responses",
        {"input": "name a colour"},
        _Script(ANSWER[:3], broken_stream("decode", 1, "req-1")),
    ),
    "completion n=2, echo with the prompt's logprobs, continuous usage": (
        HttpApiConfig(port=0),
        "/v1/completions",
        {"prompt": "name a colour", "n": 2, "echo": True, "logprobs": 1,
         "stream_options": {**USAGE, "continuous_usage_stats": True}},
        _Script(TWO_COMPLETIONS),
    ),
    "completion, echo alone (max_tokens 0), token ids": (
        HttpApiConfig(port=0),
        "/v1/completions",
        {"prompt": "name a colour", "echo": True, "max_tokens": 0, "logprobs": 1, "return_token_ids": True},
        _Script(ECHO_ALONE),
    ),
    "completion, the end-of-sequence token's step": (
        HttpApiConfig(port=0),
        "/v1/completions",
        {"prompt": "name a colour"},
        _Script(END_OF_SEQUENCE),
    ),
    "completion, token ids, usage": (
        HttpApiConfig(port=0),
        "/v1/completions",
        {"prompt": "name a colour", "return_token_ids": True, "logprobs": 1, "stream_options": USAGE},
        _Script(ANSWER),
    ),
}  # fmt: skip


def _blanked(text: str) -> str:
    """`text` with what changes from run to run blanked: the clock's seconds, random item ids."""
    text = re.sub(r'"(created|created_at)": \d+', r'"\1": 0', text)
    return re.sub(r"\b((?:chatcmpl-tool|resp|msg|rs|fc|call)[-_])[0-9a-f]{32}\b", r"\1X", text)


async def _stream(config: HttpApiConfig, path: str, body: dict, pipeline: Pipeline) -> str:
    api = HttpApi(GatewayConfig(http=config), pipeline, GatewayMetrics())
    runner = web.AppRunner(api.app())
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{runner.addresses[0][1]}") as session:
            sent = {"model": "epd", "stream": True, **body}
            async with session.post(path, json=sent, headers={"x-request-id": "req-1"}) as resp:
                assert resp.status == 200, await resp.text()
                return _blanked((await resp.read()).decode())
    finally:
        await runner.cleanup()


def streamed(name: str) -> str:
    config, path, body, pipeline = SCENARIOS[name]
    return asyncio.run(_stream(config, path, body, pipeline))


EXPECTED_PATH = Path(__file__).with_name("streamed_answers.json")
"""Each scenario's text as the stream sent it when pinned, a list of its lines (so that a diff
shows the chunk that changed). A change meant to alter a stream rewrites it:
`EPD_REPIN_STREAMS=1 pytest tests/unit/gateway/test_chat_stream_bytes.py`, then read the diff."""


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_a_streamed_answers_bytes_are_pinned(name):
    lines = streamed(name).split("\n")
    expected = json.loads(EXPECTED_PATH.read_text())
    if os.environ.get("EPD_REPIN_STREAMS") == "1":
        expected[name] = lines
        EXPECTED_PATH.write_text(json.dumps(expected, indent=1, ensure_ascii=False) + "\n")
    assert lines == expected[name]
