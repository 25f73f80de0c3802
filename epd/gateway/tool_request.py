"""OpenAI's `tools` and `tool_choice` of a chat request (no HTTP in here), with vLLM's meanings:

    tool_choice  "none"      the tools are rendered into the prompt (vLLM's default now); the
                             answer is not parsed
                 "auto"      the default with tools: the answer's calls are parsed out of its text
                             by the server's `--tool-call-parser` (needs `--enable-auto-tool-choice`:
                             a 400 naming both flags without it, as vLLM's)
                 "required"  the answer is forced, by a structured output, to a JSON array of one
                             call or more, [{"name", "parameters"}] (vLLM's schema)
                 {"type": "function", "function": {"name"}}  forced to that function's arguments,
                             a JSON object matching its `parameters`: one call

"required" and a named function need no flag (their grammar says where the calls are), and
cannot go with another structured output (a 400: one grammar per answer).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from epd.gateway.json_fields import boolean_field, checked_text, shown_value
from epd.model_runtime.sampling import StructuredOutputs
from epd.stages.errors import InvalidRequest
from epd.stages.tools import check_tools, function_names, to_json

TOOL_CHOICE_MODES = ("none", "auto", "required", "named")
_NAMED_EXAMPLE = '{"type": "function", "function": {"name": "get_weather"}}'


@dataclass(frozen=True)
class ToolChoice:
    """What the request's `tool_choice` asks of the answer."""

    mode: str = "none"
    """"none", "auto", "required" or "named"."""
    function: str = ""
    """The function's name, for "named"."""
    parallel: bool = True
    """OpenAI's `parallel_tool_calls`: false keeps an answer's first call alone (vLLM's)."""
    tools: tuple[Mapping[str, Any], ...] = field(default=(), compare=False)
    """The request's tools (checked), whose schemas type what a parser reads ("auto"); not part
    of what the choice is (two choices of "auto" are equal)."""
    parser: str = "hermes"
    """How the answer's text is read for calls ("auto"): the server's `--tool-call-parser`, set by
    the chat door (`epd.gateway.tool_parsers.stream.TOOL_CALL_PARSERS`)."""

    @property
    def parses_text(self) -> bool:
        """The answer's text is parsed for calls by the server's tool call parser ("auto")."""
        return self.mode == "auto"

    @property
    def forced(self) -> bool:
        """The answer is forced to calls by a structured output ("required" or "named")."""
        return self.mode in ("required", "named")


def parse_tools(body: dict[str, Any]) -> tuple[tuple[dict[str, Any], ...], ToolChoice]:
    """The request's tools (checked: `epd.stages.tools.check_tools`) and its tool choice (with
    `parallel_tool_calls`); InvalidRequest naming the field. No tools: tool_choice "none" or "auto" ask for nothing (as
    vLLM's), a forced choice is refused."""
    tools = checked_tools(body)
    choice = _tool_choice(body.get("tool_choice"), function_names(tools))
    return tools, replace(choice, parallel=boolean_field(body, "parallel_tool_calls", True), tools=tools)


def checked_tools(body: dict[str, Any]) -> tuple[dict[str, Any], ...]:
    """The request's tools, checked as `parse_tools` checks them, without its tool choice (which
    /tokenize ignores, as vLLM's: only the tools are rendered)."""
    tools = body.get("tools")
    tools = [] if tools is None else tools
    check_tools(tools)
    checked_text(to_json(tools), "tools")  # text the wire can carry (no lone surrogate)
    return tuple(tools)


def _tool_choice(value: Any, names: Sequence[str]) -> ToolChoice:
    if value is None:
        return ToolChoice("auto" if names else "none")
    if value in ("none", "auto", "required"):
        if value == "required" and not names:
            raise InvalidRequest("tool_choice \"required\" needs tools: send the functions in 'tools'")
        return ToolChoice(value if names else "none")
    function = value.get("function") if isinstance(value, dict) else None
    if (
        not isinstance(function, dict)
        or value.get("type") != "function"
        or not isinstance(function.get("name"), str)
    ):
        raise InvalidRequest(
            f'\'tool_choice\' must be "none", "auto", "required" or {_NAMED_EXAMPLE}, got {shown_value(value)}'
        )
    name = function["name"]
    if name not in names:
        listed = ", ".join(repr(n) for n in names[:16]) or "none"
        raise InvalidRequest(
            f"tool_choice names the function {json.dumps(name[:64])}, which is not in 'tools' (its functions: "
            f"{listed}): name one of them, or add it to 'tools'"
        )
    return ToolChoice("named", name)


def forced_structured_outputs(
    tools: Sequence[Mapping[str, Any]], choice: ToolChoice, asked: StructuredOutputs | None
) -> StructuredOutputs | None:
    """The structured output a forced tool choice puts on the answer (`asked`, the request's own,
    when the choice is not forced); InvalidRequest when the request asks for another one too."""
    if not choice.forced:
        return asked
    if asked is not None:
        raise InvalidRequest(
            f"tool_choice {_shown_choice(choice)} forces the answer with a structured output of its own; "
            'leave response_format, structured_outputs and guided_* unset, or set tool_choice to "auto" or "none"'
        )
    by_name = {tool["function"]["name"]: tool["function"] for tool in tools}
    if choice.mode == "named":
        schema = _parameters(by_name[choice.function])
    else:
        schema = _required_schema(list(by_name.values()))
    return StructuredOutputs(json_schema=json.dumps(schema, ensure_ascii=False, separators=(",", ":")))


def _shown_choice(choice: ToolChoice) -> str:
    return (
        f'{{"function": {{"name": {json.dumps(choice.function)}}}}}'
        if choice.mode == "named"
        else '"required"'
    )


def _parameters(function: Mapping[str, Any]) -> dict[str, Any]:
    """A function's parameters schema; none given: any object, as vLLM's."""
    parameters = function.get("parameters")
    return copy.deepcopy(dict(parameters)) if parameters else {"type": "object", "properties": {}}


def _required_schema(functions: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """vLLM's schema of "required": an array of at least one {"name", "parameters"} object, each
    one of the functions; the parameters' `$defs` gathered at the top, where their `$ref`s point."""
    defs: dict[str, Any] = {}
    alternatives = []
    for function in functions:
        parameters = _parameters(function)
        defs.update(parameters.pop("$defs", {}) or {})
        alternatives.append(
            {
                "properties": {
                    "name": {"type": "string", "enum": [function["name"]]},
                    "parameters": parameters,
                },
                "required": ["name", "parameters"],
            }
        )
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {"type": "object", "anyOf": alternatives},
    }
    if defs:
        schema["$defs"] = defs
    return schema


def check_auto_tool_choice(choice: ToolChoice, enabled: bool) -> None:
    """InvalidRequest for tool_choice "auto" (the default with tools) on a server started without
    `--enable-auto-tool-choice` (vLLM's 400: without a parser the calls could not be found)."""
    if choice.mode == "auto" and not enabled:
        raise InvalidRequest(
            'tool_choice "auto" (the default when tools are given) needs the server started with '
            "--enable-auto-tool-choice and --tool-call-parser: ask its operator, or send tool_choice "
            '"none" (the tools are shown to the model, its answer is not parsed), "required" or a named function'
        )
