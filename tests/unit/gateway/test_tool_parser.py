"""vLLM's `hermes` tool call parser (`epd.gateway.tool_parser`): the `<tool_call>` JSON objects of
an answer become calls and the text outside them the content, whole and as a stream of deltas
(which must part it exactly as the whole text, wherever the deltas cut it); malformed calls stay
content; the answer's message and finish reason under each tool choice."""

from __future__ import annotations

import itertools
import json

import pytest

from epd.gateway.openai_protocol import completion_body
from epd.gateway.pipeline import AskSummary
from epd.gateway.tool_parser import (
    ParsedToolCall,
    ToolAnswerStream,
    ToolCallStream,
    answer_tool_calls,
    parse_tool_calls,
)
from epd.gateway.tool_request import ToolChoice

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL_B = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET", "n": [1, 2]}}\n</tool_call>'
ANSWERS = {
    # text -> (content, [(name, arguments)])
    CALL: (None, [("get_weather", '{"city": "Paris"}')]),
    "Let me look.\n" + CALL: ("Let me look.\n", [("get_weather", '{"city": "Paris"}')]),
    CALL + "\n" + CALL_B: (None, [("get_weather", '{"city": "Paris"}'), ("get_time", '{"zone": "CET", "n": [1, 2]}')]),
    CALL + "\nDone.": ("\nDone.", [("get_weather", '{"city": "Paris"}')]),
    "no call here, only <tool text": ("no call here, only <tool text", []),
    "  ": ("  ", []),
    "<tool_call>\n{not json}\n</tool_call>": ("<tool_call>\n{not json}\n</tool_call>", []),
    '<tool_call>{"name": "f"}</tool_call>' + CALL: ('<tool_call>{"name": "f"}</tool_call>', [("get_weather", '{"city": "Paris"}')]),
    '<tool_call>\n{"name": "f", "arguments": {"a": "é"}}': (None, [("f", '{"a": "é"}')]),  # cut before </tool_call>
    '<tool_call>\n{"name": "f", "argu': ('<tool_call>\n{"name": "f", "argu', []),  # cut mid-JSON
}  # fmt: skip


def _whole(text: str) -> tuple[str | None, list[tuple[str, str]]]:
    split = parse_tool_calls(text)
    return split.content, [(c.name, c.arguments) for c in split.calls]


def _streamed(deltas: list[str]) -> tuple[str | None, list[tuple[str, str]]]:
    stream = ToolCallStream()
    items = [item for d in deltas for item in stream.add(d)] + stream.finish()
    calls = [(i.name, i.arguments) for i in items if isinstance(i, ParsedToolCall)]
    content = "".join(i for i in items if isinstance(i, str))
    return (content or None) if calls else content, calls


def _cuts(text: str, num_cuts: int):
    for points in itertools.combinations(range(1, len(text)), num_cuts):
        bounds = (0, *points, len(text))
        yield [text[a:b] for a, b in itertools.pairwise(bounds)]


@pytest.mark.parametrize("text", list(ANSWERS))
def test_calls_are_parsed_out_of_a_whole_answer(text):
    assert _whole(text) == ANSWERS[text]


def test_a_call_has_vllms_id_and_shape():
    call = parse_tool_calls(CALL).calls[0]
    assert call.id.startswith("chatcmpl-tool-") and len(call.id) == len("chatcmpl-tool-") + 32
    assert call.to_json() == {
        "id": call.id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    assert parse_tool_calls(CALL + CALL).calls[0].id != parse_tool_calls(CALL).calls[0].id


@pytest.mark.parametrize("text", list(ANSWERS))
def test_the_stream_parts_an_answer_as_the_whole_text_wherever_the_deltas_cut_it(text):
    """One delta, one character at a time, and every cut into two (and three, for short texts):
    a tag split across deltas (`<tool` + `_call>`) is found, and the parts are the whole text's."""
    cuts = [[text], list(text), *_cuts(text, 1), *(_cuts(text, 2) if len(text) < 40 else [])]
    for deltas in cuts:
        assert _streamed(deltas) == ANSWERS[text], deltas


def test_a_delta_holds_back_only_what_could_begin_a_tag_and_sends_a_call_when_it_closes():
    stream = ToolCallStream()
    assert stream.add("Sure. <tool") == ["Sure. "]  # "<tool" waits
    assert stream.add('_call>{"name": "f", ') == []
    (call,) = stream.add('"arguments": {}}</tool_call>\n')
    assert (call.name, call.arguments) == ("f", "{}")
    assert stream.add("\n") == []  # whitespace after a call waits: it may be all there is
    assert stream.add("ok") == ["\n\nok"]
    assert stream.finish() == []


FUNCTIONS = ToolChoice("named", "get_weather")


def test_a_named_functions_answer_streams_its_arguments_as_they_come():
    stream = ToolAnswerStream(FUNCTIONS)
    first = stream.add('{"city"')
    assert first[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert first[0]["tool_calls"][0]["id"].startswith("chatcmpl-tool-")
    assert first[1:] == [{"tool_calls": [{"index": 0, "function": {"arguments": '{"city"'}}]}]
    assert stream.add(': "Paris"}') == [
        {"tool_calls": [{"index": 0, "function": {"arguments": ': "Paris"}'}}]}
    ]
    assert stream.finish() == []
    assert answer_tool_calls('{"city": "Paris"}', FUNCTIONS)[0] == ""


def test_required_answers_are_read_at_the_end_and_a_cut_array_stays_content():
    stream = ToolAnswerStream(ToolChoice("required"))
    text = (
        '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]'
    )
    assert stream.add(text[:10]) == [] and stream.add(text[10:]) == []
    deltas = stream.finish()
    assert [d["tool_calls"][0]["index"] for d in deltas] == [0, 0, 1, 1]
    assert [d["tool_calls"][0]["function"] for d in deltas[1::2]] == [
        {"arguments": '{"city": "Paris"}'},
        {"arguments": "{}"},
    ]
    assert stream.num_calls == 2
    cut = ToolAnswerStream(ToolChoice("required"))
    cut.add(text[:30])
    assert (cut.finish(), cut.num_calls) == ([{"content": text[:30]}], 0)
    assert answer_tool_calls(text[:30], ToolChoice("required")) == (text[:30], [])


def _summary(answer: str, finish: str = "stop") -> AskSummary:
    return AskSummary("r1", answer, [5, 6, 7], finish, 0, 0, 3, {}, 0, False, "", [])


@pytest.mark.parametrize(
    ("choice", "answer", "finish", "want"),
    [
        (ToolChoice("auto"), "Let me look.\n" + CALL, "stop", ("Let me look.\n", "tool_calls", 1)),
        (ToolChoice("auto"), "It is sunny.", "stop", ("It is sunny.", "stop", 0)),
        (ToolChoice("none"), CALL, "stop", (CALL, "stop", 0)),  # shown the tools, not parsed
        (FUNCTIONS, '{"city": "Paris"}', "stop", ("", "stop", 1)),  # vLLM keeps a named call's reason
        (
            ToolChoice("required"),
            '[{"name": "get_weather", "parameters": {}}]',
            "stop",
            ("", "tool_calls", 1),
        ),
        (ToolChoice("required"), '[{"name": "get_weather", "parameters": {}}]', "length", ("", "length", 1)),
    ],
)
def test_the_answers_message_holds_the_calls_with_vllms_finish_reason(choice, answer, finish, want):
    choice_json = completion_body(_summary(answer, finish), "epd", tool_choice=choice)["choices"][0]
    message = choice_json["message"]
    assert (message["content"], choice_json["finish_reason"], len(message.get("tool_calls", []))) == want
    for call in message.get("tool_calls", []):
        assert call["type"] == "function" and json.loads(call["function"]["arguments"]) is not None


def test_with_the_reasoning_parser_the_calls_are_taken_from_the_content_alone():
    answer = "I should call " + CALL + "</think>" + CALL_B
    message = completion_body(_summary(answer), "epd", thinking=True, tool_choice=ToolChoice("auto"))[
        "choices"
    ][0]["message"]
    assert message["reasoning"] == "I should call " + CALL
    assert (message["content"], [c["function"]["name"] for c in message["tool_calls"]]) == (
        None,
        ["get_time"],
    )


def test_without_parallel_tool_calls_the_first_call_alone_is_kept():
    """OpenAI's `parallel_tool_calls: false` (vLLM keeps the first call): it was ignored."""
    single = ToolChoice("auto", parallel=False)
    content, calls = answer_tool_calls(CALL + "\n" + CALL_B, single)
    assert (content, [c.name for c in calls]) == (None, ["get_weather"])
    stream = ToolAnswerStream(single)
    deltas = stream.add(CALL + "\n" + CALL_B) + stream.finish()
    assert [d["tool_calls"][0]["index"] for d in deltas] == [0, 0] and stream.num_calls == 1
    array = '[{"name": "get_weather", "parameters": {}}, {"name": "get_time", "parameters": {}}]'
    assert len(answer_tool_calls(array, ToolChoice("required", parallel=False))[1]) == 1


@pytest.mark.parametrize(
    ("choice", "answer", "want_calls"),
    [
        (FUNCTIONS, '{"city": "Paris"}', [("get_weather", '{"city": "Paris"}')]),
        (ToolChoice("required"), '[{"name": "get_time", "parameters": {}}]', [("get_time", "{}")]),
        (ToolChoice("auto"), CALL, [("get_weather", '{"city": "Paris"}')]),
    ],
)
def test_an_echo_goes_in_front_of_the_content_not_into_the_calls(choice, answer, want_calls):
    """As vLLM's (and as the stream sends it, an echo's chunk of its own): the calls are read from
    the generated text alone, the echoed message's text is the content's start. A named function's
    arguments began with the echo, and "required"'s array, the echo before it, was no call at all."""
    echoed = "The weather:"
    for thinking in (None, False):
        choice_json = completion_body(
            _summary(answer), "epd", echoed=echoed, thinking=thinking, tool_choice=choice
        )["choices"][0]
        message = choice_json["message"]
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]
        assert (message["content"], calls) == (echoed, want_calls)
        assert choice_json["finish_reason"] == ("stop" if choice.mode == "named" else "tool_calls")
