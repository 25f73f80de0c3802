"""JSON text read as it grows, a character at a time and never again, for the calls written as
JSON (hermes' blocks, tool_choice "required"'s array): where its strings are (`JsonStringScan`), a
call's start up to its arguments' `{` (`CallStart`), and a value rewritten as `json.dumps` writes
it as far as it is certain (`JsonNormalizer`), so that a streamed call's fragments join to exactly
the whole answer's arguments."""

from __future__ import annotations

import json
from enum import Enum


class StringPlace(Enum):
    """Where a character stands against a JSON text's strings."""

    OUTSIDE = "outside"
    OPENING = "opening"  # a string's opening quote
    INSIDE = "inside"  # a string's character, a backslash and what it escapes included
    CLOSING = "closing"  # a string's closing quote


class JsonStringScan:
    """A JSON text's strings, told apart from the rest a character at a time: the one reading of
    quotes and escapes (an escaped quote does not close a string) that every reader here shares."""

    def __init__(self) -> None:
        self.inside = False
        self._escaped = False  # inside: the last character was a backslash

    def read(self, char: str) -> StringPlace:
        """Where the next character, `char`, stands."""
        if not self.inside:
            self.inside = char == '"'
            return StringPlace.OPENING if self.inside else StringPlace.OUTSIDE
        if self._escaped:
            self._escaped = False
        elif char == "\\":
            self._escaped = True
        elif char == '"':
            self.inside = False
            return StringPlace.CLOSING
        return StringPlace.INSIDE


class CallStart:
    """A call's start, read character by character as it comes (never read again): `{"name":
    "<name>", "<key>": {` with JSON whitespace between the tokens, the order the templates teach
    (hermes' `arguments`) and vLLM's "required" schema lists (`parameters`). `name` is set once it
    is read; `failed` once the text cannot be that start."""

    def __init__(self, key: str) -> None:
        self._tokens: tuple[str | None, ...] = ("{", '"name"', ":", None, ",", json.dumps(key), ":", "{")
        self._token = 0  # the token being read (None: the name's string)
        self._offset = 0  # its characters read
        self._raw: list[str] = []  # the name's string, raw
        self._string = JsonStringScan()
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
                place = self._string.read(char)
                if place is StringPlace.INSIDE:
                    self._raw.append(char)
                elif place is StringPlace.CLOSING:
                    try:
                        self._name = json.loads('"' + "".join(self._raw) + '"')
                    except ValueError:
                        self.failed = True
                        continue
                    self.failed = not self._name
                    self._token, self._offset = self._token + 1, 0
                elif place is StringPlace.OUTSIDE and char not in " \t\n\r":
                    self.failed = True
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


_SCALAR_CHARS = frozenset("-+.0123456789eEtruefalsnNaIiy")


class JsonNormalizer:
    """A JSON value's text, fed as it grows, rewritten as `json.dumps(json.loads(text),
    ensure_ascii=False)` writes it, as far as it is certain: structure at once, a string's
    characters as their escapes complete, a number or literal when it ends. Stops (sends nothing
    more) at the value's end or at text that is not JSON."""

    def __init__(self) -> None:
        self._depth = 0
        self._done = False
        self._string = JsonStringScan()
        self._raw = ""  # the string's characters not yet sent (raw, escapes as written)
        self._scalar = ""  # a number or literal being read
        self._out: list[str] = []

    def feed(self, text: str) -> None:
        for char in text:
            if self._done:
                return
            place = self._string.read(char)
            if place is StringPlace.INSIDE:
                self._raw += char
                continue
            if place is StringPlace.CLOSING:
                self._send_string(len(self._raw))
                self._out.append('"')
                continue
            if char in _SCALAR_CHARS:
                self._scalar += char
                continue
            self._end_scalar()
            if char in " \t\n\r":
                continue
            if place is StringPlace.OPENING:
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
        if self._string.inside and not self._done:
            self._send_string(safe_string_end(self._raw))
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


def safe_string_end(raw: str) -> int:
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
