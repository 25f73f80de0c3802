"""The answer of a Responses API request: the `response` object, its output items (reasoning,
message, function calls) in order, and its streamed events, which carry the same items."""

from __future__ import annotations

import json
from dataclasses import replace

from epd.gateway.responses_events import ResponseEvents
from tests.unit.gateway.responses_bodies import TOOL, parse, summary, whole


def test_the_response_object():
    request = parse(input="hi", metadata={"k": "v"}, max_output_tokens=3)
    # A prompt of 4 tokens: 1 read from prefill's prefix cache, the 3 after it written there.
    body = whole(replace(summary("hello"), num_reused_prompt_tokens=1, num_stored_prompt_tokens=3), request,
                 None, created=1)  # fmt: skip
    assert body["id"] == "resp_r1" and body["object"] == "response" and body["created_at"] == 1
    assert (body["status"], body["incomplete_details"], body["store"]) == ("completed", None, False)
    assert body["metadata"] == {"k": "v"} and body["max_output_tokens"] == 3
    (item,) = body["output"]
    assert item["type"] == "message" and item["role"] == "assistant" and item["id"].startswith("msg_")
    assert item["content"] == [{"type": "output_text", "text": "hello", "annotations": []}]
    assert body["usage"] == {
        "input_tokens": 4,
        "input_tokens_details": {"cached_tokens": 1, "cache_write_tokens": 3},
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
