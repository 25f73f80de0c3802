"""vLLM's `hermes` tool call parser's reading of one block (Qwen2.5, Qwen3, Qwen3-VL; Hermes' own):
a JSON object `{"name": string, "arguments": object}`, the arguments' text as
`json.dumps(arguments, ensure_ascii=False)` writes it."""

from __future__ import annotations

import json

from epd.gateway.tool_parsers.calls import ParsedToolCall
from epd.gateway.tool_parsers.json_text import CallStart, JsonNormalizer


class HermesReader:
    """One hermes `<tool_call>` block's body, `{"name": "...", "arguments": {...}}`, read as it
    grows (`CallReader`): its arguments stream once its start is read in the templates' order."""

    def __init__(self) -> None:
        self.name: str | None = None
        self._start = CallStart("arguments")
        self._fed = 0  # the body's characters read (from the arguments' `{`, fed to the normalizer)
        self._normalizer = JsonNormalizer()
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
