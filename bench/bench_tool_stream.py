"""The tool call parsers' cost on one long streamed call: a call whose one argument is a 57 KB
string, fed to `ToolCallStream` 4 characters at a time (a token's text is about that), as the chat
stream feeds it, for hermes and qwen3_coder; prints each parser's wall time (one run, no model).

    PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python bench/bench_tool_stream.py
"""

from __future__ import annotations

import argparse
import json
import time

from epd.gateway.tool_parsers.stream import TOOL_CALL_PARSERS, ToolCallStream


def call_text(parser: str, value: str) -> str:
    """One call writing `value` as the parser's family writes it."""
    if parser == "hermes":
        return (
            "<tool_call>\n" + json.dumps({"name": "write", "arguments": {"text": value}}) + "\n</tool_call>"
        )
    return (
        f"<tool_call>\n<function=write>\n<parameter=text>\n{value}\n</parameter>\n</function>\n</tool_call>"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--value-chars", type=int, default=57_000)
    parser.add_argument("--delta-chars", type=int, default=4)
    args = parser.parse_args()
    value = ("lorem ipsum dolor sit amet " * (args.value_chars // 27 + 1))[: args.value_chars]
    for name in TOOL_CALL_PARSERS:
        text = call_text(name, value)
        started = time.perf_counter()
        stream = ToolCallStream(name)
        num_items = 0
        for i in range(0, len(text), args.delta_chars):
            num_items += len(stream.add(text[i : i + args.delta_chars]))
        num_items += len(stream.finish())
        seconds = time.perf_counter() - started
        print(
            f"{name:12s} {len(text)} chars in {args.delta_chars}-char deltas: {seconds:.3f} s, {num_items} items"
        )


if __name__ == "__main__":
    main()
