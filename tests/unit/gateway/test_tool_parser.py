"""vLLM's `hermes` and `qwen3_coder` tool call parsers (`epd.gateway.tool_parsers`): the
`<tool_call>` blocks of an answer become calls and the text outside them the content, whole and
as a stream of deltas (which must part it exactly as the whole text, wherever the deltas cut it,
the fragments of a call's arguments joining to the whole answer's arguments); malformed calls stay
content; a call cut after its name went out stays sent (vLLM's stream); the answer's message and
finish reason under each tool choice."""

from __future__ import annotations

import itertools
import json

import pytest

from epd.gateway.ask_types import AskSummary
from epd.gateway.chat_answer import completion_body
from epd.gateway.tool_parsers import markers
from epd.gateway.tool_parsers.answer import ToolAnswerStream, answer_tool_calls, tool_finish_reason
from epd.gateway.tool_parsers.calls import ArgumentsFragment, ParsedToolCall, ToolCallHeader
from epd.gateway.tool_parsers.qwen3_coder import parameter_value
from epd.gateway.tool_parsers.stream import ToolCallStream, parse_tool_calls
from epd.gateway.tool_request import ToolChoice
from epd.stages.contracts import TokenStep


class _AnyId(str):
    def __eq__(self, other: object) -> bool:
        return isinstance(other, str) and other.startswith("chatcmpl-tool-")

    __hash__ = str.__hash__


ANY_ID = _AnyId()
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
    # The arguments as json.dumps writes them, whatever the model's spacing and escapes.
    '<tool_call>{"name":"f","arguments":{"a":[1,2.50,1E2,-0,{"b":null}],"c":"\\u00e9\\n\\"\\ud83d\\ude00","d":true}}</tool_call>':
        (None, [("f", '{"a": [1, 2.5, 100.0, 0, {"b": null}], "c": "é\\n\\"😀", "d": true}')]),
    '<tool_call>{"arguments": {"x": 1}, "name": "f"}</tool_call>': (None, [("f", '{"x": 1}')]),  # sent whole
    '<tool_call>{"name": "f", "arguments": {}}</tool_call>': (None, [("f", "{}")]),
    # A repeated key is kept, as the stream sent it (json.loads would keep the last alone).
    '<tool_call>{"name": "f", "arguments": {"a": 1, "a": 2}}</tool_call>': (None, [("f", '{"a": 1, "a": 2}')]),
    # Cut by max_tokens mid-arguments, or broken after them: content, as vLLM's whole answer.
    '<tool_call>\n{"name": "f", "arguments": {"city": "Par': ('<tool_call>\n{"name": "f", "arguments": {"city": "Par', []),
    '<tool_call>{"name": "f", "arguments": {"n": 12': ('<tool_call>{"name": "f", "arguments": {"n": 12', []),
    'a <tool_call>{"name": "f", "arguments": {"a": 1} x}</tool_call>': ('a <tool_call>{"name": "f", "arguments": {"a": 1} x}</tool_call>', []),
}  # fmt: skip
STREAMED = {
    # Streamed, such a call's name and arguments went out as they came: sent, they stay (vLLM's).
    '<tool_call>\n{"name": "f", "arguments": {"city": "Par': (None, [("f", '{"city": "Par')]),
    '<tool_call>{"name": "f", "arguments": {"n": 12': (None, [("f", '{"n": 12')]),
    'a <tool_call>{"name": "f", "arguments": {"a": 1} x}</tool_call>': ("a ", [("f", '{"a": 1}')]),
}  # fmt: skip


def _whole(text: str) -> tuple[str | None, list[tuple[str, str]]]:
    split = parse_tool_calls(text)
    return split.content, [(c.name, c.arguments) for c in split.calls]


def _streamed(
    deltas: list[str], parser: str = "hermes", tools: tuple = ()
) -> tuple[str | None, list[tuple[str, str]]]:
    """The calls a client builds from the stream's items (a header, then fragments; or a whole call)."""
    stream = ToolCallStream(parser, tools)
    items = [item for d in deltas for item in stream.add(d)] + stream.finish()
    calls: list[list[str]] = []
    for item in items:
        if isinstance(item, ParsedToolCall):
            calls.append([item.name, item.arguments])
        elif isinstance(item, ToolCallHeader):
            calls.append([item.name, ""])
        elif isinstance(item, ArgumentsFragment):
            assert item.text and calls
            calls[-1][1] += item.text
    content = "".join(i for i in items if isinstance(i, str))
    assert stream.num_calls == len(calls)
    return (content or None) if calls else content, [(name, arguments) for name, arguments in calls]


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
        assert _streamed(deltas) == STREAMED.get(text, ANSWERS[text]), deltas


@pytest.mark.parametrize(
    "arguments",
    [
        '{"a": {"b": [[], {}, [1, [2]]]}, "c": ""}',
        '{ "x" : -1.5e-3 , "y" : [ true , false , null ] }',
        '{"s": "tab\\there \\/ \\u0001 \\\\ ü \\u20ac"}',
        '{"big": 123456789012345678901234567890, "f": 0.1}',
    ],
)
def test_the_streamed_arguments_join_to_json_dumps_of_the_arguments(arguments):
    text = '<tool_call>{"name": "f", "arguments": ' + arguments + "}</tool_call>"
    want = json.dumps(json.loads(arguments), ensure_ascii=False)
    assert _whole(text) == (None, [("f", want)])
    for deltas in [list(text), *_cuts(text, 1)]:
        assert _streamed(deltas) == (None, [("f", want)]), deltas


def test_a_hermes_call_streams_its_name_then_its_arguments_as_they_are_written():
    """vLLM's hermes stream: the name once read, then the arguments' text as it grows (before
    `</tool_call>` arrives)."""
    stream = ToolCallStream()
    assert stream.add('<tool_call>\n{"name": "get_weather", "argu') == []
    header, fragment = stream.add('ments": {"city": "Pa')
    assert (header.name, fragment.text) == ("get_weather", '{"city": "Pa')
    assert header.id.startswith("chatcmpl-tool-")
    assert stream.add("r") == [ArgumentsFragment("r")]
    assert stream.add('is", "days": 1') == [ArgumentsFragment('is", "days": ')]  # 1 may go on: 10
    assert stream.add("0}}\n</tool") == [ArgumentsFragment("10}")]
    assert stream.add("_call>") == [] and stream.finish() == [] and stream.num_calls == 1


def test_a_delta_holds_back_only_what_could_begin_a_tag():
    stream = ToolCallStream()
    assert stream.add("Sure. <tool") == ["Sure. "]  # "<tool" waits
    assert stream.add('_call>{"name": "f", ') == []
    header, fragment = stream.add('"arguments": {}}</tool_call>\n')
    assert (header.name, fragment.text) == ("f", "{}")
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


REQUIRED = (
    '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]'
)
REQUIRED_ANSWERS = {
    # "required"'s answer (the grammar's array) -> (content, [(name, arguments)]), whole
    REQUIRED: ("", [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]),
    # The parameters as json.dumps writes them, whatever the grammar's spacing and escapes.
    '[{"name":"f","parameters":{"a":[1,2.50,{"b":null}],"s":"\\u00e9\\n","t":true}}]':
        ("", [("f", '{"a": [1, 2.5, {"b": null}], "s": "é\\n", "t": true}')]),
    '[\n  {\n    "name": "f",\n    "parameters": {"x": [1, -0.5]}\n  }\n]\n': ("", [("f", '{"x": [1, -0.5]}')]),
    '[{"parameters": {"x": 1}, "name": "f"}]': ("", [("f", '{"x": 1}')]),  # sent whole at its end
    # Cut by max_tokens (not the grammar's whole array): the text, as vLLM's whole answer.
    '[{"name": "get_weather", "parameters": {"city": "Par': ('[{"name": "get_weather", "parameters": {"city": "Par', []),
    '[{"name": "get_wea': ('[{"name": "get_wea', []),
    '[{"name": "f", "parameters": {}}, {"name": "g", "para': ('[{"name": "f", "parameters": {}}, {"name": "g", "para', []),
    '[{"name": "f", "parameters": {"n": 12': ('[{"name": "f", "parameters": {"n": 12', []),
    '[{"name": "f", "parameters": 3}]': ('[{"name": "f", "parameters": 3}]', []),  # not a call
}  # fmt: skip
REQUIRED_STREAMED = {
    # Streamed, a call whose name went out stays, its parameters as far as they were certain (vLLM's).
    '[{"name": "get_weather", "parameters": {"city": "Par': ("", [("get_weather", '{"city": "Par')]),
    '[{"name": "f", "parameters": {}}, {"name": "g", "para': ("", [("f", "{}")]),
    '[{"name": "f", "parameters": {"n": 12': ("", [("f", '{"n": 12')]),
}


def _required_streamed(deltas: list[str]) -> tuple[str, list[tuple[str, str]]]:
    """The content and calls a client builds from "required"'s streamed chunk deltas."""
    stream = ToolAnswerStream(ToolChoice("required"))
    chunks = [delta for text in deltas for delta in stream.add(text)] + stream.finish()
    calls: dict[int, list[str]] = {}
    for chunk in chunks:
        for call in chunk.get("tool_calls", []):
            function = call["function"]
            if "name" in function:
                assert call["index"] == len(calls) and function["arguments"] == ""
                calls[call["index"]] = [function["name"], ""]
            else:
                assert function["arguments"]
                calls[call["index"]][1] += function["arguments"]
    assert stream.num_calls == len(calls)
    return "".join(c.get("content", "") for c in chunks), [
        (name, arguments) for name, arguments in calls.values()
    ]


@pytest.mark.parametrize("text", list(REQUIRED_ANSWERS))
def test_required_answers_stream_each_call_as_it_is_generated_wherever_the_deltas_cut_it(text):
    """vLLM's stream of "required": each item's name once read, then its parameters' text; the
    fragments join to exactly the whole answer's arguments, for every split into one, two or three
    deltas (three for short texts) and one character at a time; a cut array is content whole."""
    content, calls = answer_tool_calls(text, ToolChoice("required"))
    assert (content, [(c.name, c.arguments) for c in calls]) == REQUIRED_ANSWERS[text]
    cuts = [[text], list(text), *_cuts(text, 1), *(_cuts(text, 2) if len(text) < 40 else [])]
    for deltas in cuts:
        assert _required_streamed(deltas) == REQUIRED_STREAMED.get(text, REQUIRED_ANSWERS[text]), deltas


def test_a_required_call_goes_out_before_the_array_ends():
    """The first call's name and parameters go out while the model still writes the second."""
    stream = ToolAnswerStream(ToolChoice("required"))
    assert stream.add('[{"name": "get_weather", "parameters": {"ci') == [
        {
            "tool_calls": [
                {
                    "index": 0,
                    "id": ANY_ID,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": ""},
                }
            ]
        },
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"ci'}}]},
    ]
    assert stream.add('ty": "Paris"}}, {"name": "get_time", "parameters": {}}') == [
        {"tool_calls": [{"index": 0, "function": {"arguments": 'ty": "Paris"}'}}]},
        {
            "tool_calls": [
                {
                    "index": 1,
                    "id": ANY_ID,
                    "type": "function",
                    "function": {"name": "get_time", "arguments": ""},
                }
            ]
        },
        {"tool_calls": [{"index": 1, "function": {"arguments": "{}"}}]},
    ]
    assert (stream.add("]"), stream.finish(), stream.num_calls) == ([], [], 2)


def test_a_required_answer_cut_by_max_tokens_keeps_its_streamed_call_and_finishes_tool_calls():
    """vLLM's stream: once a call went out, the finish reason is "tool_calls" even for a cut by
    max_tokens (its whole answer: the cut array is content, the finish reason "length")."""
    required = ToolChoice("required")
    cut = '[{"name": "get_weather", "parameters": {"city": "Par'
    stream = ToolAnswerStream(required)
    stream.add(cut)
    stream.finish()
    assert tool_finish_reason(required, stream.num_calls, "length", streamed=True) == "tool_calls"
    assert answer_tool_calls(cut, required) == (cut, [])
    assert tool_finish_reason(required, 0, "length") == "length"
    before_a_name = ToolAnswerStream(required)  # nothing went out: the text is content, "length"
    assert before_a_name.add('[{"name": "get_') == [] and before_a_name.finish() == [
        {"content": '[{"name": "get_'}
    ]
    assert tool_finish_reason(required, before_a_name.num_calls, "length", streamed=True) == "length"


@pytest.mark.parametrize(
    "text",
    [
        '[{"name": "get_weather", "parameters": {}}, {"name": "get_ti',  # one whole item, then cut
        '[{"name": "get_weather", "parameters": {}}, {"name": "get_time", "parameters": {}}]',
        '[{"name": "get_weather", "parameters": {"city": "Par',
    ],
)
@pytest.mark.parametrize("cut", [1, 7, 1000])
def test_a_required_answer_read_whole_is_answer_tool_calls_wherever_the_deltas_cut_it(text, cut):
    """Not incremental (the Responses API's whole answer): "required"'s text is read as chat's
    whole answer reads it, so an array cut after a whole item is all content, not one call."""
    required = ToolChoice("required")
    stream = ToolAnswerStream(required, incremental=False)
    deltas = [d for i in range(0, len(text), cut) for d in stream.add(text[i : i + cut])] + stream.finish()
    content = "".join(d.get("content") or "" for d in deltas)
    calls = [
        c["function"]["name"] for d in deltas for c in d.get("tool_calls", []) if "name" in c["function"]
    ]
    want_content, want_calls = answer_tool_calls(text, required)
    assert (content, calls) == (want_content or "", [c.name for c in want_calls])


def _summary(answer: str, finish: str = "stop") -> AskSummary:
    return AskSummary("r1", answer, [5, 6, 7], finish, 0, 0, 3, {}, 0, False, "", [])


def _steps(answer: str) -> list[TokenStep]:
    """`_summary`'s answer as its one token step (a reasoning parser parts the steps)."""
    return [TokenStep([5, 6, 7], answer)]


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
    message = completion_body(
        _summary(answer), "epd", thinking=True, tool_choice=ToolChoice("auto"), steps=_steps(answer)
    )["choices"][0]["message"]
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


QWEN_TOOLS = (
    {
        "type": "function",
        "function": {
            "name": "search",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string"},
                    "limit": {"type": "integer"},
                    "score": {"type": "number"},
                    "exact": {"type": "boolean"},
                    "filters": {"type": "object"},
                    "tags": {"type": "array"},
                    "after": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                },
            },
        },
    },
)
Q_CALL = (
    "<tool_call>\n<function=search>\n<parameter=query>\nred cats\n</parameter>\n"
    "<parameter=limit>\n5\n</parameter>\n</function>\n</tool_call>"
)
Q_CODE = (  # a value holding the format itself, as code: its inner </parameter> is not the end
    "<tool_call>\n<function=write>\n<parameter=text>\nx = '</parameter>'\ny\n</parameter>\n"
    "</function>\n</tool_call>"
)
Q_ANSWERS = {
    Q_CALL: (None, [("search", '{"query": "red cats", "limit": 5}')]),
    "Looking.\n" + Q_CALL + "\n" + Q_CALL: ("Looking.\n", [("search", '{"query": "red cats", "limit": 5}')] * 2),
    Q_CODE: (None, [("write", '{"text": "x = \'</parameter>\'\\ny"}')]),
    "<tool_call>\n<function=search>\n</function>\n</tool_call>": (None, [("search", "{}")]),
    "<tool_call>\n<function=search>\n<parameter=score>\n2.0\n</parameter>\n<parameter=exact>\nTrue\n</parameter>\n"
    "<parameter=tags>\n['a', 1]\n</parameter>\n<parameter=filters>\n{\"k\": [1]}\n</parameter>\n"
    "<parameter=after>\nNone\n</parameter>\n<parameter=other>\n7\n</parameter>\n</function>":  # cut after </function>
        (None, [("search", '{"score": 2, "exact": true, "tags": ["a", 1], "filters": {"k": [1]}, "after": null, "other": "7"}')]),
    "<tool_call>\n<function=search>\n<parameter=query>\nred": ("<tool_call>\n<function=search>\n<parameter=query>\nred", []),
    "<tool_call>\n<function=bad name>\n</function>\n</tool_call>": ("<tool_call>\n<function=bad name>\n</function>\n</tool_call>", []),
    "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>": ("<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>", []),
    "plain <tool": ("plain <tool", []),
}  # fmt: skip
Q_STREAMED = {  # cut after its name went out: the name, `{` and the parameters read so far stay sent
    "<tool_call>\n<function=search>\n<parameter=query>\nred": (None, [("search", "{")]),
}


@pytest.mark.parametrize("text", list(Q_ANSWERS))
def test_qwen3_coder_calls_whole_and_streamed_wherever_the_deltas_cut_them(text):
    split = parse_tool_calls(text, "qwen3_coder", QWEN_TOOLS)
    assert (split.content, [(c.name, c.arguments) for c in split.calls]) == Q_ANSWERS[text]
    for _, arguments in Q_ANSWERS[text][1]:
        json.loads(arguments)
    cuts = [[text], list(text), *_cuts(text, 1), *(_cuts(text, 2) if len(text) < 40 else [])]
    for deltas in cuts:
        assert _streamed(deltas, "qwen3_coder", QWEN_TOOLS) == Q_STREAMED.get(text, Q_ANSWERS[text]), deltas


def test_a_qwen3_coder_call_streams_its_name_then_each_parameter_as_vllms():
    """vLLM's qwen3_coder stream: the name with `{`, a parameter once its `</parameter>` is
    followed by the next tag, `}` at `</function>`."""
    stream = ToolCallStream("qwen3_coder", QWEN_TOOLS)
    assert stream.add("<tool_call>\n<function=sea") == []
    header, fragment = stream.add("rch>\n<parameter=limit>\n5\n</parameter>")
    assert (header.name, fragment.text) == ("search", "{")
    assert stream.add("\n<param") == []  # "<param" may be text of the value yet
    assert stream.add("eter=") == [ArgumentsFragment('"limit": 5')]
    assert stream.add("query>\ncats\n</parameter>\n</function>") == [ArgumentsFragment(', "query": "cats"}')]
    assert stream.add("\n</tool_call>") == [] and stream.finish() == [] and stream.num_calls == 1


@pytest.mark.parametrize(
    ("text", "schema", "want"),
    [
        ("hello\nworld", {"type": "string"}, "hello\nworld"),
        ("null", {"type": "string"}, None),  # vLLM's: "null" in any case is null, whatever the type
        ("NULL", {"type": "integer"}, None),
        ("Null", None, None),  # undeclared too
        ("None", {"type": "string"}, "None"),
        ("None", {"type": "integer"}, "None"),  # not an integer: the text
        ("None", {"type": "object"}, None),  # a Python literal
        ("7", {"anyOf": [{"type": "integer"}, {"type": "null"}]}, 7),  # anyOf: read as an object's
        ("x", {"anyOf": [{"type": "string"}, {"type": "null"}]}, "x"),
        ("42", {"type": "integer"}, 42),
        ("4.2", {"type": "integer"}, "4.2"),  # not an integer: the text
        ("3.0", {"type": "number"}, 3),
        ("3.5", {"type": "number"}, 3.5),
        ("1e999", {"type": "number"}, "1e999"),
        ("TRUE", {"type": "boolean"}, True),
        ("yes", {"type": "boolean"}, False),  # vLLM's: anything but "true" is false
        ('{"a": 1}', {"type": "object"}, {"a": 1}),
        ("{'a': 1}", {"type": "object"}, {"a": 1}),  # a Python literal
        ("\"{'a': 1}\"", {"type": "object"}, "{'a': 1}"),  # a JSON string: a string, as vLLM's
        ("[1, 2", {"type": "array"}, "[1, 2"),
        ("7", None, "7"),  # a parameter the tool does not declare
        ("7", {}, "7"),  # no type
    ],
)
def test_qwen3_coder_values_take_their_parameters_types_as_vllms(text, schema, want):
    got = parameter_value(text, schema)
    assert (got, type(got)) == (want, type(want))


def test_streamed_calls_past_the_first_are_dropped_without_parallel_tool_calls():
    stream = ToolAnswerStream(ToolChoice("auto", parallel=False, parser="qwen3_coder", tools=QWEN_TOOLS))
    deltas = [d for c in Q_CALL + Q_CALL for d in stream.add(c)] + stream.finish()
    assert {d["tool_calls"][0]["index"] for d in deltas} == {0} and stream.num_calls == 1
    arguments = "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas)
    assert arguments == '{"query": "red cats", "limit": 5}'


@pytest.mark.parametrize(
    ("choice", "answer", "want_calls"),
    [
        (FUNCTIONS, '{"city": "Paris"}', [("get_weather", '{"city": "Paris"}')]),
        (ToolChoice("required"), '[{"name": "get_time", "parameters": {}}]', [("get_time", "{}")]),
        (ToolChoice("auto"), CALL, [("get_weather", '{"city": "Paris"}')]),
    ],
)
def test_an_echo_goes_in_front_of_the_content_not_into_the_calls(choice, answer, want_calls):
    """As vLLM's (and as the stream sends it, chat's echo in a chunk of its own): the calls are read from
    the generated text alone, the echoed message's text is the content's start. A named function's
    arguments began with the echo, and "required"'s array, the echo before it, was no call at all."""
    echoed = "The weather:"
    for thinking in (None, False):
        choice_json = completion_body(
            _summary(answer),
            "epd",
            echoed=echoed,
            thinking=thinking,
            tool_choice=choice,
            steps=_steps(answer),
        )["choices"][0]
        message = choice_json["message"]
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]
        assert (message["content"], calls) == (echoed, want_calls)
        assert choice_json["finish_reason"] == ("stop" if choice.mode == "named" else "tool_calls")


@pytest.mark.parametrize("parser", ["hermes", "qwen3_coder"])
def test_a_long_call_streamed_in_small_deltas_is_searched_once(parser, monkeypatch):
    """Each delta's search for `</tool_call>`, a name's `>` or a value's `</parameter>` starts
    where the last one stopped: the characters searched grow with the text, not with its square
    (they were the whole block again at every delta)."""
    value = "lorem ipsum " * 500
    if parser == "hermes":
        text = (
            "<tool_call>\n" + json.dumps({"name": "write", "arguments": {"text": value}}) + "\n</tool_call>"
        )
    else:
        text = f"<tool_call>\n<function=write>\n<parameter=text>\n{value}\n</parameter>\n</function>\n</tool_call>"
    searched = []
    find = markers.find_marker

    def counted(text: str, marker: str, start: int) -> int:
        at = find(text, marker, start)
        searched.append((at + len(marker) if at >= 0 else len(text)) - start)
        return at

    monkeypatch.setattr(markers, "find_marker", counted)
    deltas = [text[i : i + 4] for i in range(0, len(text), 4)]
    assert _streamed(deltas, parser) == (None, [("write", json.dumps({"text": value}))])
    # Each delta's few searches read its own characters and a marker's length before them (where
    # one may begin); the whole block again at every delta would be about len(text) ** 2 / 8.
    assert sum(searched) < len(text) + 40 * len(deltas)
