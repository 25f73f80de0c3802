"""OpenAI's function tools as every door checks them (plain Python, as `epd.stages.messages`): a
request's `tools` list, the chat template's `tools` variable (transformers' `apply_chat_template(...,
tools=...)`), and an earlier turn's tool calls, whose arguments are a JSON object's text.

    tools = [{"type": "function", "function": {"name": "get_weather", "description": "...",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]

The wire carries the tools as JSON text (`to_json` / `from_json`, in
`epd.v1.ChatTemplateOptions.tools_json`), as it carries `chat_template_kwargs`: a schema's integers
stay integers. A template that does not read `tools` renders the conversation without them, as
vLLM's does.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from epd.stages.errors import InvalidRequest

MAX_TOOLS = 128
"""Tools of one request at most (OpenAI's limit)."""
MAX_TOOLS_JSON_CHARS = 131072
"""The tools' JSON text at most: the schemas of many functions (the template renders all of them
into the prompt, whose token limit prefill checks too)."""
MAX_NAME_CHARS = 64
"""A function's name at most (OpenAI's: letters, digits, underscores, dashes, dots)."""
MAX_ARGUMENTS_CHARS = 65536
"""A tool call's arguments' JSON text at most (in an earlier turn)."""

_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")
_EXAMPLE = (
    '{"type": "function", "function": {"name": "get_weather", "description": "...", "parameters": '
    '{"type": "object", "properties": {...}}}}'
)


def check_tools(tools: Any) -> None:
    """InvalidRequest, saying what to change, unless `tools` is a list of at most `MAX_TOOLS`
    function tools, each {"type": "function", "function": {"name", "description"?, "parameters"?,
    "strict"?}}, with names of letters, digits, `_`, `-` and `.` (at most `MAX_NAME_CHARS`), told
    apart, and parameters a JSON Schema object; their JSON text at most `MAX_TOOLS_JSON_CHARS`."""
    if not isinstance(tools, (list, tuple)):
        raise InvalidRequest(f"'tools' must be a list of function tools such as {_EXAMPLE}")
    if len(tools) > MAX_TOOLS:
        raise InvalidRequest(f"'tools' has {len(tools)} tools; at most {MAX_TOOLS} are accepted")
    names = set()
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping) or tool.get("type") != "function":
            raise InvalidRequest(
                f'tools[{i}] must be a function tool, {{"type": "function", "function": {{...}}}}'
            )
        function = tool.get("function")
        if not isinstance(function, Mapping):
            raise InvalidRequest(f"tools[{i}].function must be an object such as {_EXAMPLE}")
        unknown = sorted(str(k)[:32] for k in tool if k not in ("type", "function"))
        if unknown:
            raise InvalidRequest(f"tools[{i}] has unknown fields {unknown[:4]}; a tool is type and function")
        name = function.get("name")
        check_function_name(name, f"tools[{i}].function.name")
        if name in names:
            raise InvalidRequest(f"tools has two functions named {name!r}; give each function its own name")
        names.add(name)
        if not isinstance(function.get("description", ""), (str, type(None))):
            raise InvalidRequest(f"tools[{i}].function.description must be a string")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, Mapping):
            raise InvalidRequest(
                f'tools[{i}].function.parameters must be a JSON Schema object such as {{"type": "object", '
                '"properties": {...}}'
            )
        if not isinstance(function.get("strict", False), (bool, type(None))):
            raise InvalidRequest(f"tools[{i}].function.strict must be true or false")
        unknown = sorted(
            str(k)[:32] for k in function if k not in ("name", "description", "parameters", "strict")
        )
        if unknown:
            raise InvalidRequest(
                f"tools[{i}].function has unknown fields {unknown[:4]}; it takes name, description, parameters, strict"
            )
    try:
        num_chars = len(to_json(tools))
    except (TypeError, ValueError) as exc:
        raise InvalidRequest(f"'tools' must hold JSON values only: {str(exc)[:100]}") from None
    if num_chars > MAX_TOOLS_JSON_CHARS:
        raise InvalidRequest(
            f"'tools' is {num_chars} characters of JSON; the limit is {MAX_TOOLS_JSON_CHARS}: send fewer "
            "tools or shorter schemas"
        )


def check_function_name(name: Any, label: str) -> None:
    """InvalidRequest unless `name` is a function's name as OpenAI's (letters, digits, `_`, `-`, `.`)."""
    if not isinstance(name, str) or not name or len(name) > MAX_NAME_CHARS or not set(name) <= _NAME_CHARS:
        shown = json.dumps(name)[:80] if isinstance(name, str) else type(name).__name__
        raise InvalidRequest(
            f"{label} must be a function's name of 1 to {MAX_NAME_CHARS} letters, digits, '_', '-' or '.', "
            f"got {shown}"
        )


def function_names(tools: Sequence[Mapping[str, Any]]) -> list[str]:
    """The names of checked tools, in order."""
    return [tool["function"]["name"] for tool in tools]


def parsed_arguments(arguments: str, label: str) -> dict[str, Any]:
    """A tool call's arguments, JSON text of an object, as the object (what a chat template reads:
    vLLM parses them so before it renders the conversation); InvalidRequest naming `label` when
    the text is not a JSON object's."""
    if len(arguments) > MAX_ARGUMENTS_CHARS:
        raise InvalidRequest(f"{label} is {len(arguments)} characters; the limit is {MAX_ARGUMENTS_CHARS}")
    try:
        value = json.loads(arguments)
    except (ValueError, RecursionError):
        raise InvalidRequest(
            f"{label} is not JSON text; send the call's arguments as a JSON object's text, such as '{{\"city\": \"Paris\"}}'"
        ) from None
    if not isinstance(value, dict):
        raise InvalidRequest(f'{label} must be a JSON object\'s text, such as \'{{"city": "Paris"}}\'')
    return value


def to_json(tools: Sequence[Mapping[str, Any]]) -> str:
    """The wire's form (`epd.v1.ChatTemplateOptions.tools_json`): JSON's own text."""
    return json.dumps(list(tools), ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def from_json(text: str) -> tuple[dict[str, Any], ...]:
    """`to_json`'s inverse: () for ""; InvalidRequest for text that is not a JSON list (what the
    list holds is checked by `check_tools`)."""
    if not text:
        return ()
    if len(text) > MAX_TOOLS_JSON_CHARS:
        raise InvalidRequest(f"tools_json is {len(text)} characters; the limit is {MAX_TOOLS_JSON_CHARS}")
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        raise InvalidRequest("tools_json is not JSON text; send a JSON list of function tools") from None
    if not isinstance(value, list):
        raise InvalidRequest("tools_json must be a JSON list of function tools")
    return tuple(value)
