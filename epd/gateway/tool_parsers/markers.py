"""The `<tool_call>` tags that hold a call in hermes' and qwen3_coder's answers, and the search
for a marker in text that grows delta by delta."""

from __future__ import annotations

START, END = "<tool_call>", "</tool_call>"


def find_marker(text: str, marker: str, start: int) -> int:
    """Where `marker` begins in `text` from `start` (-1: nowhere); the one place the stream's
    blocks and qwen3_coder's tags are searched, so each character is searched once however the
    deltas come (the tests count what it reads: callers reach it as `markers.find_marker`, so that a
    counting stand-in sees every search)."""
    return text.find(marker, start)


def prefix_tail(text: str, marker: str) -> int:
    """Length of `text`'s longest tail that is a proper prefix of `marker`."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
