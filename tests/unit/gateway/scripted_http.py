"""An in-process HttpApi (real sockets) over scripted pipelines, for the tests of what the HTTP
front doors make of a pipeline's events: POST a body, get the answer's text."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from epd.gateway.config import GatewayConfig, HttpApiConfig
from epd.gateway.http_api import HttpApi
from epd.gateway.metrics import GatewayMetrics
from epd.gateway.pipeline import Pipeline


def _post_chat(
    pipeline: Pipeline,
    body: dict,
    config: GatewayConfig | None = None,
    admission=None,
    headers: dict | None = None,
    answer_headers: dict | None = None,
    path: str = "/v1/chat/completions",
) -> str:
    """POST `body` to `path` (chat completions) of an in-process API over `pipeline`; the answer's
    text (and its headers into `answer_headers`)."""

    async def run():
        api = HttpApi(
            config or GatewayConfig(http=HttpApiConfig(port=0)),
            pipeline,
            GatewayMetrics(),
            admission=admission,
        )
        runner = web.AppRunner(api.app())
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        try:
            async with aiohttp.ClientSession(f"http://127.0.0.1:{runner.addresses[0][1]}") as session:
                async with session.post(path, json=body, headers=headers) as resp:
                    if answer_headers is not None:
                        answer_headers.update((k.lower(), v) for k, v in resp.headers.items())
                    return (await resp.read()).decode()
        finally:
            await runner.cleanup()

    return asyncio.run(run())


def _summary(token_ids: list[int], answer: str, num_prompt_tokens: int):
    from epd.gateway.ask_types import AskSummary

    return AskSummary(
        request_id="r1",
        answer=answer,
        token_ids=token_ids,
        finish_reason="length",
        num_frames=2,
        num_visual_tokens=4,
        num_prompt_tokens=num_prompt_tokens,
        timings_ms={},
        kv_num_bytes=0,
        encoder_cache_hit=False,
        media_sha256="",
        frame_timestamps_s=[],
    )


PROMPT_IDS = [151644, 872, 198]


class _ScriptedPipeline(Pipeline):
    """Answers every request with prefill's event, the prompt's ids when the request asks (as a
    real pipeline, whose prefill sends them then), two tokens and the summary."""

    def __init__(self) -> None:
        super().__init__(None, None, None)  # type: ignore[arg-type]  # no stage: ask is the fake's

    async def ask(self, req):  # type: ignore[override]
        from epd.gateway.ask_types import PromptTokenIds
        from epd.stages.contracts import StageEvent, TokenStep
        from epd.stages.names import Stage

        asked = req.generation.return_prompt_token_ids
        yield StageEvent(Stage.PREFILL, "finished", 1.0, {"num_prompt_tokens": "30"})
        if asked:
            yield PromptTokenIds(PROMPT_IDS)
        yield TokenStep([5], "a")
        yield TokenStep([6, 7], "bc")
        summary = _summary([5, 6, 7], "abc", 30)
        summary.prompt_token_ids = PROMPT_IDS if asked else None
        yield summary


STREAM_BODY = {"messages": [{"role": "user", "content": [
    {"type": "text", "text": "q"}, {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}},
]}], "stream": True}  # fmt: skip


def _stream_chunks(stream_options: dict, **fields) -> list:
    content = [
        {"type": "text", "text": "q"},
        {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}},
    ]
    body = {
        "messages": [{"role": "user", "content": content}],
        "stream": True,
        "stream_options": stream_options,
        **fields,
    }

    events = [
        line.removeprefix("data: ") for line in _post_chat(_ScriptedPipeline(), body).split("\n\n") if line
    ]
    assert events[-1] == "[DONE]"
    import json

    return [json.loads(e) for e in events[:-1]]


class _TwoChoicesPipeline(Pipeline):
    """n=2: choice 0 thinks, calls a tool (the tag split across steps) and finishes first; choice 1
    thinks and answers text, finishing with the summary."""

    def __init__(self) -> None:
        super().__init__(None, None, None)  # type: ignore[arg-type]  # no stage: ask is the fake's

    async def ask(self, req):  # type: ignore[override]
        from epd.gateway.ask_types import ChoiceSummary
        from epd.stages.contracts import TokenStep

        call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        steps = [
            (0, "hm</thi"), (1, "ok</think>It is"), (0, "nk><tool"), (0, "_call>" + call[len("<tool_call>") : 30]),
            (1, " sunny."), (0, call[30:] + "\n"),
        ]  # fmt: skip
        for i, (index, text) in enumerate(steps):
            finish = "stop" if i == len(steps) - 1 else ""
            yield TokenStep([5 + i], text, finish_reason=finish, index=index)
        summary = _summary([5, 7, 8, 10], "hm</think>" + call + "\n", 30)
        summary.finish_reason = "stop"
        summary.choices = [
            ChoiceSummary(0, summary.answer, summary.token_ids, "stop"),
            ChoiceSummary(1, "ok</think>It is sunny.", [6, 9], "length"),
        ]
        yield summary
