"""OpenAI's Responses API JSON (`POST /v1/responses`) <-> the pipeline (no HTTP in here), as vLLM
serves it over a chat model: the body becomes a chat-completions body, parsed by chat's own
`parse_chat_request` (one set of checks, one `ChatRequest`).

    input         a string (the user's message), or a list of items: messages {"role": "user" |
                  "system" | "developer" | "assistant", "content": a string or parts}, whose parts
                  are "input_text" (an assistant's "output_text"), "input_image" {"image_url": an
                  https:// or data: URL} and, as vLLM's Responses API takes them, chat's own
                  "text", "image_url" and "video_url" parts: a video goes in a
                  {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,..."}} part
                  (Responses has no video part of its own); `function_call` {call_id, name,
                  arguments} and `function_call_output` {call_id, output} items are the tool
                  history (an assistant's `tool_calls`, a tool message); `reasoning` items are
                  dropped (a template renders no earlier turn's thinking)
    instructions  a system message before the input
    max_output_tokens, temperature, top_p, and chat's vLLM extras (top_k, seed, stop, min_p,
                  repetition_penalty, ..., "media" frame sampling, "pruning", cache_salt,
                  chat_template_kwargs, priority: `PASSED_TO_CHAT`)
    tools         Responses' flat {"type": "function", "name", "description", "parameters"}
                  (other tool types, hosted by OpenAI, are refused); `tool_choice` "none" |
                  "auto" | "required" | {"type": "function", "name"}; `parallel_tool_calls`
    text.format   {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "name",
                  "schema", "strict"?}: chat's `response_format` (structured outputs)
    reasoning     accepted and not acted on: vLLM reads `reasoning.effort` for gpt-oss's Harmony
                  format, which epd does not serve; a thinking model's thinking is turned off by
                  `chat_template_kwargs: {"enable_thinking": false}`, as in chat, and the
                  `--reasoning-parser` parts its answer into a reasoning item
    store         false only: epd keeps no responses (vLLM stores them only with
                  VLLM_ENABLE_RESPONSES_API_STORE set), so `store: true`, `previous_response_id`,
                  `background` and `conversation` are refused with a 400; send the whole
                  conversation in `input` instead
    include, top_logprobs  `include: ["message.output_text.logprobs"]` asks for the output
                  text's logprobs, each with the `top_logprobs` most likely tokens (0 to the
                  server's --max-logprobs; 0 by default): chat's `logprobs: true` and
                  `top_logprobs`, vLLM's; without it top_logprobs is ignored, as vLLM ignores
                  it. vLLM's five other `include` values are accepted and give nothing, as
                  vLLM's simple path gives nothing for them (epd runs no hosted tools and keeps no
                  encrypted reasoning); a value vLLM does not take is a 400, as vLLM's
    metadata, user  accepted; metadata comes back in the response

The answer is shaped in `epd.gateway.responses_events` (`ResponseEvents`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from epd.gateway.chat_request import ChatRequest, parse_chat_request
from epd.gateway.json_fields import boolean_field, lax_value, shown_value
from epd.gateway.request_fields import KNOWN_CHAT_FIELDS, UNSUPPORTED_CHAT_FIELDS, refuse_unsupported_fields
from epd.gateway.structured_request import GUIDED_FIELDS
from epd.model_runtime.sampling import GenerationConfig
from epd.stages.errors import InvalidRequest
from epd.video.types import SamplingOptions

PASSED_TO_CHAT = frozenset(
    {
        "model", "stream", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos",
        "repetition_penalty", "presence_penalty", "frequency_penalty", "min_p", "min_tokens",
        "logit_bias", "stop_token_ids", "include_stop_str_in_output", "allowed_token_ids", "bad_words",
        "skip_special_tokens", "spaces_between_special_tokens", "priority", "cache_salt", "request_id",
        "media", "pruning", "chat_template_kwargs", "chat_template", "include_reasoning",
        "parallel_tool_calls", "user", "service_tier", "structured_outputs", *GUIDED_FIELDS,
        # chat's unsupported fields (vLLM's mm_processor_kwargs, best_of, ...): refused by chat's check
        *(set(UNSUPPORTED_CHAT_FIELDS) - {"functions", "function_call"}),
    }
)  # fmt: skip
"""Fields that mean the same in a Responses body as in chat's (vLLM's extras among them): passed as
they are; chat's unsupported ones too, refused by chat's check with its own message (but for
its deprecated `functions` / `function_call`, which Responses does not have: logged as unknown)."""

_TRANSLATED = frozenset(
    {
        "input", "instructions", "max_output_tokens", "tools", "tool_choice", "text", "reasoning", "metadata",
        "include", "top_logprobs",
    }
)  # fmt: skip
LOGPROBS_INCLUDE = "message.output_text.logprobs"
"""The `include` value that asks for the output text's logprobs (vLLM's and OpenAI's)."""
INCLUDE_VALUES = (
    "code_interpreter_call.outputs",
    "computer_call_output.output.image_url",
    "file_search_call.results",
    "message.input_image.image_url",
    LOGPROBS_INCLUDE,
    "reasoning.encrypted_content",
)
"""The `include` values vLLM's request takes (its ResponsesRequest's Literal): clients that always
send one (Codex sends "reasoning.encrypted_content") are served. But for the logprobs, each asks
for what epd has none of (hosted tools' output, an input image's URL, encrypted reasoning to send
back), so it adds nothing to the answer, as from vLLM's non-Harmony path."""
_CHAT_NAMES = {
    "messages": "'input' (a string, or a list of messages)",
    "max_tokens": "'max_output_tokens'",
    "max_completion_tokens": "'max_output_tokens'",
    "response_format": "'text': {\"format\": {...}}",
}
"""Chat's names of what the Responses API asks under other names: a 400 naming the right one,
rather than a request answered without what it asked for."""

_RENAMED = {
    "'max_completion_tokens'": "'max_output_tokens'",
    "response_format": "text.format",
    "a string id, function.name and function.arguments": "a string call_id, name and arguments",
}
"""Chat's names in its refusals -> the names a Responses body sent them under."""

_NOT_STORED = (
    "epd keeps no responses (vLLM stores them only with VLLM_ENABLE_RESPONSES_API_STORE set): "
    "send the whole conversation in 'input', earlier answers as assistant messages and "
    "function_call items"
)
_UNSUPPORTED = {
    "background": (False,),
    "truncation": ("disabled",),
    "max_tool_calls": (),
    "prompt": (),
}
"""Responses fields this server does not implement, with the values that ask for nothing."""

_KNOWN = (
    set(PASSED_TO_CHAT)
    | _TRANSLATED
    | set(_CHAT_NAMES)
    | set(_UNSUPPORTED)
    | {
        "store",
        "previous_response_id",
        "conversation",
        "stream_options",
    }
)


def parse_responses_request(
    body: Any, served_model: str, sampling_defaults: SamplingOptions, generation_defaults: GenerationConfig
) -> ChatRequest:
    """Validate a Responses body into the request chat's handler runs (its `responses` set to the
    fields the answer repeats); raises InvalidRequest (400) or NotFound (404, model)."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    if boolean_field(body, "store", False):
        raise InvalidRequest(f"'store': true is not supported; leave it unset or false: {_NOT_STORED}")
    for name in ("previous_response_id", "conversation"):
        if body.get(name) is not None:
            raise InvalidRequest(f"'{name}' is not supported: {_NOT_STORED}")
    for name, instead in _CHAT_NAMES.items():
        if name in body:
            raise InvalidRequest(f"'{name}' is chat completions' field; the Responses API takes {instead}")
    refuse_unsupported_fields(body, _UNSUPPORTED, _KNOWN)
    chat_body = {name: body[name] for name in PASSED_TO_CHAT & set(body)}
    chat_body["messages"], sources = _messages(body.get("input"), body.get("instructions"))
    if body.get("max_output_tokens") is not None:
        chat_body["max_completion_tokens"] = body["max_output_tokens"]
    chat_body.update(_logprobs(body))
    if (tools := body.get("tools")) is not None:
        chat_body["tools"] = _tools(tools)
    if (choice := body.get("tool_choice")) is not None:
        chat_body["tool_choice"] = _tool_choice(choice)
    if (response_format := _text_format(body.get("text"))) is not None:
        chat_body["response_format"] = response_format
    if body.get("reasoning") is not None and not isinstance(body["reasoning"], dict):
        raise InvalidRequest('\'reasoning\' must be an object such as {"effort": "low"}')
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise InvalidRequest("'metadata' must be an object of strings")
    assert set(chat_body) <= KNOWN_CHAT_FIELDS
    try:
        chat = parse_chat_request(chat_body, served_model, sampling_defaults, generation_defaults)
    except InvalidRequest as exc:  # chat's message, under the names this body used
        message = _input_names(str(exc), sources)
        for chat_name, name in _RENAMED.items():
            message = message.replace(chat_name, name)
        raise InvalidRequest(message) from None
    chat.responses = {
        "instructions": body.get("instructions"),
        "metadata": metadata or {},
        "tools": body.get("tools") or [],
        "tool_choice": choice if choice is not None else "auto",
        "parallel_tool_calls": chat.tool_choice.parallel,
        "text": {"format": (body.get("text") or {}).get("format") or {"type": "text"}},
        "reasoning": body.get("reasoning"),
        "user": body.get("user"),
    }
    return chat


@dataclass(frozen=True)
class _Source:
    """Where a chat message came from in the Responses body: the names chat's refusals of it
    (`messages[i]...`) are given instead (`_input_names`)."""

    name: str
    """The message: "instructions", "input" (a string) or "input[j]"."""
    content: str
    """Its content (`messages[i].content`): a function_call_output's is its `output`."""
    calls: tuple[str, ...] = ()
    """Its tool calls' items, in order (one turn's function_call items merge into one message)."""


def _logprobs(body: dict[str, Any]) -> dict[str, Any]:
    """`include` and `top_logprobs` as chat's `logprobs` and `top_logprobs`: vLLM's, the output
    text's logprobs only with `include: ["message.output_text.logprobs"]`, each with the
    `top_logprobs` most likely tokens (0 by default, checked as chat's); without it top_logprobs
    asks for nothing, as vLLM ignores it (chat refuses one above 0 without `logprobs: true`)."""
    include = [] if body.get("include") is None else body["include"]
    if not isinstance(include, list) or not all(isinstance(value, str) for value in include):
        raise InvalidRequest(f"'include' must be a list of strings such as [\"{LOGPROBS_INCLUDE}\"]")
    if other := [value for value in include if value not in INCLUDE_VALUES]:
        raise InvalidRequest(
            f"'include' value {shown_value(other[0])} is not one this server takes; it takes "
            + ", ".join(f'"{value}"' for value in INCLUDE_VALUES)
        )
    if LOGPROBS_INCLUDE not in include:
        # vLLM's: top_logprobs is read only with the include (`to_sampling_params`), ignored
        # without it; an integer all the same (any: its request's `int`, read as `lax_value` reads it).
        top = body.get("top_logprobs")
        if top is not None and lax_value(top, int) is None:
            raise InvalidRequest(f"'top_logprobs' must be an integer, got {shown_value(top)}")
        return {"logprobs": False}
    return {"logprobs": True, "top_logprobs": body.get("top_logprobs")}


def _messages(value: Any, instructions: Any) -> tuple[list[dict[str, Any]], list[_Source]]:
    """`input` (and `instructions`, first) as chat messages, and where each came from."""
    messages: list[dict[str, Any]] = []
    sources: list[_Source] = []
    if instructions is not None:
        if not isinstance(instructions, str):
            raise InvalidRequest("'instructions' must be a string (the system message)")
        messages.append({"role": "system", "content": instructions})
        sources.append(_Source("instructions", "instructions"))
    if isinstance(value, str):
        return [*messages, {"role": "user", "content": value}], [*sources, _Source("input", "input")]
    if not isinstance(value, list) or not value:
        raise InvalidRequest(
            "'input' must be a string or a non-empty list of items (messages, function calls)"
        )
    for i, item in enumerate(value):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        item_name = f"input[{i}]"
        if kind == "message":
            messages.append(_message(item, i))
            sources.append(_Source(item_name, f"{item_name}.content"))
        elif kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments")},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None:
                last["tool_calls"].append(call)  # a turn's calls: one assistant message
                sources[-1] = replace(sources[-1], calls=(*sources[-1].calls, item_name))
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                sources.append(_Source(item_name, f"{item_name}.content", (item_name,)))
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str):
                raise InvalidRequest(
                    f"input[{i}] (a function_call_output) needs 'output', the call's result as a string"
                )
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": output})
            sources.append(_Source(item_name, f"{item_name}.output"))
        elif kind == "reasoning":
            continue  # an earlier turn's thinking: chat templates render none of it
        else:
            raise InvalidRequest(
                f"input[{i}] has type {shown_value(kind)}; this server takes 'message', 'function_call', "
                "'function_call_output' and 'reasoning' items"
            )
    return messages, sources


_CHAT_MESSAGE = re.compile(
    r"messages\[(\d+)\](?:\.tool_calls\[(\d+)\](?:\.function\.(name|arguments))?|(\.tool_call_id)|(\.content))?"
)
"""How chat's refusals name a message, its tool call (a field of it), its tool_call_id or content."""


def _input_names(message: str, sources: Sequence[_Source]) -> str:
    """Chat's refusal `message` naming `messages[i]...` with the names of the Responses body's
    `input` (`input[j]`, whose index differs after `instructions` or merged function_call items;
    a call's `input[j].arguments`, a tool_call_id's `input[j].call_id`, ...)."""

    def name(match: re.Match[str]) -> str:
        i = int(match.group(1))
        if i >= len(sources):
            return match.group(0)
        source = sources[i]
        if match.group(2) is not None:
            j = int(match.group(2))
            call = source.calls[j] if j < len(source.calls) else f"{source.name}.tool_calls[{j}]"
            return call + (f".{match.group(3)}" if match.group(3) else "")
        if match.group(4):
            return f"{source.name}.call_id"
        return source.content if match.group(5) else source.name

    return _CHAT_MESSAGE.sub(name, message)


_PART_TYPES = {"input_text": "text", "output_text": "text", "text": "text"}


def _message(item: dict[str, Any], i: int) -> dict[str, Any]:
    """One message item as chat's message: Responses' parts renamed to chat's."""
    content = item.get("content")
    if not isinstance(content, list):
        return {"role": item.get("role"), "content": content}  # a string; anything else chat refuses
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _PART_TYPES:
            parts.append({"type": "text", "text": part.get("text")})
        elif kind == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str) or not url:
                raise InvalidRequest(
                    f"an input_image part of input[{i}] needs 'image_url', an https:// or data: URL "
                    "(this server has no files API for 'file_id')"
                )
            parts.append({"type": "image_url", "image_url": {"url": url}})
        elif kind in ("image_url", "video_url"):
            parts.append(part)  # chat's own, as vLLM's Responses API takes them
        else:
            raise InvalidRequest(
                f"unsupported content part {shown_value(kind)} in input[{i}]; use 'input_text', "
                "'input_image' or (a video) {'type': 'video_url', 'video_url': {'url': ...}}"
            )
    return {"role": item.get("role"), "content": parts}


def _tools(tools: Any) -> list[Any]:
    """Responses' flat function tools as chat's {"type": "function", "function": {...}}."""
    if not isinstance(tools, list):
        raise InvalidRequest(
            '\'tools\' must be a list of {"type": "function", "name": ..., "parameters": {...}}'
        )
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else tool
            raise InvalidRequest(
                f"tools[{i}] has type {shown_value(kind)}; this server runs function tools alone "
                '({"type": "function", "name": ..., "parameters": {...}}): OpenAI\'s hosted tools are not served'
            )
        function = {k: v for k, v in tool.items() if k in ("name", "description", "parameters", "strict")}
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Any) -> Any:
    """Responses' {"type": "function", "name"} as chat's; the strings are the same."""
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        return {"type": "function", "function": {"name": choice.get("name")}}
    if isinstance(choice, dict) and choice.get("type") != "function":
        raise InvalidRequest(
            f'\'tool_choice\' must be "none", "auto", "required" or {{"type": "function", "name": ...}}, '
            f"got {shown_value(choice)}"
        )
    return choice


def _text_format(text: Any) -> dict[str, Any] | None:
    """`text.format` as chat's `response_format` (None: plain text)."""
    if text is None:
        return None
    if not isinstance(text, dict) or not isinstance(text.get("format", {}), dict):
        raise InvalidRequest('\'text\' must be an object such as {"format": {"type": "json_object"}}')
    fmt = text.get("format") or {"type": "text"}
    if fmt.get("type") == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise InvalidRequest(
                'text.format of type "json_schema" needs the schema in \'schema\': {"type": "json_schema", '
                '"name": "answer", "schema": {"type": "object", ...}}'
            )
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    if fmt.get("type") in ("text", "json_object"):
        return None if fmt["type"] == "text" else {"type": "json_object"}
    raise InvalidRequest(
        f'text.format has type {shown_value(fmt.get("type"))}; use "text", "json_object" or '
        '"json_schema" (with "name" and "schema")'
    )
