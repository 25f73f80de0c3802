"""The Responses API body (`POST /v1/responses`) -> the chat request the handler runs: input items,
instructions, tools, text.format, what is refused with a 400 that says what to send; and the answer:
the `response` object and its streamed events, which carry the same items."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.types.responses import ResponseErrorEvent

from epd.gateway.ask_types import AskSummary
from epd.gateway.config import GatewayConfig, HttpApiConfig
from epd.gateway.http_server import start_http_api
from epd.gateway.logprobs_protocol import chat_logprobs
from epd.gateway.metrics import GatewayMetrics
from epd.gateway.pipeline import Pipeline
from epd.gateway.responses_events import ResponseEvents, response_body
from epd.gateway.responses_protocol import parse_responses_request
from epd.model_runtime.logprobs import TokenLogprob, TopLogprob
from epd.model_runtime.sampling import GenerationConfig, StructuredOutputs
from epd.stages.contracts import TokenStep
from epd.stages.errors import InvalidRequest, NotFound, Unavailable
from epd.stages.server_config import ServerConfig
from epd.video.types import SamplingOptions

TOOL = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}}
VIDEO = "data:video/mp4;base64,AAAA"


def parse(**body):
    return parse_responses_request({"model": "m", **body}, "m", SamplingOptions(), GenerationConfig())


def summary(answer: str, finish_reason: str = "stop") -> AskSummary:
    return AskSummary("r1", answer, [5, 6, 7], finish_reason, 0, 0, 4, {}, 0, False, "", [])


def whole(answer: AskSummary, request, thinking, created=None) -> dict:
    """The whole response of an answer that came in one step."""
    return response_body(answer, request, thinking, [TokenStep(answer.token_ids, answer.answer)], created)


def test_a_string_input_with_instructions_is_a_system_and_a_user_message():
    request = parse(input="hi", instructions="be brief", max_output_tokens=5, temperature=0.5, top_k=3)
    assert [(m.role, m.parts[0].text) for m in request.messages] == [("system", "be brief"), ("user", "hi")]
    assert request.generation.max_new_tokens == 5 and not request.generation.fit_max_new_tokens
    assert (request.generation.temperature, request.generation.top_k) == (0.5, 3)
    assert request.responses is not None and request.responses["instructions"] == "be brief"
    assert request.media_url == "" and not request.stream


def test_items_parts_video_and_tool_history():
    request = parse(
        input=[
            {"role": "developer", "content": [{"type": "input_text", "text": "sys"}]},
            {
                "type": "message",
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "what?"},
                    {"type": "video_url", "video_url": {"url": VIDEO}},
                ],
            },
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {"type": "function_call_output", "call_id": "c2", "output": "rain"},
            {"type": "reasoning", "summary": []},
        ],
        tools=[TOOL],
        tool_choice="none",
        media={"num_frames": 4},
    )
    roles = [m.role for m in request.messages]
    assert roles == ["system", "user", "assistant", "tool", "tool"]
    assert [p.type for p in request.messages[1].parts] == ["text", "video"]
    assert (request.media_url, request.modality, request.sampling.num_frames) == (VIDEO, "video", 4)
    assert [c.id for c in request.messages[2].tool_calls] == ["c1", "c2"]  # one turn's calls
    assert request.messages[3].tool_call_id == "c1"
    assert request.template.tools[0] == {
        "type": "function",
        "function": {k: v for k, v in TOOL.items() if k != "type"},
    }


def test_an_input_image_is_chats_image_part():
    request = parse(
        input=[
            {"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AA"}]}
        ]
    )
    assert (request.media_url, request.modality) == ("data:image/png;base64,AA", "image")


def test_a_named_function_and_text_format_are_chats():
    named = parse(input="hi", tools=[TOOL], tool_choice={"type": "function", "name": "get_weather"})
    assert (named.tool_choice.mode, named.tool_choice.function) == ("named", "get_weather")
    assert named.generation.structured_outputs is not None  # the function's parameters' grammar
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"format": {"type": "json_schema", "name": "a", "schema": schema, "strict": True}}
    structured = parse(input="hi", text=fmt).generation.structured_outputs
    assert structured is not None and json.loads(structured.json_schema) == schema
    assert parse(
        input="hi", text={"format": {"type": "json_object"}}
    ).generation.structured_outputs == StructuredOutputs(json_object=True)
    assert parse(input="hi", text={"format": {"type": "text"}}).generation.structured_outputs is None


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (
            {"input": "hi", "store": True},
            "'store': true is not supported.*epd keeps no responses.*VLLM_ENABLE",
        ),
        (
            {"input": "hi", "previous_response_id": "resp_1"},
            "'previous_response_id' is not supported: epd keeps no",
        ),
        ({"input": "hi", "conversation": "c"}, "'conversation' is not supported"),
        ({"input": "hi", "background": True}, "'background' is not supported"),
        # vLLM's bools, read as its pydantic reads them
        ({"input": "hi", "store": "yes"}, "'store': true is not supported"),
        ({"input": "hi", "store": "sometimes"}, "'store' must be true or false, got 'sometimes'"),
        ({"input": "hi", "background": "on"}, "'background' is not supported"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "'messages' is chat completions' field.*'input'"),
        ({"input": "hi", "max_tokens": 4}, "takes 'max_output_tokens'"),
        ({"input": "hi", "response_format": {"type": "json_object"}}, "takes 'text'"),
        ({}, "'input' must be a string or a non-empty list"),
        ({"input": []}, "'input' must be a string or a non-empty list"),
        ({"input": [{"type": "web_search_call"}]}, "input\\[0\\] has type 'web_search_call'"),
        ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "needs 'output'"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            "unsupported content part 'input_file'",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
            "needs 'image_url'.*no files API",
        ),
        (
            {"input": "hi", "tools": [{"type": "web_search"}]},
            "tools\\[0\\] has type 'web_search'.*hosted tools",
        ),
        ({"input": "hi", "tool_choice": {"type": "file_search"}}, "'tool_choice' must be"),
        (
            {"input": "hi", "tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}},
            "not in 'tools'",
        ),
        ({"input": "hi", "text": {"format": {"type": "xml"}}}, "text.format has type 'xml'"),
        ({"input": "hi", "text": "json"}, "'text' must be an object"),
        (
            {"input": "hi", "text": {"format": {"type": "json_schema", "name": "a"}}},
            "needs the schema in 'schema'",
        ),
        ({"input": "hi", "instructions": 3}, "'instructions' must be a string"),
        ({"input": "hi", "metadata": "x"}, "'metadata' must be an object"),
        ({"input": "hi", "reasoning": "high"}, "'reasoning' must be an object"),
        ({"input": "hi", "max_output_tokens": 0}, "'max_output_tokens' must be an integer from 1"),
        (
            {"input": "hi", "include": ["reasoning.encrypted_content", "web_search_call.results"]},
            "'include' value 'web_search_call.results' is not one this server takes; it takes "
            '"code_interpreter_call.outputs", .*"reasoning.encrypted_content"',
        ),
        ({"input": "hi", "include": "message.output_text.logprobs"}, "'include' must be a list of strings"),
        ({"input": "hi", "top_logprobs": "2.5"}, "'top_logprobs' must be an integer"),
        ({"input": [{"role": "robot", "content": "x"}]}, "message roles must be"),
        ({"input": "hi", "best_of": 2}, "'best_of' is not supported"),
        ({"input": "hi", "mm_processor_kwargs": {"fps": 1}}, 'frame sampling goes in "media"'),
    ],
)
def test_refusals_say_what_to_send(body, match):
    with pytest.raises(InvalidRequest, match=match):
        parse(**body)


@pytest.mark.parametrize(
    ("body", "name"),
    [
        ({"instructions": "be \ud800", "input": "hi"}, "instructions"),
        ({"input": "hi \ud800"}, "input"),
        ({"instructions": "x", "input": [{"role": "user", "content": "\ud800"}]}, "input[0].content"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "\ud800"}]}]},
            "input[0].content[1].text",
        ),
    ],
)  # fmt: skip
def test_a_text_chat_refuses_is_named_as_the_body_wrote_it(body, name):
    """Chat's refusal of a text (a lone surrogate no UTF-8 encoder takes) names the field the
    Responses body sent it in: 'instructions', not "'instructions text'"."""
    with pytest.raises(InvalidRequest) as refused:
        parse(**body)
    assert str(refused.value) == f"'{name}' is not valid Unicode text (it holds a lone surrogate escape)"


def _call(call_id: str, arguments: str = "{}", name: str = "get_weather") -> dict:
    return {"type": "function_call", "call_id": call_id, "name": name, "arguments": arguments}


@pytest.mark.parametrize(
    ("items", "message"),
    [
        # The instructions are message 0, one turn's calls one message: chat's messages[2].tool_calls[1].
        (
            [{"role": "user", "content": "hi"}, _call("c1"), _call("c2", "[1]")],
            "input[2].arguments must be a JSON object's text",
        ),
        ([{"role": "user", "content": "hi"}, _call("c1"), _call("c2", name="a b")], "input[2].name must be"),
        ([{"role": "user", "content": 3}], "input[0].content must be a string or a non-empty list"),
        # A reasoning item is no message: chat's messages[3] is input[4].
        (
            [
                {"type": "reasoning", "summary": []},
                {"role": "user", "content": "hi"},
                _call("c1"),
                _call("c2"),
                {"type": "function_call_output", "call_id": 3, "output": "x"},
            ],
            "input[4].call_id must be a string",
        ),
    ],
)
def test_chats_refusals_of_a_message_name_its_input_item(items, message):
    """Chat's checks name `messages[i]`; a Responses body has no messages, and its `input` index
    differs after `instructions` or merged function_call items: the 400 names the item."""
    with pytest.raises(InvalidRequest) as refused:
        parse(instructions="Be brief.", input=items)
    assert str(refused.value).startswith(message) and "messages[" not in str(refused.value)


@pytest.mark.parametrize(
    "body, match",
    [
        (  # after instructions (messages[1] in chat's request) and with input_text (chat's "text")
            {"instructions": "be brief", "input": [{"role": "user", "content": [{"type": "input_text"}]}]},
            "a text part of input\\[0\\] needs its text",
        ),
        (  # the second of a turn's calls (chat's messages[1].tool_calls[1].function.arguments)
            {
                "input": [
                    {"role": "user", "content": "hi"},
                    {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
                    {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": "{bad"},
                ],
                "tools": [TOOL],
            },
            "^input\\[2\\].arguments is not JSON text",
        ),
        (  # chat's messages[2].tool_call_id
            {
                "input": [
                    {"role": "user", "content": "hi"},
                    {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
                    {"type": "function_call_output", "call_id": 7, "output": "sunny"},
                ],
                "tools": [TOOL],
            },
            "^input\\[2\\].call_id must be a string",
        ),
        (  # chat's messages[1].tool_calls[0] without function.name
            {
                "input": [
                    {"role": "user", "content": "hi"},
                    {"type": "function_call", "call_id": "c1", "arguments": "{}"},
                ],
                "tools": [TOOL],
            },
            "^input\\[1\\] needs a string call_id, name and arguments",
        ),
    ],
)
def test_chats_refusals_name_the_input_item(body, match):
    """Chat's parser refuses the converted request: its message names the Responses body's item
    (input[k], its call_id and arguments), not the chat messages the body never had."""
    with pytest.raises(InvalidRequest, match=match):
        parse(**body)


def test_another_model_is_a_404_and_unknown_fields_are_logged(caplog):
    with pytest.raises(NotFound):
        parse_responses_request({"model": "x", "input": "hi"}, "m", SamplingOptions(), GenerationConfig())
    with caplog.at_level("WARNING"):
        parse(input="hi", store=False, prompt_cache_key="k", reasoning={"effort": "low"}, user="u")
    assert "ignored request fields ['prompt_cache_key']" in caplog.text
    parse(input="hi", store="no", background=0)  # vLLM's bools: "no" and 0 are false


def test_the_response_object():
    request = parse(input="hi", metadata={"k": "v"}, max_output_tokens=3)
    body = whole(summary("hello"), request, None, created=1)
    assert body["id"] == "resp_r1" and body["object"] == "response" and body["created_at"] == 1
    assert (body["status"], body["incomplete_details"], body["store"]) == ("completed", None, False)
    assert body["metadata"] == {"k": "v"} and body["max_output_tokens"] == 3
    (item,) = body["output"]
    assert item["type"] == "message" and item["role"] == "assistant" and item["id"].startswith("msg_")
    assert item["content"] == [{"type": "output_text", "text": "hello", "annotations": []}]
    assert body["usage"] == {
        "input_tokens": 4,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": 3,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 7,
    }
    assert item["status"] == "completed"
    cut = whole(summary("hel", "length"), request, None)
    assert (cut["status"], cut["incomplete_details"]) == ("incomplete", {"reason": "max_output_tokens"})


def test_the_item_max_output_tokens_cut_is_incomplete_as_openais():
    """OpenAI marks the cut message "incomplete" on the item as on the response; the items done
    before it stay "completed"."""
    request = parse(input="hi", max_output_tokens=3)
    (item,) = whole(summary("hel", "length"), request, None)["output"]
    assert (item["type"], item["status"]) == ("message", "incomplete")
    shaper = ResponseEvents(request, "r1", thinking=True)
    events = shaper.add("hmm</think>Su") + shaper.finish(summary("hmm</think>Su", "length"))
    done = [e["item"]["status"] for e in events if e["type"] == "response.output_item.done"]
    final = [i["status"] for i in events[-1]["response"]["output"]]
    assert done == final == ["completed", "incomplete"]


def test_reasoning_and_calls_are_items_in_order():
    request = parse(input="hi", tools=[TOOL], tool_choice="auto")
    text = 'think</think>ok <tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    body = whole(summary(text), request, thinking=True)
    kinds = [item["type"] for item in body["output"]]
    assert kinds == ["reasoning", "message", "function_call"]
    assert body["output"][0]["content"] == [{"type": "reasoning_text", "text": "think"}]
    assert body["output"][1]["content"][0]["text"] == "ok "
    call = body["output"][2]
    assert (call["name"], json.loads(call["arguments"]), call["status"]) == (
        "get_weather",
        {"city": "Rome"},
        "completed",
    )
    # OpenAI's forms, as vLLM's stream names them (not chat's "chatcmpl-tool-..." id)
    assert call["call_id"].startswith("call_") and call["id"].startswith("fc_")


def test_include_reasoning_false_leaves_the_reasoning_item_out():
    request = parse(input="hi", include_reasoning=False)
    body = whole(summary("think</think>ok"), request, thinking=True)
    assert [(i["type"], i["content"][0]["text"]) for i in body["output"]] == [("message", "ok")]


def test_a_named_call_has_no_message_item():
    request = parse(input="hi", tools=[TOOL], tool_choice={"type": "function", "name": "get_weather"})
    body = whole(summary('{"city": "Rome"}'), request, None)
    assert [(i["type"], i.get("arguments")) for i in body["output"]] == [
        ("function_call", '{"city": "Rome"}')
    ]


def test_streamed_events_join_into_the_whole_response():
    request = parse(input="hi", tools=[TOOL], tool_choice="auto", stream=True)
    text = 'hmm</think>Sure. <tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>'
    shaper = ResponseEvents(request, "r1", thinking=True, created=1)
    events = shaper.start()
    for i in range(0, len(text), 3):  # markers split across deltas
        events += shaper.add(text[i : i + 3])
    events += shaper.finish(summary(text))
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-1] == "response.completed"
    assert "response.reasoning_text.delta" in kinds and "response.function_call_arguments.done" in kinds
    final = events[-1]["response"]
    body = whole(summary(text), request, thinking=True, created=1)
    strip = [{k: v for k, v in i.items() if k not in ("id", "call_id")} for i in final["output"]]
    assert strip == [{k: v for k, v in i.items() if k not in ("id", "call_id")} for i in body["output"]]
    reasoning = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    content = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert (reasoning, content) == ("hmm", "Sure. ")
    added = [e["item"]["id"] for e in events if e["type"] == "response.output_item.added"]
    assert added == [i["id"] for i in final["output"]]  # each item's id the same from added to done


def _step(token_id: int, text: str) -> TokenStep:
    """One token's step, with its logprob (-token_id) and one most likely token."""
    top = (TopLogprob(0, "?", -0.5),)
    return TokenStep([token_id], text, logprobs=[TokenLogprob(token_id, text, -float(token_id), top)])


def _logprob(step: TokenStep, delta: bool = False) -> dict:
    """OpenAI's entry for `step`'s token: the output_text's, or (`delta`) a delta event's, without
    bytes. Its one top_logprobs entry is the sampled token itself, not the more likely "?": vLLM
    lists the sampled token first and takes the first k (k = 1 here), as chat does."""
    (lp,) = step.logprobs or ()
    entry = {"token": lp.token, "logprob": lp.logprob, "bytes": list(lp.token.encode())}
    if delta:
        return {
            "token": lp.token,
            "logprob": lp.logprob,
            "top_logprobs": [{"token": lp.token, "logprob": lp.logprob}],
        }
    return {**entry, "top_logprobs": [entry]}


def test_logprobs_go_on_the_output_text_and_its_deltas():
    """include: ["message.output_text.logprobs"] with top_logprobs (vLLM's): the message's text
    carries its tokens' logprobs, each delta event its own; the reasoning's tokens (markers too)
    have none, as a reasoning item has no place for them, and are counted as reasoning tokens
    (markers left out, as vLLM) in the same pass."""
    request = parse(input="hi", include=["message.output_text.logprobs"], top_logprobs=1, stream=True)
    assert request.generation.logprobs == 1
    steps = [_step(1, "hm"), _step(2, "m"), _step(3, "</think>"), _step(4, "Su"), _step(5, "re")]
    shaper = ResponseEvents(request, "r1", thinking=True)
    events = [e for s in steps for e in shaper.add(s.text, s.token_ids, s.logprobs)]
    events += shaper.finish(summary("hmm</think>Sure"))
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert [d["logprobs"] for d in deltas] == [[_logprob(steps[3], True)], [_logprob(steps[4], True)]]
    (done,) = [e for e in events if e["type"] == "response.output_text.done"]
    response = events[-1]["response"]
    text = response["output"][1]["content"][0]
    assert text["logprobs"] == [_logprob(steps[3]), _logprob(steps[4])]
    assert done["logprobs"] == [_logprob(steps[3], True), _logprob(steps[4], True)]  # the event's form
    assert response["top_logprobs"] == 1
    assert response["usage"]["output_tokens_details"] == {"reasoning_tokens": 2}
    body = response_body(summary("hmm</think>Sure"), request, True, steps)  # the whole answer: the same
    assert body["output"][1]["content"] == response["output"][1]["content"]
    assert body["usage"]["output_tokens_details"] == {"reasoning_tokens": 2}


def _tokens_step(texts: list[str], text: str) -> TokenStep:
    """A step of several tokens (`texts`, each decoded alone, ids from 10 on) that made `text`."""
    ids = [10 + sum(map(len, texts[:i])) for i in range(len(texts))]
    return TokenStep(
        ids, text, logprobs=[TokenLogprob(i, t, -float(i)) for i, t in zip(ids, texts, strict=True)]
    )


def test_a_step_that_ends_the_block_gives_its_content_tokens_logprobs_to_the_message():
    """A step of several tokens that begins inside the thinking block and ends it: the tokens
    after `</think>`'s are the message's, their logprobs those chat gives for the same tokens
    (they were all dropped with the step's reasoning). A content token whose character is not
    whole yet gives its logprob to the delta that sends the character; content tokens that come
    before their text (decode held it back) give theirs to the delta that sends it."""
    request = parse(input="hi", include=["message.output_text.logprobs"], stream=True)
    steps = [
        _tokens_step(["hm", "</think>", "\ufffd"], "hm</think>"),  # half of "é": no content text yet
        _tokens_step(["\ufffd", "Su", "re"], "éSure"),
        _tokens_step([" a", "</think>"], " a</think>"),  # a second </think> is content
    ]
    want = chat_logprobs([lp for s in steps for lp in s.logprobs or ()])["content"]
    shaper = ResponseEvents(request, "r1", thinking=True)
    events = [e for s in steps for e in shaper.add(s.text, s.token_ids, s.logprobs)]
    events += shaper.finish(summary("hm</think>éSure a</think>"))
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert [d["delta"] for d in deltas] == ["éSure", " a</think>"]
    delta_logprobs = [[lp["token"] for lp in d["logprobs"]] for d in deltas]
    assert delta_logprobs == [["\ufffd", "\ufffd", "Su", "re"], [" a", "</think>"]]
    text = events[-1]["response"]["output"][1]["content"][0]
    assert text["logprobs"] == want[2:]  # chat's entries for the message's tokens
    assert [lp for d in deltas for lp in d["logprobs"]] == [
        {k: v for k, v in lp.items() if k != "bytes"} for lp in want[2:]
    ]
    body = response_body(summary("hm</think>éSure a</think>"), request, True, steps)  # whole: the same
    assert body["output"][1]["content"][0]["logprobs"] == want[2:]

    # A stop string that begins with "</think>" makes decode hold text back: the text lags the
    # tokens, so content tokens come while the text is still reasoning; they wait for it.
    lagging = [
        _tokens_step(["hm"], ""),
        _tokens_step(["</think>"], "hm"),
        _tokens_step(["Su"], ""),
        _tokens_step(["re"], "</think>Sure"),
    ]
    shaper = ResponseEvents(request, "r2", thinking=True)
    events = [e for s in lagging for e in shaper.add(s.text, s.token_ids, s.logprobs)]
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert [(d["delta"], [lp["token"] for lp in d["logprobs"]]) for d in deltas] == [("Sure", ["Su", "re"])]


def test_a_stop_strings_tokens_keep_their_logprobs_on_the_message():
    """stop "END": decode holds " E" back (it may begin the stop string), then "ND" completes it and
    the held text is cut. Neither token made text the message got, yet vLLM's whole message (every
    output token's, `_create_response_logprobs` of the whole token_ids) and chat (vLLM's and epd's)
    keep their logprobs: so do the message's output_text, its done event and, on a last delta of
    no text, the stream."""
    request = parse(input="hi", include=["message.output_text.logprobs"], stop="END", stream=True)
    steps = [_step(1, "Hi"), _tokens_step([" E"], ""), _tokens_step(["ND"], "")]
    want = chat_logprobs([lp for s in steps for lp in s.logprobs or ()])["content"]
    body = response_body(summary("Hi"), request, None, steps)
    assert body["output"][0]["content"][0]["logprobs"] == want
    assert body["output"][0]["content"][0]["text"] == "Hi"

    shaper = ResponseEvents(request, "r1", thinking=None)
    events = [e for s in steps for e in shaper.add(s.text, s.token_ids, s.logprobs)]
    events += shaper.finish(summary("Hi"))
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert [(d["delta"], len(d["logprobs"])) for d in deltas] == [("Hi", 1), ("", 2)]
    (done,) = [e for e in events if e["type"] == "response.output_text.done"]
    assert done["logprobs"] == [lp for d in deltas for lp in d["logprobs"]]
    assert done["text"] == "Hi"
    assert events[-1]["response"]["output"][0]["content"][0]["logprobs"] == want

    # An answer whose every token the stop string cut has no message, vLLM's neither: nothing to carry them.
    body = response_body(summary(""), request, None, steps[1:])
    assert body["output"] == []


def test_held_back_text_takes_its_tokens_logprobs_to_the_delta_that_releases_it():
    """Under "auto" tools, "<" may begin a call: held back, its token's logprob waits and goes
    with the delta that sends it once it is content; a call's tokens have none."""
    request = parse(input="hi", include=["message.output_text.logprobs"], tools=[TOOL], tool_choice="auto")
    call = '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>'
    steps = [_step(1, "a "), _step(2, "<"), _step(3, "b"), _step(4, call)]
    shaper = ResponseEvents(request, "r1", thinking=None)
    deltas = [shaper.add(s.text, s.token_ids, s.logprobs) for s in steps]
    sent = [[e["logprobs"] for e in d if e["type"] == "response.output_text.delta"] for d in deltas]
    assert sent == [
        [[_logprob(steps[0], True)]],
        [],
        [[_logprob(steps[1], True), _logprob(steps[2], True)]],
        [],
    ]
    response = shaper.finish(summary("a <b" + call))[-1]["response"]
    message, function_call = response["output"]
    assert message["content"][0]["logprobs"] == [_logprob(s) for s in steps[:3]]
    assert function_call["type"] == "function_call" and "logprobs" not in function_call


def test_the_include_values_vllm_takes_are_accepted_and_give_nothing_more():
    """vLLM's request takes six `include` values; a client that always sends one (Codex:
    "reasoning.encrypted_content") was refused with a 400. The five but the logprobs ask for
    what epd has none of: the answer is the one without them."""
    others = [
        "code_interpreter_call.outputs",
        "computer_call_output.output.image_url",
        "file_search_call.results",
        "message.input_image.image_url",
        "reasoning.encrypted_content",
    ]
    request = parse(input="hi", include=others)
    assert request.generation == parse(input="hi").generation
    assert request.generation.logprobs is None
    with_logprobs = parse(input="hi", include=[*others, "message.output_text.logprobs"])
    assert with_logprobs.generation.logprobs == 0


def test_without_include_no_logprobs_are_asked_or_sent():
    """vLLM reads top_logprobs only with the logprobs `include`: without it, any integer asks for
    nothing (it was a 400 above 0); with it, one out of range is chat's 400."""
    for top in (0, 2, 50, -1):
        assert parse(input="hi", top_logprobs=top).generation.logprobs is None
    with pytest.raises(InvalidRequest, match="'top_logprobs' must be an integer from 0"):
        parse(input="hi", top_logprobs=-1, include=["message.output_text.logprobs"])
    request = parse(input="hi", top_logprobs=2)
    body = whole(summary("hello"), request, None)
    assert body["top_logprobs"] is None and "logprobs" not in body["output"][0]["content"][0]


def test_top_logprobs_is_read_as_vllms_int_with_or_without_the_include():
    """vLLM's request types top_logprobs `int`, which pydantic's lax mode reads from 2.0, "2" and
    true (1) too: taken here as there, ignored without the include; 2.5 or "two" is a 400 either way."""
    for top, k in ((2.0, 2), ("2", 2), (" 3 ", 3), (True, 1), ("1_0", 10)):
        assert parse(input="hi", top_logprobs=top).generation.logprobs is None
        assert (
            parse(input="hi", top_logprobs=top, include=["message.output_text.logprobs"]).generation.logprobs
            == k
        )
    for bad in (2.5, "2.5", "two", [2], {"k": 2}):
        for include in ([], ["message.output_text.logprobs"]):
            with pytest.raises(InvalidRequest, match="'top_logprobs' must be an integer"):
                parse(input="hi", top_logprobs=bad, include=include)


GONE = {"error": {"message": "gone", "type": "server_error", "param": None, "code": 502}}


def test_an_error_event_carries_the_error_name_and_the_next_sequence_number():
    """OpenAI's ResponseErrorEvent has a string (or null) `code`: the HTTP status as a number, chat's
    error body's, failed a typed client's parse of the event."""
    shaper = ResponseEvents(parse(input="hi"), "r1", None)
    shaper.start()
    error, failed = shaper.failed(GONE)
    assert error == {
        "type": "error",
        "sequence_number": 2,
        "code": "server_error",
        "message": "gone",
        "param": None,
    }
    ResponseErrorEvent.model_validate(error)  # the openai SDK's own type of the event
    assert (failed["type"], failed["sequence_number"]) == ("response.failed", 3)
    assert (failed["response"]["status"], failed["response"]["error"]) == (
        "failed",
        {"code": "server_error", "message": "gone"},
    )


def test_a_failure_before_any_token_sends_response_created_first():
    """After a keep-alive (the 200 out) and before the first token: the stream still opens with
    response.created and .in_progress, as OpenAI's always does."""
    kinds = [e["type"] for e in ResponseEvents(parse(input="hi"), "r1", None).failed(GONE)]
    assert kinds == ["response.created", "response.in_progress", "error", "response.failed"]


class FailsAfterOneToken(Pipeline):
    """A pipeline whose stage fails after the first token (what a decode replica lost mid-answer
    makes): the HTTP layer's handling of it is under test, not the stages."""

    def __init__(self) -> None:
        super().__init__(None, None, None)  # type: ignore[arg-type]

    async def ask(self, req):  # type: ignore[override]
        yield TokenStep([7], "a")
        raise Unavailable("decode went away")


async def _post_responses(pipeline: Pipeline, body: dict, keepalive_s: float = 15.0) -> tuple[int, str]:
    config = GatewayConfig(
        server=ServerConfig(port=0), http=HttpApiConfig(port=0, sse_keepalive_s=keepalive_s)
    )
    http = await start_http_api(config, pipeline, GatewayMetrics())
    try:
        async with aiohttp.ClientSession() as session:
            async with session.post(
                f"http://127.0.0.1:{http.port}/v1/responses",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            ) as resp:
                return resp.status, (await resp.read()).decode()
    finally:
        await http.stop()


def test_a_stream_that_fails_after_its_200_ends_with_an_error_event():
    status, text = asyncio.run(_post_responses(FailsAfterOneToken(), {"input": "hi", "stream": True}))
    assert status == 200
    frames = [frame.splitlines() for frame in text.strip().split("\n\n")]
    kinds = [lines[0].removeprefix("event: ") for lines in frames]
    events = [json.loads(lines[1].removeprefix("data: ")) for lines in frames]
    assert kinds == [e["type"] for e in events]  # each event named by its type
    assert kinds[-3:] == ["response.output_text.delta", "error", "response.failed"] and "[DONE]" not in text
    error = events[-2]
    assert (
        error["code"] == "service_unavailable"  # a 503's name: OpenAI's code is a string
        and "decode went away" in error["message"]
        and "request id " in error["message"]
    )
    ResponseErrorEvent.model_validate(error)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


class FailsAtOnce(Pipeline):
    def __init__(self) -> None:
        super().__init__(None, None, None)  # type: ignore[arg-type]

    async def ask(self, req):  # type: ignore[override]
        raise Unavailable("decode went away")
        yield  # an async generator, as the pipeline's


class FailsAfterAKeepAlive(Pipeline):
    """Fails before its first token, but only after the keep-alive sent the 200 (a long encode
    that then failed)."""

    def __init__(self) -> None:
        super().__init__(None, None, None)  # type: ignore[arg-type]

    async def ask(self, req):  # type: ignore[override]
        await asyncio.sleep(0.5)
        raise Unavailable("decode went away")
        yield  # an async generator, as the pipeline's


def test_a_stream_failing_after_a_keep_alive_opens_with_response_created_and_ends_failed():
    body = {"input": "hi", "stream": True}
    status, text = asyncio.run(_post_responses(FailsAfterAKeepAlive(), body, keepalive_s=0.05))
    assert status == 200 and text.startswith(": keep-alive\n\n")
    frames = [f.splitlines() for f in text.strip().split("\n\n") if not f.startswith(": keep-alive")]
    events = [json.loads(lines[1].removeprefix("data: ")) for lines in frames]
    kinds = [e["type"] for e in events]
    assert kinds == ["response.created", "response.in_progress", "error", "response.failed"]
    assert [e["sequence_number"] for e in events] == [0, 1, 2, 3]
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and "decode went away" in failed["error"]["message"]


def test_a_failure_before_the_first_token_is_its_own_status():
    for stream in (False, True):
        status, text = asyncio.run(_post_responses(FailsAtOnce(), {"input": "hi", "stream": stream}))
        assert status == 503 and json.loads(text)["error"]["code"] == 503


LEAF = st.one_of(st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.floats(), st.text(max_size=12))
ANY = st.recursive(
    LEAF,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=12,
)
PART = st.fixed_dictionaries(
    {"type": st.sampled_from(["input_text", "output_text", "input_image", "video_url", "input_file", "x"])},
    optional={"text": ANY, "image_url": ANY, "video_url": ANY},
)
ITEM = st.fixed_dictionaries(
    {},
    optional={
        "type": st.sampled_from(["message", "function_call", "function_call_output", "reasoning", "x"]),
        "role": st.sampled_from(["user", "system", "developer", "assistant", "tool", "x"]),
        "content": st.one_of(st.text(max_size=8), st.lists(PART, max_size=2), ANY),
        "call_id": ANY,
        "name": ANY,
        "arguments": ANY,
        "output": ANY,
    },
)
BODY = st.fixed_dictionaries(
    {"input": st.one_of(st.text(max_size=8), st.lists(ITEM, max_size=3), ANY)},
    optional={
        name: ANY
        for name in (
            "instructions",
            "tools",
            "tool_choice",
            "text",
            "reasoning",
            "metadata",
            "store",
            "max_output_tokens",
            "temperature",
            "stream",
            "parallel_tool_calls",
            "user",
            "include",
            "top_logprobs",
        )
    },  # fmt: skip
)


@settings(max_examples=300, derandomize=True, deadline=None, database=None)
@given(body=BODY)
def test_any_body_parses_or_is_a_400_and_its_answer_shapes(body):
    """Whatever the JSON, a request or a clear 400: never another exception (a 500)."""
    try:
        request = parse(**body)
    except InvalidRequest as exc:
        assert str(exc)
        return
    json.dumps(whole(summary("x</think>y"), request, thinking=True))


def test_a_call_cut_after_its_name_is_text_in_the_whole_response_as_in_chats():
    """max_output_tokens cuts a call inside its arguments: the whole response keeps the block as
    the message's text (chat's whole answer, `answer_tool_calls`), not a function_call item whose
    arguments do not parse; the stream, which sent the name already, keeps its call."""
    request = parse(input="hi", tools=[TOOL], tool_choice="auto")
    text = 'ok <tool_call>\n{"name": "get_weather", "arguments": {"city": "Ro'
    body = whole(summary(text, "length"), request, None)
    assert body["status"] == "incomplete"
    assert [(i["type"], i["content"][0]["text"]) for i in body["output"]] == [("message", text)]
    shaper = ResponseEvents(request, "r1", None)
    events = shaper.add(text) + shaper.finish(summary(text, "length"))
    assert [i["type"] for i in events[-1]["response"]["output"]] == ["message", "function_call"]
