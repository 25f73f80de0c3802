"""How an HTTP answer counts its reasoning tokens (in-process server, real sockets, scripted
pipelines): by the think markers' token ids once prefill's model info has them (read at the first
token), else by where the text falls, with one warning for the process."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
from aiohttp import web

from epd.gateway.config import GatewayConfig, HttpApiConfig
from epd.gateway.http_api import HttpApi
from epd.gateway.metrics import GatewayMetrics
from epd.gateway.pipeline import Pipeline
from epd.stages.model_info import ModelInfo
from tests.unit.gateway.scripted_http import _summary, _TwoChoicesPipeline


def _post_each(config: GatewayConfig, pipeline, posts: list[tuple[str, dict, ModelInfo | None]]) -> list[str]:
    """POST each (path, body, model info) in turn to one in-process API over `pipeline` (which
    has an `info`: the model info it reports, set to the post's before it); the answers' texts."""

    async def run() -> list[str]:
        api = HttpApi(config, pipeline, GatewayMetrics())
        runner = web.AppRunner(api.app())
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        try:
            async with aiohttp.ClientSession(f"http://127.0.0.1:{runner.addresses[0][1]}") as session:
                texts = []
                for path, body, info in posts:
                    pipeline.info = info
                    async with session.post(path, json=body) as resp:
                        texts.append((await resp.read()).decode())
                return texts
        finally:
            await runner.cleanup()

    return asyncio.run(run())


class _LateModelInfoPipeline(_TwoChoicesPipeline):
    """`_TwoChoicesPipeline` whose model info (with the think markers' ids: `</think>` is the
    token of choice 0's third step) is known only once `info` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.info: ModelInfo | None = None

    def model_info(self) -> ModelInfo | None:  # type: ignore[override]
        return self.info


def test_without_the_think_markers_ids_reasoning_is_counted_by_its_text_logged_once_until_they_come(caplog):
    """Prefill has not reported the think markers' token ids (here no model info at all): the
    reasoning tokens are counted by where the text falls, and the first answer so counted logs a
    warning saying why, once for the process, not per request. The ids known later (prefill's
    model info came late), the next answer is counted by them: the log is once, the count is not
    stuck on the text."""
    import json

    config = GatewayConfig(http=HttpApiConfig(port=0, reasoning_parser="qwen3"))
    body = {"messages": [{"role": "user", "content": "q"}], "n": 2}
    posts = [("/v1/chat/completions", body, info) for info in (None, None, _THINKING_INFO)]
    with caplog.at_level(logging.WARNING, logger="epd.gateway.http_api"):
        replies = [json.loads(text) for text in _post_each(config, _LateModelInfoPipeline(), posts)]
    # by text: choice 0's "hm</thi" (1 token), then "nk><tool" (1 token, taken for the marker's);
    # choice 1's "ok</think>It is" (1 token, taken for the marker's). By id: choice 0's token 5
    # before `</think>`'s 7; choice 1's 6 and 9 (its "</think>" is text inside token 6, no marker token)
    counts = [r["usage"]["completion_tokens_details"]["reasoning_tokens"] for r in replies]
    assert counts == [1, 1, 1 + 2]
    warnings = [
        r.getMessage() for r in caplog.records if "counting reasoning tokens by where" in r.getMessage()
    ]
    assert len(warnings) == 1 and "token ids of <think> and </think>" in warnings[0]


_THINKING_INFO = ModelInfo(
    1024,
    32768,
    32768,
    4096,
    "qwen3_5",
    reasoning_markers=("<think>", "</think>"),
    reasoning_marker_ids=(99, 7),
)
"""A thinking model's info whose `</think>` is token 7."""


class _ModelInfoAtFirstTokenPipeline(Pipeline):
    """One thinking answer whose model info (the think markers' ids, `_THINKING_INFO`) the gateway
    learns after the request came, before its first token, as prefill's model info comes in the
    background. Its second step carries `</think>` (token 7) with the content's first token, so by
    id one token is reasoning, by where the text falls two (the step's two tokens, one taken for
    the marker's, and the first step's)."""

    def __init__(self) -> None:
        super().__init__(None, None, None)  # type: ignore[arg-type]  # no stage: ask is the fake's
        self.info: ModelInfo | None = None

    def model_info(self) -> ModelInfo | None:  # type: ignore[override]
        return self.info

    async def ask(self, req):  # type: ignore[override]
        from epd.stages.contracts import StageEvent, TokenStep
        from epd.stages.names import Stage

        yield StageEvent(Stage.PREFILL, "finished", 1.0, {"num_prompt_tokens": "30"})
        self.info = _THINKING_INFO  # known now: after the stream began, before its first token
        yield TokenStep([5], "a")
        yield TokenStep([7, 8], "</think>b", finish_reason="stop")
        summary = _summary([5, 7, 8], "a</think>b", 30)
        summary.finish_reason = "stop"
        yield summary


def test_an_answer_whose_model_info_comes_before_its_first_token_counts_its_reasoning_by_id(caplog):
    """The think markers' ids were read when a stream began: a stream that began before the
    gateway had prefill's model info was counted by where the text falls to its end, though the
    ids were known by its first token. They are read at the first token now, by the one
    `ReasoningStream` every answer goes through: chat's and the Responses API's, streamed and
    whole, count alike, so only an answer whose ids are still unknown then falls back (and
    nothing is logged here)."""
    import json

    config = GatewayConfig(http=HttpApiConfig(port=0, reasoning_parser="qwen3"))
    chat_body = {"messages": [{"role": "user", "content": "q"}]}
    usage = {"stream_options": {"include_usage": True}}
    # each request comes before the model info, which comes before its first token
    posts = [
        ("/v1/chat/completions", {**chat_body, "stream": True, **usage}, None),
        ("/v1/responses", {"input": "q", "stream": True}, None),
        ("/v1/chat/completions", chat_body, None),
        ("/v1/responses", {"input": "q"}, None),
    ]
    with caplog.at_level(logging.WARNING, logger="epd.gateway.http_api"):
        chat_text, responses_text, chat_whole, responses_whole = _post_each(
            config, _ModelInfoAtFirstTokenPipeline(), posts
        )
    chat = [json.loads(line[6:]) for line in chat_text.splitlines() if line.startswith("data: {")]
    assert "".join(c["delta"].get("reasoning") or "" for ch in chat for c in ch["choices"]) == "a"
    events = [json.loads(line[6:]) for line in responses_text.splitlines() if line.startswith("data: {")]
    (completed,) = [e["response"] for e in events if e["type"] == "response.completed"]
    counts = [
        chat[-1]["usage"]["completion_tokens_details"]["reasoning_tokens"],
        completed["usage"]["output_tokens_details"]["reasoning_tokens"],
        json.loads(chat_whole)["usage"]["completion_tokens_details"]["reasoning_tokens"],
        json.loads(responses_whole)["usage"]["output_tokens_details"]["reasoning_tokens"],
    ]
    assert counts == [1, 1, 1, 1]  # by id: by the text, each 2
    assert "counting reasoning tokens by where" not in caplog.text
