"""What a tool call parser gives (`epd.gateway.tool_parsers`): a whole call, or a streamed call's
header and its arguments' fragments; and the contract each family's reader of one `<tool_call>`
block's body keeps (`hermes.HermesReader`, `qwen3_coder.Qwen3CoderReader`)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol


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


class CallReader(Protocol):
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
