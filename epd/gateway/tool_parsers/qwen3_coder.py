"""vLLM's `qwen3_coder` tool call parser's reading of one block (Qwen3-Coder, Qwen3.5): a function
tag, a tag per parameter, the values as text,

    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>

the arguments' text `{"PARAM": value, ...}` as `json.dumps(..., ensure_ascii=False)` writes it,
each value converted by the type of its parameter in the request's tool's schema, as vLLM's."""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from epd.gateway.tool_parsers import markers
from epd.gateway.tool_parsers.calls import ParsedToolCall

_FUNCTION, _FUNCTION_END = "<function=", "</function>"
_PARAMETER, _PARAMETER_END = "<parameter=", "</parameter>"
_AFTER_PARAMETER = (_PARAMETER, _FUNCTION_END, markers.END)
"""What follows a parameter's real `</parameter>` (one inside a value, in code, is followed by
something else)."""
_BAD_NAME_CHARS = frozenset("{}<>\"' \t\n\r")


class Qwen3CoderReader:
    """One qwen3_coder `<tool_call>` block's body, `<function=NAME>` then a `<parameter=P>` tag per
    parameter, read as it grows (`CallReader`): `{` with the name, a parameter once its end is
    certain, `}` at `</function>`; `tools` type the values (`parameter_value`)."""

    def __init__(self, tools: Sequence[Mapping[str, Any]]) -> None:
        self.name: str | None = None
        self._tools = tools
        self._properties: Mapping[str, Any] = {}
        self._at = 0  # the body's characters read
        self._name_scan = 0  # where to look next for the function's or parameter's name's `>`
        self._scan = 0  # where to look next for the current parameter's `</parameter>`
        self._num_parameters = 0
        self._closed = False  # its `</function>` was read
        self._broken = False
        self._sent: list[str] = []

    def advance(self, body: str, final: bool) -> list[str]:
        out: list[str] = []
        if self.name is None and not self._broken:
            at = _skip_space(body, 0)
            if not body.startswith(_FUNCTION, at):
                self._broken = final or _tag_at(body, at, (_FUNCTION,)) is None
                return []
            end = markers.find_marker(body, ">", max(at + len(_FUNCTION), self._name_scan))
            if end < 0:
                self._name_scan, self._broken = len(body), final
                return []
            name = body[at + len(_FUNCTION) : end]
            if not name or set(name) & _BAD_NAME_CHARS:  # vLLM's: not a function's name
                self._broken = True
                return []
            self.name, self._at = name, end + 1
            self._properties = _properties(self._tools, name)
            out.append("{")
        while self.name is not None and not self._closed and not self._broken:
            at = _skip_space(body, self._at)
            if body.startswith(_FUNCTION_END, at):
                self._closed, self._at = True, at + len(_FUNCTION_END)
                out.append("}")
            elif body.startswith(_PARAMETER, at):
                parameter = self._parameter(body, at, final)
                if parameter is None:
                    break
                out.append(parameter)
            else:
                self._broken = final or _tag_at(body, at, (_FUNCTION_END, _PARAMETER)) is None
                break
        self._sent += out
        return ["".join(out)] if out else []

    def _parameter(self, body: str, at: int, final: bool) -> str | None:
        """The parameter at `at` as its arguments' fragment, once its end is certain."""
        name_end = markers.find_marker(body, ">", max(at + len(_PARAMETER), self._name_scan))
        if name_end < 0:
            self._name_scan, self._broken = len(body), final
            return None
        start = name_end + 1 + (body.startswith("\n", name_end + 1))
        end = max(start, self._scan)  # a long value is searched once, not again at every delta
        while True:
            end = markers.find_marker(body, _PARAMETER_END, end)
            if end < 0:
                self._scan = max(start, len(body) - len(_PARAMETER_END) + 1)
                self._broken = final
                return None
            after = _skip_space(body, end + len(_PARAMETER_END))
            whole = _tag_at(body, after, _AFTER_PARAMETER)
            if whole or (final and after == len(body)):
                break
            if whole is not None and not final:
                self._scan = end
                return None  # the next tag is not whole yet
            end += len(_PARAMETER_END)
        name = body[at + len(_PARAMETER) : name_end]
        value = body[start:end]
        value = value[:-1] if value.endswith("\n") else value
        self._at, self._scan, self._name_scan = end + len(_PARAMETER_END), 0, 0
        separator = ", " if self._num_parameters else ""
        self._num_parameters += 1
        value_json = _value_json(parameter_value(value, self._properties.get(name)))
        return f"{separator}{json.dumps(name, ensure_ascii=False)}: {value_json}"

    def call(self, body: str) -> ParsedToolCall | None:
        if self.name is None or not self._closed:
            return None
        return ParsedToolCall(self.name, "".join(self._sent))


_SPACE = re.compile(r"\s*")


def _skip_space(text: str, at: int) -> int:
    """Where the whitespace at `at` ends."""
    match = _SPACE.match(text, at)
    return match.end() if match else at


def _tag_at(text: str, at: int, tags: Sequence[str]) -> bool | None:
    """True when one of `tags` is whole at `at`; False when the text ends with a start of one
    there (the next delta shows which); None when none can be there."""
    if any(text.startswith(tag, at) for tag in tags):
        return True
    rest = text[at : at + max(map(len, tags))]
    return False if any(tag.startswith(rest) and len(rest) < len(tag) for tag in tags) else None


def _properties(tools: Sequence[Mapping[str, Any]], name: str) -> Mapping[str, Any]:
    """The `properties` of the parameters of the tool named `name` ({} when none is)."""
    for tool in tools:
        function = tool.get("function") or {}
        if function.get("name") == name:
            properties = (function.get("parameters") or {}).get("properties")
            return properties if isinstance(properties, Mapping) else {}
    return {}


def _value_json(value: Any) -> str:
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):  # a Python literal JSON cannot hold (a set, bytes): its text
        return json.dumps(str(value), ensure_ascii=False)


_STRING_TYPES = ("string", "str", "text", "varchar", "char", "enum")
_INTEGER_PREFIXES = ("int", "uint", "long", "short", "unsigned")


def parameter_value(text: str, schema: Any) -> Any:
    """A qwen3_coder parameter's value from its text by its schema's type, exactly as vLLM's
    `_convert_param_value`: "null" (any case) null whatever the type, a string's and an undeclared
    parameter's too; then a parameter the tool does not declare, a string type, or a schema
    without a type: the text (an `anyOf` counts as an object); integers `int()`; numbers
    `float()`, an integer when it has no fraction; a boolean true when the text is "true" (any
    case), else false; objects and arrays JSON, else (and any other type) a Python literal
    (`ast.literal_eval`: "None" null, "True" true); the text whenever parsing fails."""
    if text.lower() == "null":
        return None
    if schema is None:  # the tool does not declare it
        return text
    if isinstance(schema, Mapping) and "type" in schema:
        kind = str(schema["type"]).strip().lower()
    elif isinstance(schema, Mapping) and "anyOf" in schema:
        kind = "object"
    else:
        kind = "string"
    if kind in _STRING_TYPES:
        return text
    if kind.startswith(_INTEGER_PREFIXES):
        try:
            return int(text)
        except ValueError:
            return text
    if kind.startswith(("num", "float")):
        try:
            number = float(text)
            return int(number) if number == int(number) else number
        except (ValueError, OverflowError):
            return text
    if kind in ("boolean", "bool", "binary"):
        return text.lower() == "true"
    if kind in ("object", "array", "arr") or kind.startswith(("dict", "list")):
        try:
            return json.loads(text)
        except (ValueError, RecursionError):
            pass
    return _literal(text)


def _literal(text: str) -> Any:
    """`text` as a Python literal, or `text` itself when it is not one."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, RecursionError, MemoryError):
        return text
