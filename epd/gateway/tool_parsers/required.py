"""tool_choice "required"'s answer: the JSON array of calls that vLLM's schema forces with a
structured output, read as it is generated, item by item."""

from __future__ import annotations

import json

from epd.gateway.tool_parsers.calls import ArgumentsFragment, ParsedToolCall, StreamItem, ToolCallHeader
from epd.gateway.tool_parsers.json_text import CallStart, JsonNormalizer, JsonStringScan, StringPlace


class RequiredCallStream:
    """tool_choice "required"'s answer, the grammar's JSON array `[{"name": ..., "parameters":
    {...}}, ...]` (vLLM's schema), parted as it is generated, as vLLM's stream parts it: an item's
    `ToolCallHeader` once `{"name": "...", "parameters": {` is read (the schema's order, the
    grammar's), then its parameters' text as `ArgumentsFragment`s in `json.dumps`'s spelling
    (`JsonNormalizer`, as hermes' arguments), so that they join to exactly the whole answer's
    arguments; an item written otherwise goes out whole at its end. Each character is read once.
    `incremental` False: each item whole at its end (`ParsedToolCall`), the whole answer's calls,
    which are calls only when the array is `complete`. The text is content when no call went out
    and it is not such an array (a cut by max_tokens, as vLLM's whole answer); a call that went out
    stays (the rest of the text is dropped), as vLLM's stream."""

    def __init__(self, incremental: bool = True) -> None:
        self.num_calls = 0
        self._incremental = incremental
        # "open" ([), "item" ({, or ] after [), "in_item", "next" (, or ]), "end", "broken"
        self._phase = "open"
        self._text: list[str] = []  # the whole answer: the content when it is no array of calls
        self._first = True  # no item yet: `]` may close the array
        self._item: list[str] = []  # the current item's text
        self._depth = 0  # the item's brackets open
        self._string = JsonStringScan()  # the items' strings, whose brackets are not the item's
        self._start = CallStart("parameters")
        self._normalizer: JsonNormalizer | None = None  # the item's parameters, from their `{`
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
        self._start = CallStart("parameters")
        self._start.feed("{")
        self._normalizer, self._sent, self._header_sent = None, [], False

    def _read_item(self, text: str, at: int, out: list[StreamItem]) -> int:
        """Reads the current item's text from `text[at]`, to its end or the delta's; where it stopped."""
        end = len(text)
        for i in range(at, len(text)):
            char = text[i]
            if self._string.read(char) is not StringPlace.OUTSIDE:
                continue
            if char in "{[":
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
            self._normalizer = JsonNormalizer()
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
            if self._normalizer is not None:  # as the stream sends it: the name, then the parameters' text
                call = ParsedToolCall(self._start.name or "", "".join(self._sent))
            else:
                call = ParsedToolCall(item["name"], json.dumps(item["parameters"], ensure_ascii=False))
            out.append(call)
            self.num_calls += 1
