"""vLLM's tool call parser `hermes` (`--enable-auto-tool-choice --tool-call-parser hermes`): the
calls a model writes in its answer, as the Qwen2.5 / Qwen3 / Qwen3-VL / Qwen3.5 templates tell it
to (and Hermes' own), each a JSON object in `<tool_call>` tags:

    I'll look it up.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

become the message's `tool_calls` ({"id": "chatcmpl-tool-<hex>", "type": "function", "function":
{"name", "arguments": JSON text}}); the text outside the calls stays the content. No HTTP and no
tokenizer in here: the chat door (`epd.gateway.http_api`) feeds each choice's decoded content
(after the reasoning parser's split, when one is set), whole or as the stream's deltas.

The rules, the same whole and streamed (`parse_tool_calls` is the stream fed one delta):
- a call's JSON that does not parse, or is not {"name": string, "arguments": object}, is left in
  the content as the model wrote it, tags included (vLLM leaves the whole answer as content when
  any call is malformed; epd decides call by call, which a stream can do too: a call sent cannot
  be taken back);
- a call cut before `</tool_call>` (max_tokens, a stop) is a call if its JSON is whole, else content;
- text outside the calls that is whitespace alone (the newlines around and between calls) is
  dropped once a call is made; the content is null when nothing else is left. An answer without
  any call is its text whole, as vLLM's.

Streamed, a tag's start split across deltas (`<tool`, `_call>`) is held back until the next delta
shows what it is, and a call goes out when its `</tool_call>` arrives, as vLLM's delta shape:
one chunk with its index, id, type and name (arguments ""), then one with its arguments' text.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from epd.gateway.tool_request import ToolChoice, forced_calls

TOOL_CALL_PARSERS = ("hermes",)
"""The names `--tool-call-parser` takes (vLLM's)."""

START, END = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ParsedToolCall:
    """One call found in an answer."""

    name: str
    arguments: str
    """The arguments object's JSON text, as vLLM's `json.dumps(arguments, ensure_ascii=False)`."""
    id: str = field(default_factory=lambda: make_tool_call_id())

    def to_json(self) -> dict[str, Any]:
        """OpenAI's `tool_calls` item."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def make_tool_call_id() -> str:
    """vLLM's form of a call's id."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass(frozen=True)
class ToolCallsSplit:
    """A whole answer's content parted: the calls, and the text outside them (None when the
    answer made calls and nothing but whitespace is left)."""

    content: str | None
    calls: list[ParsedToolCall]


def parse_tool_calls(text: str) -> ToolCallsSplit:
    """The calls of a whole answer's content (`text`), and the text outside them."""
    stream = ToolCallStream()
    items = stream.add(text) + stream.finish()
    calls = [item for item in items if isinstance(item, ParsedToolCall)]
    content = "".join(item for item in items if isinstance(item, str))
    if not calls:
        return ToolCallsSplit(text, [])
    return ToolCallsSplit(content or None, calls)


def _call_of(body: str) -> ParsedToolCall | None:
    """The call a `<tool_call>` block's text spells, or None when it is not one."""
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get("arguments")
    if not isinstance(arguments, dict):
        return None
    return ParsedToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


class ToolCallStream:
    """One choice's streamed content, parted delta by delta into content text (str items) and
    calls (`ParsedToolCall` items); the items of all deltas and `finish` are `parse_tool_calls`'s."""

    def __init__(self) -> None:
        self.num_calls = 0
        self._inside = False  # within a <tool_call> block
        self._held = ""  # outside: a tail that may begin <tool_call>; inside: the block's text so far
        self._blank = ""  # outside: the current segment's text while it is whitespace alone
        self._segment_shown = False  # the current segment has had text other than whitespace

    def add(self, text: str) -> list[str | ParsedToolCall]:
        """What the delta `text` completes: content strings and whole calls, in order."""
        out: list[str | ParsedToolCall] = []
        pending = self._held + text
        self._held = ""
        while pending:
            if self._inside:
                end = pending.find(END)
                if end < 0:
                    self._held = pending
                    return out
                self._close_call(pending[:end], True, out)
                pending = pending[end + len(END) :]
                continue
            start = pending.find(START)
            if start >= 0:
                self._outside_text(pending[:start], out)
                self._inside = True
                pending = pending[start + len(START) :]
                continue
            keep = _prefix_tail(pending, START)
            self._outside_text(pending[: len(pending) - keep], out)
            self._held = pending[len(pending) - keep :]
            return out
        return out

    def finish(self) -> list[str | ParsedToolCall]:
        """What was held back at the answer's end: a cut call (a call if its JSON is whole), a
        tag's start that never became one (content), and whitespace kept when no call was made."""
        out: list[str | ParsedToolCall] = []
        held, self._held = self._held, ""
        if self._inside:
            self._close_call(held, False, out)
        else:
            self._outside_text(held, out)
        if self._blank and not self.num_calls:
            out.append(self._blank)
        self._blank = ""
        return out

    def _outside_text(self, text: str, out: list[str | ParsedToolCall]) -> None:
        if not text:
            return
        if self._segment_shown:
            out.append(text)
        elif text.strip():
            out.append(self._blank + text)
            self._blank, self._segment_shown = "", True
        else:
            self._blank += text

    def _close_call(self, body: str, closed: bool, out: list[str | ParsedToolCall]) -> None:
        self._inside = False
        call = _call_of(body)
        if call is None:  # not a call: the text as written, and the whitespace before it
            out.append(self._blank + START + body + (END if closed else ""))
            self._blank, self._segment_shown = "", True
            return
        self.num_calls += 1
        out.append(call)
        self._blank, self._segment_shown = "", False  # a new segment after the call


def _prefix_tail(text: str, marker: str) -> int:
    """Length of `text`'s longest tail that is a proper prefix of `marker`."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def tool_call_deltas(call: ParsedToolCall, index: int) -> list[dict[str, Any]]:
    """A streamed call's deltas, vLLM's shape: its index, id, type and name first (arguments ""),
    then its arguments' text."""
    return [
        {
            "tool_calls": [
                {
                    "index": index,
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": ""},
                }
            ]
        },
        {"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]},
    ]


def answer_tool_calls(content: str | None, choice: ToolChoice) -> tuple[str | None, list[ParsedToolCall]]:
    """A whole answer's (content, calls) under the request's tool choice: "auto" parsed
    (`parse_tool_calls`), "named" and "required" read from the grammar's JSON (`forced_calls`; the
    content "" as vLLM's), "none" as it is; the first call alone without `parallel_tool_calls`."""
    if choice.forced:
        forced = forced_calls(content or "", choice)
        if forced is None:  # "required"'s array cut short: the text as it is
            return content, []
        return "", [ParsedToolCall(name, arguments) for name, arguments in forced][
            : None if choice.parallel else 1
        ]
    if choice.parses_text and content:
        split = parse_tool_calls(content)
        return split.content, split.calls[: None if choice.parallel else 1]
    return content, []


def tool_finish_reason(choice: ToolChoice, num_calls: int, finish_reason: str) -> str:
    """vLLM's: "tool_calls" when the answer's text made calls ("auto"), or when "required"'s
    grammar ended ("stop"); a named function's answer keeps its own."""
    if num_calls and (choice.mode == "auto" or (choice.mode == "required" and finish_reason == "stop")):
        return "tool_calls"
    return finish_reason


class ToolAnswerStream:
    """One choice's streamed content under a tool choice, as chunk deltas: content text
    ({"content"}) and calls (`tool_call_deltas`); what `answer_tool_calls` gives the whole answer.
    "auto" parses as the text comes (`ToolCallStream`); a named function's call goes out with the
    first text, its arguments as they come (vLLM's); "required"'s array is read at the end."""

    def __init__(self, choice: ToolChoice) -> None:
        self.choice = choice
        self.num_calls = 0
        self._calls = ToolCallStream()
        self._text = ""  # "required": the whole answer, read at the end

    def add(self, text: str) -> list[dict[str, Any]]:
        if self.choice.mode == "auto":
            return self._deltas(self._calls.add(text))
        if self.choice.mode == "named":
            return self._named(text)
        self._text += text
        return []

    def finish(self) -> list[dict[str, Any]]:
        if self.choice.mode == "auto":
            return self._deltas(self._calls.finish())
        if self.choice.mode == "named":
            return self._named("") if not self.num_calls else []
        content, calls = answer_tool_calls(self._text, self.choice)
        return self._deltas(calls) if calls else ([{"content": content}] if content else [])

    def _named(self, text: str) -> list[dict[str, Any]]:
        deltas = []
        if not self.num_calls:
            deltas = tool_call_deltas(ParsedToolCall(self.choice.function, ""), 0)[:1]
            self.num_calls = 1
        if text:
            deltas.append({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})
        return deltas

    def _deltas(self, items: list[str | ParsedToolCall] | list[ParsedToolCall]) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        for item in items:
            if isinstance(item, str):
                deltas.append({"content": item})
            elif self.choice.parallel or not self.num_calls:  # without parallel_tool_calls: the first alone
                deltas += tool_call_deltas(item, self.num_calls)
                self.num_calls += 1
        return deltas
