"""An answer under the request's tool choice (`epd.gateway.tool_request.ToolChoice`): its calls
whole (`answer_tool_calls`), its finish reason (`tool_finish_reason`) and its stream's chunk deltas
(`ToolAnswerStream`), vLLM's in each: "auto" parsed by the server's parser (`stream`), "required"
the grammar's array (`required`), a named function the text as generated."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from epd.gateway.tool_parsers.calls import (
    ArgumentsFragment,
    ParsedToolCall,
    StreamItem,
    ToolCallHeader,
    make_tool_call_id,
)
from epd.gateway.tool_parsers.required import RequiredCallStream
from epd.gateway.tool_parsers.stream import ToolCallStream, parse_tool_calls
from epd.gateway.tool_request import ToolChoice


def header_delta(name: str, call_id: str, index: int) -> dict[str, Any]:
    """A streamed call's first delta: its index, id, type and name, arguments "" (vLLM's qwen3_coder,
    named and "required" shape; its hermes leaves the key out, but epd's hermes header always
    joins the arguments' `{` in its step's chunk: docs/architecture.md, Tool calling)."""
    return {
        "tool_calls": [
            {
                "index": index,
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": ""},
            }
        ]
    }


def arguments_delta(text: str, index: int) -> dict[str, Any]:
    """A streamed call's next piece of arguments' text."""
    return {"tool_calls": [{"index": index, "function": {"arguments": text}}]}


def tool_call_deltas(call: ParsedToolCall, index: int) -> list[dict[str, Any]]:
    """A whole call's deltas: its header, then its arguments' text."""
    return [header_delta(call.name, call.id, index), arguments_delta(call.arguments, index)]


def answer_tool_calls(content: str | None, choice: ToolChoice) -> tuple[str | None, list[ParsedToolCall]]:
    """A whole answer's (content, calls) under the request's tool choice: "auto" parsed by the
    choice's parser (`parse_tool_calls`), "named" the text as generated (the one call's
    arguments), "required" the grammar's array (`RequiredCallStream`; not a whole array: the text
    as content), the content "" as vLLM's; "none" as it is; the first call alone without
    `parallel_tool_calls`."""
    if choice.mode == "named":  # the text as generated, as vLLM's (streamed as it comes)
        return "", [ParsedToolCall(choice.function, content or "")]
    if choice.mode == "required":
        stream = RequiredCallStream(incremental=False)
        calls = [item for item in stream.add(content or "") if isinstance(item, ParsedToolCall)]
        if not stream.complete:  # "required"'s array cut short: the text as it is
            return content, []
        return "", calls[: None if choice.parallel else 1]
    if choice.parses_text and content:
        split = parse_tool_calls(content, choice.parser, choice.tools)
        return split.content, split.calls[: None if choice.parallel else 1]
    return content, []


def tool_finish_reason(choice: ToolChoice, num_calls: int, finish_reason: str, streamed: bool = False) -> str:
    """vLLM's: "tool_calls" when the answer's text made calls ("auto"; streamed, also a call cut
    after its name went out), or when "required"'s grammar ended ("stop"; `streamed`, whenever a
    call went out, a cut by max_tokens too, as vLLM's stream); a named function's answer keeps its
    own."""
    required = choice.mode == "required" and (streamed or finish_reason == "stop")
    if num_calls and (choice.mode == "auto" or required):
        return "tool_calls"
    return finish_reason


class ToolAnswerStream:
    """One choice's streamed content under a tool choice, as chunk deltas: content text
    ({"content"}) and calls (`header_delta`, `arguments_delta`); the calls `answer_tool_calls`
    gives the whole answer. "auto" parses as the text comes (`ToolCallStream`: a call's name once
    read, its arguments as they are written); a named function's call goes out with the first
    text, its arguments as they come (vLLM's); "required"'s array item by item as it is generated
    (`RequiredCallStream`: a call's name once read, its parameters as they are written).
    `incremental` False: "auto"'s calls go out whole at their block's end, and a block that is no
    whole call (cut by max_tokens after its name) stays content; "required"'s text is read whole at
    the end, so an array cut short is all content; both as in `answer_tool_calls` (a whole answer
    shaped as deltas: the Responses API's `response_body`)."""

    def __init__(self, choice: ToolChoice, incremental: bool = True) -> None:
        self.choice = choice
        self.num_calls = 0
        # "required" read whole: its text, until `finish` reads it as `answer_tool_calls` does
        self._whole_text: list[str] | None = [] if choice.mode == "required" and not incremental else None
        self._calls: ToolCallStream | RequiredCallStream = (
            RequiredCallStream(incremental)
            if choice.mode == "required"
            else ToolCallStream(choice.parser, choice.tools, incremental)
        )
        self._skipping = False  # the streamed call is past the first, without parallel_tool_calls

    @property
    def sets_content(self) -> bool:
        """Whether a step's delta that this stream says something in carries `content`, null beside
        calls: vLLM's hermes ("auto") makes each step's `DeltaMessage(content=content,
        tool_calls=tool_call_deltas)`, content set, so written by `model_dump_json(exclude_unset=True)`
        (`vllm/tool_parsers/hermes_tool_parser.py`, 02bb669); an empty `tool_calls` is not written
        (`DeltaMessage`'s serializer drops it, vLLM PR #44105:
        `vllm/entrypoints/generate/base/protocol.py`, 567b35a). Its qwen3_coder (the parser engine's
        `DeltaMessage(**kwargs)` of the fields it has, `vllm/parser/engine/parser_engine.py`,
        001ba1e; the older `Qwen3CoderToolParser`'s `DeltaMessage(content=...)` or
        `DeltaMessage(tool_calls=...)`, `vllm/tool_parsers/qwen3coder_tool_parser.py`, 00d0a33) and
        its named and "required" streams (`DeltaMessage(tool_calls=...)`) set only what they have."""
        return self.choice.mode == "auto" and self.choice.parser == "hermes"

    def add(self, text: str) -> list[dict[str, Any]]:
        if self.choice.mode == "named":
            return self._named(text)
        if self._whole_text is not None:
            self._whole_text.append(text)
            return []
        return self._deltas(self._calls.add(text))

    def finish(self) -> list[dict[str, Any]]:
        if self.choice.mode == "named":
            return self._named("") if not self.num_calls else []
        if self._whole_text is not None:
            content, calls = answer_tool_calls("".join(self._whole_text), self.choice)
            return ([{"content": content}] if content else []) + self._deltas(calls)
        return self._deltas(self._calls.finish())

    def _named(self, text: str) -> list[dict[str, Any]]:
        deltas = []
        if not self.num_calls:
            deltas.append(header_delta(self.choice.function, make_tool_call_id(), 0))
            self.num_calls = 1
        if text:
            deltas.append(arguments_delta(text, 0))
        return deltas

    def _deltas(self, items: Sequence[StreamItem]) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        for item in items:
            if isinstance(item, str):
                deltas.append({"content": item})
            elif isinstance(item, ArgumentsFragment):
                if not self._skipping:
                    deltas.append(arguments_delta(item.text, self.num_calls - 1))
            elif self.choice.parallel or not self.num_calls:  # without parallel_tool_calls: the first alone
                self._skipping = False
                if isinstance(item, ToolCallHeader):
                    deltas.append(header_delta(item.name, item.id, self.num_calls))
                else:
                    deltas += tool_call_deltas(item, self.num_calls)
                self.num_calls += 1
            else:
                self._skipping = True
        return deltas
