"""A streamed answer over HTTP (in-process server, real sockets, scripted pipelines): a stream that
ends in an error event is logged as failed, keep-alive comments while the first token is awaited
(and an error's status before one went out), continuous usage stats per chunk and per choice, and
n choices each parting their own tool calls with their own finish reasons."""

from __future__ import annotations

import asyncio
import logging

from epd.gateway.config import GatewayConfig, HttpApiConfig
from epd.gateway.pipeline import Pipeline
from epd.stages.errors import Busy
from tests.unit.gateway.scripted_http import (
    STREAM_BODY,
    _post_chat,
    _ScriptedPipeline,
    _stream_chunks,
    _summary,
    _TwoChoicesPipeline,
)


class _BrokenStreamPipeline(Pipeline):
    """One token, then the decode replica is lost: the client already has its 200."""

    def __init__(self) -> None:
        super().__init__(None, None, None)  # type: ignore[arg-type]  # no stage: ask is the fake's

    async def ask(self, req):  # type: ignore[override]
        from epd.stages.contracts import TokenStep
        from epd.transport.errors import broken_stream

        yield TokenStep([5], "a")
        raise broken_stream("decode", 1, req.request_id)


def test_a_stream_that_ends_in_an_error_event_is_logged_as_failed(caplog):
    """Its log line said `http POST /v1/chat/completions 200` like any answer: the operator could
    not tell the failed streamed answers from the good ones."""
    content = [
        {"type": "text", "text": "q"},
        {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}},
    ]
    body = {"messages": [{"role": "user", "content": content}], "stream": True}
    with caplog.at_level(logging.INFO, logger="epd.gateway.http_api"):
        text = _post_chat(_BrokenStreamPipeline(), body)
        good = _post_chat(_ScriptedPipeline(), body)
    assert '"error"' in text and text.endswith("data: [DONE]\n\n") and '"error"' not in good
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("http POST")]
    assert len(lines) == 2
    assert lines[0].startswith("http POST /v1/chat/completions 200 stream_error=502 "), lines
    assert "stream_error" not in lines[1]


class _SlowPipeline(Pipeline):
    """Its first token (or its error) comes only after `delay_s`, as after a long encode."""

    def __init__(self, delay_s: float, error: Exception | None = None) -> None:
        super().__init__(None, None, None)  # type: ignore[arg-type]  # no stage: ask is the fake's
        self.delay_s = delay_s
        self.error = error

    async def ask(self, req):  # type: ignore[override]
        from epd.stages.contracts import TokenStep

        await asyncio.sleep(self.delay_s)
        if self.error is not None:
            raise self.error
        yield TokenStep([5], "a")
        yield _summary([5], "a", 30)


def _keepalive_config(keepalive_s: float) -> GatewayConfig:
    return GatewayConfig(http=HttpApiConfig(port=0, sse_keepalive_s=keepalive_s))


def test_a_stream_waiting_for_its_first_token_gets_keep_alive_comments_that_clients_skip():
    """Its 200 came only with the first token: a long encode behind a proxy with an idle timeout
    (nginx: 60 s) was cut before it. Now comment lines come meanwhile, and the OpenAI SDK's own
    SSE parser reads the answer as if they were not there."""
    from openai._streaming import SSEDecoder

    text = _post_chat(_SlowPipeline(0.7), STREAM_BODY, config=_keepalive_config(0.1))
    head, _, rest = text.partition("data: ")
    assert head.count(": keep-alive\n\n") >= 3 and head == ": keep-alive\n\n" * head.count(": keep-alive")
    events = [e for e in SSEDecoder().iter_bytes(iter([text.encode()]))]
    import json

    chunks = [json.loads(e.data) for e in events if e.data != "[DONE]"]
    assert [c["choices"][0]["delta"].get("content") for c in chunks if c["choices"]][:2] == ["", "a"]
    assert ": keep-alive" not in _post_chat(_SlowPipeline(0.3), STREAM_BODY, config=_keepalive_config(0))
    assert ": keep-alive" not in _post_chat(_SlowPipeline(0.0), STREAM_BODY, config=_keepalive_config(10))


def test_an_error_before_the_first_token_keeps_its_status_unless_a_keep_alive_went_out():
    """Before any keep-alive the error has its own HTTP status; after one (the 200 is out) it is
    an error event and [DONE], as an error after the first token is."""
    import json

    busy = Busy("the decoder's KV memory is full")
    answer_headers: dict = {}
    text = _post_chat(
        _SlowPipeline(0.0, busy), STREAM_BODY, config=_keepalive_config(10), answer_headers=answer_headers
    )
    assert json.loads(text)["error"]["code"] == 429 and answer_headers["retry-after"] == "1"
    text = _post_chat(_SlowPipeline(0.5, busy), STREAM_BODY, config=_keepalive_config(0.1))
    events = [line.removeprefix("data: ") for line in text.split("\n\n") if line.startswith("data: ")]
    assert text.startswith(": keep-alive") and events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == 429


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk():
    """vLLM's `stream_options.continuous_usage_stats` was ignored: every chunk said usage null."""
    chunks = _stream_chunks({"include_usage": True, "continuous_usage_stats": True})
    assert [c["usage"]["completion_tokens"] for c in chunks] == [0, 1, 3, 3, 3]  # role, a, bc, final, usage
    assert all(
        c["usage"]["prompt_tokens"] == 30
        and c["usage"]["total_tokens"] == 30 + c["usage"]["completion_tokens"]
        for c in chunks
    )
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens_details"] == {
        "cached_tokens": 0
    }
    plain = _stream_chunks({"include_usage": True})  # vLLM's: no usage field but the last chunk's
    assert all("usage" not in c for c in plain[:-1]) and plain[-1]["usage"]["completion_tokens"] == 3
    # as vLLM: only with include_usage
    assert all("usage" not in c for c in _stream_chunks({"continuous_usage_stats": True}))
    # vLLM's chat sets completion_tokens_details on every continuous-usage chunk, null without
    # --reasoning-parser (the final usage chunk leaves the nulls out)
    assert all(c["usage"]["completion_tokens_details"] is None for c in chunks[:-1])
    assert "completion_tokens_details" not in chunks[-1]["usage"]


class _TwoChoicePipeline(Pipeline):
    """Answers with two choices: choice 0 one token then two, choice 1 three tokens at once."""

    def __init__(self) -> None:
        super().__init__(None, None, None)  # type: ignore[arg-type]  # no stage: ask is the fake's

    async def ask(self, req):  # type: ignore[override]
        from epd.gateway.ask_types import ChoiceSummary
        from epd.stages.contracts import StageEvent, TokenStep
        from epd.stages.names import Stage

        yield StageEvent(Stage.PREFILL, "finished", 1.0, {"num_prompt_tokens": "30"})
        yield TokenStep([5], "a", index=0)
        yield TokenStep([8, 9, 10], "xyz", index=1)
        yield TokenStep([6, 7], "bc", index=0)
        summary = _summary([5, 6, 7], "abc", 30)
        summary.choices = [
            ChoiceSummary(0, "abc", [5, 6, 7], "length"),
            ChoiceSummary(1, "xyz", [8, 9, 10], "length"),
        ]
        yield summary


def test_continuous_usage_counts_each_chunks_own_choice():
    """With n > 1 each chunk's completion_tokens summed every choice's tokens so far (1, 4, 6), where
    vLLM's chat and completions stream count the chunk's own choice (`previous_num_tokens[i]`);
    the final usage chunk sums them, as vLLM's."""
    import json

    body = {
        "messages": [{"role": "user", "content": "q"}],
        "n": 2,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    text = _post_chat(_TwoChoicePipeline(), body)
    chunks = [json.loads(e.removeprefix("data: ")) for e in text.split("\n\n") if e and e != "data: [DONE]"]
    counts = [(c["choices"][0]["index"], c["usage"]["completion_tokens"]) for c in chunks if c["choices"]]
    assert counts == [(0, 0), (1, 0), (0, 1), (1, 3), (0, 3), (0, 3), (1, 3)], counts
    assert all(c["usage"]["total_tokens"] == 30 + c["usage"]["completion_tokens"] for c in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6


def test_streamed_choices_part_their_own_tool_calls_with_their_own_finish_reasons():
    """n=2 under --reasoning-parser and --tool-call-parser: each choice's content is parsed for calls
    by its own parser state (the reasoning never), a choice that finishes first ends "tool_calls"
    after its calls, the other keeps its own reason; the deltas joined are the whole answer's."""
    import json

    config = GatewayConfig(
        http=HttpApiConfig(
            port=0, reasoning_parser="qwen3", enable_auto_tool_choice=True, tool_call_parser="hermes"
        )
    )
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    body = {"messages": [{"role": "user", "content": "q"}], "tools": [tool], "n": 2, "stream": True}
    text = _post_chat(_TwoChoicesPipeline(), body, config)
    chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    by_index: dict[int, list[dict]] = {0: [], 1: []}
    for chunk in chunks:
        for choice in chunk["choices"]:
            by_index[choice["index"]].append(choice)
    first, second = by_index[0], by_index[1]
    reasoning = ["".join(c["delta"].get("reasoning") or "" for c in cs) for cs in (first, second)]
    content = ["".join(c["delta"].get("content") or "" for c in cs) for cs in (first, second)]
    calls = [[d for c in cs for d in c["delta"].get("tool_calls", [])] for cs in (first, second)]
    assert (reasoning, content) == (["hm", "ok"], ["", "It is sunny."])
    assert calls[1] == [] and {d["index"] for d in calls[0]} == {0}
    assert calls[0][0]["function"]["name"] == "get_weather"
    assert json.loads("".join(d["function"]["arguments"] for d in calls[0])) == {"city": "Paris"}
    finishes = [[c["finish_reason"] for c in cs if c["finish_reason"]] for cs in (first, second)]
    assert finishes == [["tool_calls"], ["length"]]
    # vLLM's hermes sets content on each step it says something in (null beside calls; its empty
    # tool_calls beside text left out, vLLM PR #44105); the reasoning's steps carry neither
    hermes = [c["delta"] for cs in (first, second) for c in cs if "role" not in c["delta"]]
    said = [d for d in hermes if "content" in d or "tool_calls" in d]
    assert said and all("content" in d and d.get("tool_calls") != [] for d in said), hermes
    assert [d["content"] for d in said if "tool_calls" in d] == [None]  # choice 0's call, no text
    assert all("tool_calls" not in d for d in hermes if d.keys() == {"reasoning", "reasoning_content"})
    # as the reasoning tokens so far, with continuous usage: each chunk's own choice's
    continuous = _post_chat(
        _TwoChoicesPipeline(),
        {**body, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
        config,
    )
    usages = [json.loads(line[6:])["usage"] for line in continuous.splitlines() if line.startswith("data: {")]
    assert [u["completion_tokens_details"]["reasoning_tokens"] for u in usages] == [0, 0, 1, 0, 0, 1, 0, 1]
