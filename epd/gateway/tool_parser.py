"""vLLM's tool call parsers (`--enable-auto-tool-choice --tool-call-parser NAME`): the calls a
model writes in its answer, each in `<tool_call>` tags, in its family's form:

    hermes       (Qwen2.5, Qwen3, Qwen3-VL; Hermes' own) a JSON object per call
                 <tool_call>
                 {"name": "get_weather", "arguments": {"city": "Paris"}}
                 </tool_call>
    qwen3_coder  (Qwen3-Coder, Qwen3.5) a function tag, a tag per parameter, the values as text
                 <tool_call>
                 <function=get_weather>
                 <parameter=city>
                 Paris
                 </parameter>
                 </function>
                 </tool_call>

become the message's `tool_calls` ({"id": "chatcmpl-tool-<hex>", "type": "function", "function":
{"name", "arguments": JSON text}}); the text outside the calls stays the content. No HTTP and no
tokenizer in here: the chat door (`epd.gateway.http_api`) feeds each choice's decoded content
(after the reasoning parser's split, when one is set), whole or as the stream's deltas.

The rules, the same whole and streamed (`parse_tool_calls` is the stream fed one delta):
- a block that is not a call (hermes: JSON that does not parse, or is not {"name": string,
  "arguments": object}; qwen3_coder: no `<function=NAME>` or no `</function>`) is left in the
  content as the model wrote it, tags included (vLLM's hermes leaves the whole answer as content
  when any call is malformed; epd decides call by call);
- a call cut before `</tool_call>` (max_tokens, a stop) is a call if it is whole (hermes: its JSON;
  qwen3_coder: its `</function>`), else content;
- text outside the calls that is whitespace alone (the newlines around and between calls) is
  dropped once a call is made; the content is null when nothing else is left. An answer without
  any call is its text whole, as vLLM's.

The arguments' text: hermes', the arguments object as `json.dumps(arguments, ensure_ascii=False)`
writes it (`, ` and `: ` between items, strings with their escapes decoded), built value by value
as the model writes them (`_JsonNormalizer`; an object that repeats a key keeps both, where
`json.loads` would keep the last); qwen3_coder's, `{"PARAM": value, ...}` in the same form, each
value converted by the type of its parameter in the request's tool's schema, as vLLM's
(`parameter_value`).

Streamed, a tag's start split across deltas (`<tool`, `_call>`) is held back until the next delta
shows what it is, and a call goes out as vLLM's do, in its delta shape: one chunk with its index,
id, type and name (arguments ""), once the name is read, then its arguments' text in fragments as
the model writes them: hermes' once `{"name": "...", "arguments": {` is read (the order the
templates teach; a call written otherwise goes out whole at its `</tool_call>`), a value's text as
it grows (a string's characters, a number or literal when it ends); qwen3_coder's `{` with the
name, a parameter when its `</parameter>` is followed by the next tag, `}` at `</function>`. The
fragments of a call join to exactly the whole answer's arguments. A call that goes wrong after its
name went out (max_tokens cuts it, its JSON breaks) cannot be taken back: what was sent stays, the
rest of its block is dropped and the finish reason is "tool_calls", as vLLM's stream (whose whole
answer, as epd's, keeps such a block as content).
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from epd.gateway.tool_request import ToolChoice

TOOL_CALL_PARSERS = ("hermes", "qwen3_coder")
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


@dataclass(frozen=True)
class ToolCallHeader:
    """A streamed call's start: its name is read, its arguments follow as `ArgumentsFragment`s."""

    name: str
    id: str = field(default_factory=lambda: make_tool_call_id())


@dataclass(frozen=True)
class ArgumentsFragment:
    """The next piece of the streamed call's arguments' text."""

    text: str


StreamItem = str | ParsedToolCall | ToolCallHeader | ArgumentsFragment
"""What a `ToolCallStream` parts a delta into: content text, a whole call, or a streamed call's
header and arguments' fragments."""


def make_tool_call_id() -> str:
    """vLLM's form of a call's id."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass(frozen=True)
class ToolCallsSplit:
    """A whole answer's content parted: the calls, and the text outside them (None when the
    answer made calls and nothing but whitespace is left)."""

    content: str | None
    calls: list[ParsedToolCall]


def parse_tool_calls(
    text: str, parser: str = "hermes", tools: Sequence[Mapping[str, Any]] = ()
) -> ToolCallsSplit:
    """The calls of a whole answer's content (`text`) as `parser` reads them (`tools`: the
    request's, whose schemas type qwen3_coder's values), and the text outside them."""
    stream = ToolCallStream(parser, tools, incremental=False)
    items = stream.add(text) + stream.finish()
    calls = [item for item in items if isinstance(item, ParsedToolCall)]
    content = "".join(item for item in items if isinstance(item, str))
    if not calls:
        return ToolCallsSplit(text, [])
    return ToolCallsSplit(content or None, calls)


class _CallReader(Protocol):
    """One `<tool_call>` block's body, read as it grows."""

    name: str | None
    """The call's name once its start is read (the stream's header may go out)."""

    def advance(self, body: str, final: bool) -> list[str]:
        """The arguments' fragments that the block's text so far (`body`) adds; `final`: the
        block ended (its `</tool_call>`, or the answer's end)."""
        ...

    def call(self, body: str) -> ParsedToolCall | None:
        """After `advance(body, True)`: the whole block's call, None when it is not one."""
        ...


class _CallStart:
    """A call's start, read character by character as it comes (never read again): `{"name":
    "<name>", "<key>": {` with JSON whitespace between the tokens, the order the templates teach
    (hermes' `arguments`) and vLLM's "required" schema lists (`parameters`). `name` is set once it
    is read; `failed` once the text cannot be that start."""

    def __init__(self, key: str) -> None:
        self._tokens: tuple[str | None, ...] = ("{", '"name"', ":", None, ",", json.dumps(key), ":", "{")
        self._token = 0  # the token being read (None: the name's string)
        self._offset = 0  # its characters read
        self._raw: list[str] = []  # the name's string, raw
        self._escaped = False
        self._name: str | None = None
        self.name: str | None = None
        self.failed = False

    def feed(self, text: str) -> int | None:
        """Reads `text`; the index in it just past the arguments' `{` when the start is whole there."""
        for i, char in enumerate(text):
            if self.failed or self.name is not None:
                return None
            token = self._tokens[self._token]
            if token is None:  # the name's string
                if self._offset == 0:
                    if char in " \t\n\r":
                        continue
                    if char != '"':
                        self.failed = True
                        continue
                    self._offset = 1
                elif self._escaped:
                    self._escaped = False
                    self._raw.append(char)
                elif char == "\\":
                    self._escaped = True
                    self._raw.append(char)
                elif char == '"':
                    try:
                        self._name = json.loads('"' + "".join(self._raw) + '"')
                    except ValueError:
                        self.failed = True
                        continue
                    self.failed = not self._name
                    self._token, self._offset = self._token + 1, 0
                else:
                    self._raw.append(char)
                continue
            if self._offset == 0 and char in " \t\n\r":
                continue
            if char != token[self._offset]:
                self.failed = True
                continue
            self._offset += 1
            if self._offset == len(token):
                self._token, self._offset = self._token + 1, 0
                if self._token == len(self._tokens):
                    self.name = self._name
                    return i + 1
        return None


class _HermesReader:
    def __init__(self) -> None:
        self.name: str | None = None
        self._start = _CallStart("arguments")
        self._fed = 0  # the body's characters read (from the arguments' `{`, fed to the normalizer)
        self._normalizer = _JsonNormalizer()
        self._sent: list[str] = []

    def advance(self, body: str, final: bool) -> list[str]:
        if self.name is None:
            if self._start.failed:  # not in the templates' order: read whole at the end
                return []
            at = self._start.feed(body[self._fed :])
            if at is None:
                self._fed = len(body)
                return []
            self.name, self._fed = self._start.name, self._fed + at - 1
        self._normalizer.feed(body[self._fed :])
        self._fed = len(body)
        out = self._normalizer.take(final)
        self._sent += out
        return out

    def call(self, body: str) -> ParsedToolCall | None:
        try:
            value = json.loads(body)
        except (ValueError, RecursionError):
            return None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
            return None
        arguments = value.get("arguments")
        if not isinstance(arguments, dict):
            return None
        if self.name is not None:  # as the stream sends it: the name read first, the arguments' text
            return ParsedToolCall(self.name, "".join(self._sent))
        return ParsedToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


_SCALAR_CHARS = frozenset("-+.0123456789eEtruefalsnNaIiy")


class _JsonNormalizer:
    """A JSON value's text, fed as it grows, rewritten as `json.dumps(json.loads(text),
    ensure_ascii=False)` writes it, as far as it is certain: structure at once, a string's
    characters as their escapes complete, a number or literal when it ends. Stops (sends nothing
    more) at the value's end or at text that is not JSON."""

    def __init__(self) -> None:
        self._depth = 0
        self._done = False
        self._in_string = False
        self._escaped = False  # the string's last character was a backslash
        self._raw = ""  # the string's characters not yet sent (raw, escapes as written)
        self._scalar = ""  # a number or literal being read
        self._out: list[str] = []

    def feed(self, text: str) -> None:
        for char in text:
            if self._done:
                return
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
                    self._send_string(len(self._raw))
                    self._out.append('"')
                    continue
                self._raw += char
                continue
            if char in _SCALAR_CHARS:
                self._scalar += char
                continue
            self._end_scalar()
            if char in " \t\n\r":
                continue
            if char == '"':
                self._in_string = True
                self._out.append('"')
            elif char in "{[":
                self._depth += 1
                self._out.append(char)
            elif char in "}]":
                self._depth -= 1
                self._out.append(char)
                self._done = self._depth <= 0
            elif char in ",:":
                self._out.append(char + " ")
            else:
                self._done = True  # not JSON: nothing more is certain

    def take(self, final: bool) -> list[str]:
        """The text made certain since the last take (`final`: the value's text ended, so a number
        or literal at its end is whole)."""
        if self._in_string and not self._done:
            self._send_string(_safe_string_end(self._raw))
        if final:
            self._end_scalar()
        text, self._out = "".join(self._out), []
        return [text] if text else []

    def _send_string(self, end: int) -> None:
        raw, self._raw = self._raw[:end], self._raw[end:]
        if not raw:
            return
        try:
            text = json.loads('"' + raw + '"')
        except ValueError:
            self._done = True
            return
        self._out.append(json.dumps(text, ensure_ascii=False)[1:-1])

    def _end_scalar(self) -> None:
        scalar, self._scalar = self._scalar, ""
        if not scalar or self._done:
            return
        try:
            self._out.append(json.dumps(json.loads(scalar)))
        except ValueError:
            self._done = True


def _safe_string_end(raw: str) -> int:
    """How much of a string's raw text decodes alone: up to an escape not yet whole, or a high
    surrogate's escape whose low one may follow."""
    i = 0
    while i < len(raw):
        if raw[i] != "\\":
            i += 1
            continue
        if i + 1 >= len(raw):
            return i
        if raw[i + 1] != "u":
            i += 2
            continue
        if i + 6 > len(raw):
            return i
        try:
            code = int(raw[i + 2 : i + 6], 16)
        except ValueError:
            return len(raw)  # not JSON: the decoder says so
        if 0xD800 <= code < 0xDC00:
            rest = raw[i + 6 : i + 8]
            if len(raw) < i + 8 and "\\u".startswith(rest):
                return i
            if rest == "\\u":
                if i + 12 > len(raw):
                    return i
                i += 12
                continue
        i += 6
    return i


_FUNCTION, _FUNCTION_END = "<function=", "</function>"
_PARAMETER, _PARAMETER_END = "<parameter=", "</parameter>"
_AFTER_PARAMETER = (_PARAMETER, _FUNCTION_END, END)
"""What follows a parameter's real `</parameter>` (one inside a value, in code, is followed by
something else)."""
_BAD_NAME_CHARS = frozenset("{}<>\"' \t\n\r")


class _Qwen3CoderReader:
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
            end = _find(body, ">", max(at + len(_FUNCTION), self._name_scan))
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
        name_end = _find(body, ">", max(at + len(_PARAMETER), self._name_scan))
        if name_end < 0:
            self._name_scan, self._broken = len(body), final
            return None
        start = name_end + 1 + (body.startswith("\n", name_end + 1))
        end = max(start, self._scan)  # a long value is searched once, not again at every delta
        while True:
            end = _find(body, _PARAMETER_END, end)
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


class RequiredCallStream:
    """tool_choice "required"'s answer, the grammar's JSON array `[{"name": ..., "parameters":
    {...}}, ...]` (vLLM's schema), parted as it is generated, as vLLM's stream parts it: an item's
    `ToolCallHeader` once `{"name": "...", "parameters": {` is read (the schema's order, the
    grammar's), then its parameters' text as `ArgumentsFragment`s in `json.dumps`'s spelling
    (`_JsonNormalizer`, as hermes' arguments), so that they join to exactly the whole answer's
    arguments; an item written otherwise goes out whole at its end. Each character is read once.
    `incremental` False: each item whole at its end (`ParsedToolCall`), the whole answer's calls,
    which are calls only when the array is `complete`. The text is content when no call went out
    and it is not such an array (a cut by max_tokens, as vLLM's whole answer); a call that went out
    stays (the rest of the text is dropped), as vLLM's stream."""

    def __init__(self, incremental: bool = True) -> None:
        self.num_calls = 0
        self._incremental = incremental
        self._phase = (
            "open"  # "open" ([), "item" ({, or ] after [), "in_item", "next" (, or ]), "end", "broken"
        )
        self._text: list[str] = []  # the whole answer: the content when it is no array of calls
        self._first = True  # no item yet: `]` may close the array
        self._item: list[str] = []  # the current item's text
        self._depth = 0  # the item's brackets open
        self._in_string = False
        self._escaped = False
        self._start = _CallStart("parameters")
        self._normalizer: _JsonNormalizer | None = None  # the item's parameters, from their `{`
        self._sent: list[str] = []  # the item's parameters' text made so far
        self._header_sent = False

    @property
    def complete(self) -> bool:
        """The text is a whole array of calls (whitespace may follow)."""
        return self._phase == "end"

    def add(self, text: str) -> list[StreamItem]:
        """The items the delta `text` completes, in order."""
        self._text.append(text)
        out: list[StreamItem] = []
        at = 0
        while at < len(text) and self._phase != "broken":
            if self._phase == "in_item":
                at = self._read_item(text, at, out)
                continue
            char, at = text[at], at + 1
            if char in " \t\n\r":
                continue
            if self._phase == "open":
                self._phase = "item" if char == "[" else "broken"
            elif self._phase == "item" and char == "{":
                self._begin_item()
            elif self._phase == "item" and char == "]" and self._first:
                self._phase = "end"
            elif self._phase == "next" and char in ",]":
                self._phase, self._first = ("item" if char == "," else "end"), False
            else:  # not the grammar's array: content, or dropped once a call went out
                self._phase = "broken"
        return out

    def finish(self) -> list[StreamItem]:
        """At the answer's end: the certain rest of a cut call's parameters, or the whole text as
        content when no call went out and it is no array of calls."""
        out: list[StreamItem] = []
        if self._phase == "in_item" and self._header_sent:
            out += self._fragments(final=True)
        if not self.num_calls and not self.complete and (text := "".join(self._text)):
            out.append(text)
        return out

    def _begin_item(self) -> None:
        self._phase, self._item, self._depth = "in_item", ["{"], 1
        self._start, self._normalizer, self._sent, self._header_sent = (
            _CallStart("parameters"),
            None,
            [],
            False,
        )
        self._start.feed("{")

    def _read_item(self, text: str, at: int, out: list[StreamItem]) -> int:
        """Reads the current item's text from `text[at]`, to its end or the delta's; where it stopped."""
        end = len(text)
        for i in range(at, len(text)):
            char = text[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    end = i + 1
                    break
        piece = text[at:end]
        self._item.append(piece)
        if self._normalizer is not None:
            self._normalizer.feed(piece)
        elif not self._start.failed and (start := self._start.feed(piece)) is not None:
            self._normalizer = _JsonNormalizer()
            self._normalizer.feed(piece[start - 1 :])  # from the parameters' `{`
            if self._incremental:
                out.append(ToolCallHeader(self._start.name or ""))
                self._header_sent = True
                self.num_calls += 1
        closed = self._depth == 0
        fragments = self._fragments(final=closed)
        if self._header_sent:
            out += fragments
        if closed:
            self._end_item(out)
        return end

    def _fragments(self, final: bool) -> list[StreamItem]:
        if self._normalizer is None:
            return []
        texts = self._normalizer.take(final)
        self._sent += texts
        return [ArgumentsFragment(text) for text in texts]

    def _end_item(self, out: list[StreamItem]) -> None:
        self._phase = "next"
        try:
            item = json.loads("".join(self._item))
        except (ValueError, RecursionError):
            item = None
        if not (
            isinstance(item, dict)
            and isinstance(item.get("name"), str)
            and isinstance(item.get("parameters"), dict)
        ):
            self._phase = "broken"  # not a call: what went out stays (a header sent), else content
        elif not self._header_sent:
            if (
                self._normalizer is not None
            ):  # as the stream sends it: the name read first, the parameters' text
                call = ParsedToolCall(self._start.name or "", "".join(self._sent))
            else:
                call = ParsedToolCall(item["name"], json.dumps(item["parameters"], ensure_ascii=False))
            out.append(call)
            self.num_calls += 1


def _reader(parser: str, tools: Sequence[Mapping[str, Any]]) -> _CallReader:
    return _Qwen3CoderReader(tools) if parser == "qwen3_coder" else _HermesReader()


class ToolCallStream:
    """One choice's streamed content, parted delta by delta into content text (str items) and
    calls; the items of all deltas and `finish` are `parse_tool_calls`'s. `incremental`: a call
    goes out as its header and arguments' fragments as they are read (the stream); else whole at
    its block's end (`ParsedToolCall`, the whole answer)."""

    def __init__(
        self, parser: str = "hermes", tools: Sequence[Mapping[str, Any]] = (), incremental: bool = True
    ) -> None:
        self.num_calls = 0
        self._parser, self._tools, self._incremental = parser, tools, incremental
        self._inside = False  # within a <tool_call> block
        self._reader = _reader(parser, tools)
        self._header_sent = False  # the block's call went out as a header
        self._held = ""  # outside: a tail that may begin <tool_call>; inside: the block's text so far
        self._scanned = 0  # inside: where </tool_call> may begin in the block's text (none before)
        self._blank = ""  # outside: the current segment's text while it is whitespace alone
        self._segment_shown = False  # the current segment has had text other than whitespace

    def add(self, text: str) -> list[StreamItem]:
        """What the delta `text` completes: content strings, calls, in order."""
        out: list[StreamItem] = []
        pending = self._held + text
        self._held = ""
        while pending:
            if self._inside:
                end = _find(pending, END, self._scanned)
                if end < 0:
                    self._held, self._scanned = pending, max(0, len(pending) - len(END) + 1)
                    if self._incremental:  # a tail that may begin </tool_call> is not the call's
                        self._advance(pending[: len(pending) - _prefix_tail(pending, END)], out)
                    return out
                self._close_call(pending[:end], True, out)
                pending = pending[end + len(END) :]
                continue
            start = _find(pending, START, 0)  # outside, only a tag's start is held: nothing is read again
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

    def finish(self) -> list[StreamItem]:
        """What was held back at the answer's end: a cut call (a call if it is whole), a tag's
        start that never became one (content), and whitespace kept when no call was made."""
        out: list[StreamItem] = []
        held, self._held = self._held, ""
        if self._inside:
            self._close_call(held, False, out)
        else:
            self._outside_text(held, out)
        if self._blank and not self.num_calls:
            out.append(self._blank)
        self._blank = ""
        return out

    def _advance(self, body: str, out: list[StreamItem]) -> None:
        fragments = self._reader.advance(body, False)
        if not self._header_sent and self._reader.name is not None:
            out.append(ToolCallHeader(self._reader.name))
            self._header_sent = True
            self.num_calls += 1
        out += [ArgumentsFragment(text) for text in fragments]

    def _outside_text(self, text: str, out: list[StreamItem]) -> None:
        if not text:
            return
        if self._segment_shown:
            out.append(text)
        elif text.strip():
            out.append(self._blank + text)
            self._blank, self._segment_shown = "", True
        else:
            self._blank += text

    def _close_call(self, body: str, closed: bool, out: list[StreamItem]) -> None:
        if self._incremental:
            self._advance(body, out)
        fragments = self._reader.advance(body, True)
        call = self._reader.call(body)
        header_sent = self._header_sent
        self._inside, self._header_sent, self._scanned = False, False, 0
        self._reader = _reader(self._parser, self._tools)
        if header_sent:  # its start went out: the rest of its arguments (what was sent stays)
            out += [ArgumentsFragment(text) for text in fragments]
        elif call is None:  # not a call: the text as written, and the whitespace before it
            out.append(self._blank + START + body + (END if closed else ""))
            self._blank, self._segment_shown = "", True
            return
        else:
            self.num_calls += 1
            out.append(call)
        self._blank, self._segment_shown = "", False  # a new segment after the call


def _find(text: str, marker: str, start: int) -> int:
    """Where `marker` begins in `text` from `start` (-1: nowhere); the one place the stream's
    blocks are searched, so each character is searched once however the deltas come (the tests
    count what it reads)."""
    return text.find(marker, start)


def _prefix_tail(text: str, marker: str) -> int:
    """Length of `text`'s longest tail that is a proper prefix of `marker`."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def header_delta(name: str, call_id: str, index: int) -> dict[str, Any]:
    """A streamed call's first delta, vLLM's shape: its index, id, type and name (arguments "")."""
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
    whole call (cut by max_tokens after its name) stays content, as in `answer_tool_calls` (a
    whole answer shaped as deltas: the Responses API's `response_body`)."""

    def __init__(self, choice: ToolChoice, incremental: bool = True) -> None:
        self.choice = choice
        self.num_calls = 0
        self._calls: ToolCallStream | RequiredCallStream = (
            RequiredCallStream(incremental)
            if choice.mode == "required"
            else ToolCallStream(choice.parser, choice.tools, incremental)
        )
        self._skipping = False  # the streamed call is past the first, without parallel_tool_calls

    def add(self, text: str) -> list[dict[str, Any]]:
        if self.choice.mode == "named":
            return self._named(text)
        return self._deltas(self._calls.add(text))

    def finish(self) -> list[dict[str, Any]]:
        if self.choice.mode == "named":
            return self._named("") if not self.num_calls else []
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
