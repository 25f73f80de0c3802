"""An answer's text parted into content and calls by a family's parser (`TOOL_CALL_PARSERS`):
whole (`parse_tool_calls`) or delta by delta (`ToolCallStream`, the same rules: the whole answer
is the stream fed one delta). The `<tool_call>` blocks are found here; each block's body is read
by its family's reader (`hermes.HermesReader`, `qwen3_coder.Qwen3CoderReader`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from epd.gateway.tool_parsers import markers  # its find_marker looked up at each call: the tests count it
from epd.gateway.tool_parsers.calls import (
    ArgumentsFragment,
    CallReader,
    ParsedToolCall,
    StreamItem,
    ToolCallHeader,
)
from epd.gateway.tool_parsers.hermes import HermesReader
from epd.gateway.tool_parsers.markers import END, START, prefix_tail
from epd.gateway.tool_parsers.qwen3_coder import Qwen3CoderReader

TOOL_CALL_PARSERS = ("hermes", "qwen3_coder")
"""The names `--tool-call-parser` takes (vLLM's)."""


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


def _reader(parser: str, tools: Sequence[Mapping[str, Any]]) -> CallReader:
    return Qwen3CoderReader(tools) if parser == "qwen3_coder" else HermesReader()


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
                end = markers.find_marker(pending, END, self._scanned)
                if end < 0:
                    self._held, self._scanned = pending, max(0, len(pending) - len(END) + 1)
                    if self._incremental:  # a tail that may begin </tool_call> is not the call's
                        self._advance(pending[: len(pending) - prefix_tail(pending, END)], out)
                    return out
                self._close_call(pending[:end], True, out)
                pending = pending[end + len(END) :]
                continue
            # outside, only a tag's start is held: nothing is read again
            start = markers.find_marker(pending, START, 0)
            if start >= 0:
                self._outside_text(pending[:start], out)
                self._inside = True
                pending = pending[start + len(START) :]
                continue
            keep = prefix_tail(pending, START)
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
