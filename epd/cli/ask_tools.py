"""`epd ask --tools FILE` (a JSON list of OpenAI's function tools), `--tool-choice`,
`--tool-call-parser` and `--no-parallel-tool-calls`: the chat API's tool calling from the command
line, embedded and against --endpoint alike.

The tools are rendered into the prompt by the chat template (the SDK's `tools=`, the template's
`tools` variable), and the answer's calls are read as the HTTP API reads them
(`epd.gateway.tool_parsers.answer.answer_tool_calls`), here, from the answer's text: gRPC's Ask
answers the raw text, as vLLM's offline `LLM.chat(tools=...)` does. `--tool-choice`:

    auto      the default with --tools: the calls the model writes, found by --tool-call-parser
              (hermes or qwen3_coder, the server's names), needed as `vllm serve` needs it with
              --enable-auto-tool-choice: a parser that does not match the model finds no call
    required  the answer forced, by a structured output, to vLLM's JSON array of calls
    NAME      forced to the arguments of the function NAME (one call)
    none      the tools in the prompt, the answer's text as it is

`--no-parallel-tool-calls` is the chat API's `"parallel_tool_calls": false`: the answer's first
call alone (vLLM drops the others after parsing, and so does `answer_tool_calls` here).

The parser is the client's flag, not the server's report: the gateway's gRPC door parses nothing
(its --tool-call-parser belongs to its HTTP door, which may be off), and the model family decides
the parser, which the user knows as a vLLM user does (`--tool-call-parser` on `vllm serve`).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from epd.client import AskResult
    from epd.gateway.tool_parsers.calls import ParsedToolCall
    from epd.gateway.tool_request import ToolChoice
    from epd.model_runtime.sampling import StructuredOutputs

_CHOICE_WORDS = ("none", "auto", "required")


@dataclass(frozen=True)
class AskTools:
    """The request's tools, what its tool choice asks of the answer, and the structured output a
    forced choice puts on it (None: the flags' own, if any)."""

    tools: tuple[dict[str, Any], ...]
    choice: ToolChoice
    forced: StructuredOutputs | None

    @property
    def parses(self) -> bool:
        """The answer is read for calls (every choice but "none")."""
        return self.choice.mode != "none"

    def answer(self, result: AskResult) -> ToolAnswer:
        """The answer's content, calls and finish reason, as the chat API's message has them."""
        from epd.gateway.tool_parsers.answer import answer_tool_calls, tool_finish_reason

        content, calls = answer_tool_calls(result.answer, self.choice)
        finish = tool_finish_reason(self.choice, len(calls), result.finish_reason or "stop")
        return ToolAnswer(content, calls, finish)


@dataclass(frozen=True)
class ToolAnswer:
    """An answer under a tool choice, the chat API's message: its content (None when the calls
    are all), its calls, and vLLM's finish reason ("tool_calls" when calls were made)."""

    content: str | None
    calls: list[ParsedToolCall]
    finish_reason: str

    def to_dict(self) -> dict[str, Any]:
        """The fields `epd ask --json` adds: the chat message's `content` and `tool_calls`."""
        return {
            "content": self.content,
            "tool_calls": [call.to_json() for call in self.calls],
            "finish_reason": self.finish_reason,
        }

    def lines(self) -> list[str]:
        """What the terminal shows: the content, then a line per call, `tool call: NAME ARGUMENTS`."""
        text = [self.content] if self.content else []
        return text + [f"tool call: {call.name} {call.arguments}" for call in self.calls]


def ask_tools(args: argparse.Namespace) -> AskTools | None:
    """--tools, --tool-choice, --tool-call-parser and --no-parallel-tool-calls read and checked
    (None without --tools);
    ValueError saying what to change, InvalidRequest for tools no door takes (the HTTP API's 400s)."""
    from epd.cli import configs
    from epd.gateway.tool_request import forced_structured_outputs, parse_tools

    if not args.tools:
        flags = (
            ("--tool-choice", args.tool_choice),
            ("--tool-call-parser", args.tool_call_parser),
            ("--no-parallel-tool-calls", not args.parallel_tool_calls),
        )
        given = [flag for flag, value in flags if value]
        if given:
            raise ValueError(
                f"{' and '.join(given)} read the calls of --tools FILE: give --tools FILE or drop them"
            )
        return None
    if args.prompt is not None:
        raise ValueError("--tools are rendered by the chat template; --prompt has no template: drop one")
    if args.questions or args.interactive:
        raise ValueError(
            "--tools answers one request: drop --question / --interactive (a conversation with the "
            "tools' results goes in --messages FILE, with the assistant's tool_calls and tool messages)"
        )
    tools = _read_tools(args.tools)
    value = args.tool_choice
    named = value is not None and value not in _CHOICE_WORDS
    body = {
        "tools": tools,
        "tool_choice": {"type": "function", "function": {"name": value}} if named else value,
        "parallel_tool_calls": args.parallel_tool_calls,
    }
    checked, choice = parse_tools(body)
    if choice.mode == "auto":
        if not args.tool_call_parser:
            raise ValueError(
                "--tool-choice auto (the default with --tools) reads the calls out of the answer's text: "
                "give --tool-call-parser hermes (Qwen2.5, Qwen3, Qwen3-VL) or qwen3_coder (Qwen3-Coder, "
                "Qwen3.5), the model's form; or force the calls with --tool-choice required or a function's name"
            )
        choice = replace(choice, parser=args.tool_call_parser)
    if choice.forced and configs.structured_outputs(args) is not None:
        raise ValueError(
            f"--tool-choice {value} forces the answer with a structured output of its own: drop "
            "--json-schema / --json-object / --regex / --choice / --grammar, or use --tool-choice auto or none"
        )
    return AskTools(checked, choice, forced_structured_outputs(checked, choice, None))


def _read_tools(path: str) -> Any:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"--tools {path}: cannot read it ({exc.strerror or exc})") from None
    try:
        return json.loads(text)
    except ValueError as exc:
        raise ValueError(
            f"--tools {path}: not JSON ({exc}); give a list of OpenAI function tools, "
            '[{"type": "function", "function": {"name": ..., "parameters": {...}}}]'
        ) from None
