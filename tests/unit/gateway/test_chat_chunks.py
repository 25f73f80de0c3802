"""A streamed chat answer's and legacy completion's chunks, shaped without HTTP
(`epd.gateway.chat_chunks.ChatChunks`, fed the events the pipeline emits): the usage each chunk
carries, when each of n choices' finish chunk comes and which carries the summary, an echo's text
offsets, a named tool's arguments. The SSE bytes a real HttpApi sends for these shapes are pinned
in test_chat_stream_bytes.py."""

from __future__ import annotations

import subprocess
import sys

from epd.gateway.chat_chunks import ChatChunks
from epd.gateway.completions_protocol import parse_completion_request
from epd.gateway.openai_protocol import parse_chat_request
from epd.gateway.pipeline import AskSummary, ChoiceSummary, PromptLogprobs
from epd.model_runtime.logprobs import TokenLogprob
from epd.model_runtime.sampling import GenerationConfig
from epd.stages.contracts import StageEvent, TokenStep
from epd.stages.names import Stage
from epd.video.types import SamplingOptions

USER = {"role": "user", "content": "name a colour"}


def _chat(**body) -> ChatChunks:
    chat = parse_chat_request(
        {"model": "epd", "messages": [USER], "stream": True, **body},
        "epd",
        SamplingOptions(),
        GenerationConfig(),
    )
    return ChatChunks(chat, "req-1", None, created=7)


def _completion(**body) -> ChatChunks:
    chat = parse_completion_request(
        {"model": "epd", "prompt": "name a colour", "stream": True, **body},
        "epd",
        SamplingOptions(),
        GenerationConfig(),
    )
    return ChatChunks(chat, "req-1", None, created=7)


def _summary(answer: str, token_ids: list[int], choices: list[ChoiceSummary] | None = None) -> AskSummary:
    summary = AskSummary("req-1", answer, token_ids, "stop", 0, 0, 30, {}, 0, False, "", [])
    if choices is not None:
        summary.choices = choices
    return summary


def test_continuous_usage_is_the_usage_when_each_chunk_is_made():
    chunks = _chat(stream_options={"include_usage": True, "continuous_usage_stats": True})
    chunks.note(StageEvent(Stage.PREFILL, "finished", 1.0, {"num_prompt_tokens": "30"}))
    made = chunks.opening(0) + chunks.add(TokenStep([5], "a")) + chunks.add(TokenStep([6, 7], "bc", "stop"))
    made += chunks.finish(_summary("abc", [5, 6, 7]))
    assert [c["usage"]["completion_tokens"] for c in made] == [0, 1, 3, 3, 3]  # role, a, bc, finish, usage
    assert [c["usage"]["total_tokens"] for c in made] == [30, 31, 33, 33, 33]
    assert made[-1]["choices"] == [] and made[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert chunks.num_tokens == 3


def test_include_usage_alone_puts_null_usage_on_every_chunk_but_the_last_and_no_option_none():
    plain = _chat(stream_options={"include_usage": True})
    made = plain.opening(0) + plain.add(TokenStep([5], "a", "stop")) + plain.finish(_summary("a", [5]))
    assert [c["usage"] for c in made[:-1]] == [None, None, None] and made[-1]["usage"][
        "completion_tokens"
    ] == 1
    bare = _chat()
    made = bare.opening(0) + bare.add(TokenStep([5], "a", "stop")) + bare.finish(_summary("a", [5]))
    assert all("usage" not in c for c in made) and len(made) == 3


def test_a_choice_finishing_first_ends_at_once_and_the_last_carries_the_summary():
    chunks = _chat(n=2)
    first = chunks.add(TokenStep([5], "red", "length", index=1))
    assert [(c["choices"][0]["index"], c["choices"][0]["finish_reason"]) for c in first] == [
        (1, None),
        (1, "length"),
    ]
    assert "epd" not in first[-1]
    assert [
        c["choices"][0]["finish_reason"] for c in chunks.add(TokenStep([6], "blue", "stop", index=0))
    ] == [None]
    summary = _summary(
        "blue", [6], [ChoiceSummary(0, "blue", [6], "stop"), ChoiceSummary(1, "red", [5], "length")]
    )
    end = chunks.finish(summary)
    assert [(c["choices"][0]["index"], c["choices"][0]["finish_reason"]) for c in end] == [(0, "stop")]
    assert end[0]["epd"]["request_id"] == "req-1"


def test_a_completions_echo_sets_where_the_answers_text_offsets_begin():
    prompt = [TokenLogprob(1, "name", 0.0), TokenLogprob(2, " a", -1.0), TokenLogprob(3, " colour", -2.0)]
    with_logprobs = _completion(echo=True, logprobs=1)
    assert with_logprobs.opening(0) == [] and not with_logprobs.echo_is_costly  # no prompt logprobs yet
    with_logprobs.note(PromptLogprobs(prompt))
    assert with_logprobs.echo_is_costly
    echo = with_logprobs.echo(0)
    assert echo is not None and echo["choices"][0]["text"] == "name a colour"
    assert echo["choices"][0]["logprobs"]["text_offset"] == [0, 4, 6]
    (step,) = with_logprobs.add(TokenStep([5], " red", logprobs=[TokenLogprob(5, " red", -0.5)]))
    assert step["choices"][0]["logprobs"]["text_offset"] == [13]  # after the prompt tokens' texts
    plain = _completion()
    assert plain.echo(0) is None and not plain.echo_is_costly


def test_a_named_tools_arguments_stream_as_tool_call_deltas():
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    chunks = _chat(tools=[tool], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    made = chunks.add(TokenStep([5], '{"city": ')) + chunks.add(TokenStep([6], '"Paris"}', "stop"))
    made += chunks.finish(_summary('{"city": "Paris"}', [5, 6]))
    calls = [d for c in made for d in c["choices"][0]["delta"].get("tool_calls", [])]
    assert calls[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert "".join(d["function"]["arguments"] for d in calls) == '{"city": "Paris"}'
    assert [c["choices"][0]["finish_reason"] for c in made][-1] == "stop"  # named: vLLM's "stop"


def test_the_chunks_module_needs_no_http_server():
    code = "import sys, epd.gateway.chat_chunks; print('aiohttp' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "False"
