"""vLLM's `chat_template_kwargs`: extra variables a request passes to the model's chat template
(`{"enable_thinking": false}` turns a Qwen3 / Qwen3.5 template's thinking block off). Plain
Python, as `epd.stages.messages`: every door checks them here (`check_chat_template_kwargs`, from
`ChatTemplateOptions.check`), the wire carries them as JSON text (`to_json` / `from_json`), and
the model runtime passes to `apply_chat_template` only the variables its template reads (as vLLM's
`resolve_chat_template_kwargs`: any other name is dropped, so it cannot reach the processor's own
options such as `num_frames`).

The names the server sets itself are refused (`RESERVED`), with the field to use instead: an
override would render a prompt other than the one the request's own fields describe (vLLM refuses
`chat_template` and `tokenize` alike and lets the others through).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from epd.stages.errors import InvalidRequest

MAX_JSON_CHARS = 16384
"""The variables' JSON text at most: a few flags and a system prompt's worth of text (the
messages carry the conversation; the template's variables only shape how it is rendered)."""
MAX_DEPTH = 16
"""Lists and objects nested at most this deep inside one variable's value."""

_USE_INSTEAD = {
    "messages": "send the conversation in 'messages'",
    "conversation": "send the conversation in 'messages'",
    "add_generation_prompt": "set the request's own 'add_generation_prompt' field",
    "continue_final_message": "set the request's own 'continue_final_message' field",
    "tools": "send them in the request's own 'tools' field",
    "documents": "documents are not supported by this server",
    "chat_template": "send the template in the request's own 'chat_template' field (a server started "
    "with --trust-request-chat-template takes it)",
    "tokenize": "the server tokenizes the rendered prompt itself",
}
"""What to do instead of each name the server refuses."""

RESERVED = frozenset(
    {
        *_USE_INSTEAD,
        # apply_chat_template's own options (transformers' tokenizer and processor) and the
        # template's functions: never template variables a request may set.
        "return_dict",
        "return_tensors",
        "return_assistant_tokens_mask",
        "padding",
        "truncation",
        "max_length",
        "tokenizer_kwargs",
        "processor_kwargs",
        "load_audio_from_video",
        "sanitize_control_tokens",
        "raise_exception",
        "strftime_now",
    }
)
"""Names of `chat_template_kwargs` refused with INVALID_ARGUMENT (HTTP 400)."""


def check_chat_template_kwargs(kwargs: Any) -> None:
    """InvalidRequest, saying what to change, unless `kwargs` is an object of template variables
    epd passes on: names that are identifiers and not `RESERVED`, values JSON's (null, true/false,
    numbers, strings, lists, objects with string keys) nested at most `MAX_DEPTH` deep, their JSON
    text at most `MAX_JSON_CHARS` characters."""
    if not isinstance(kwargs, Mapping):
        raise InvalidRequest(
            "'chat_template_kwargs' must be an object of the chat template's variables, such as "
            '{"enable_thinking": false}'
        )
    for name, value in kwargs.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise InvalidRequest(
                f"chat_template_kwargs has the name {json.dumps(str(name)[:64])}; a template variable's "
                "name is letters, digits and underscores, not starting with a digit"
            )
        if name in RESERVED:
            instead = _USE_INSTEAD.get(name, "the server sets it itself")
            raise InvalidRequest(f"chat_template_kwargs cannot set '{name}': {instead}")
        _check_value(value, f"chat_template_kwargs.{name}", 0)
    if (num_chars := len(to_json(kwargs))) > MAX_JSON_CHARS:
        raise InvalidRequest(
            f"chat_template_kwargs is {num_chars} characters of JSON; the limit is {MAX_JSON_CHARS}: "
            "send fewer or shorter variables (the conversation goes in 'messages')"
        )


def _check_value(value: Any, path: str, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise InvalidRequest(
            f"{path[:200]} is nested more than {MAX_DEPTH} lists or objects deep; flatten it"
        )
    if value is None or isinstance(value, (bool, int, str)):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidRequest(f"{path[:200]} is {value}; a template variable's number must be finite")
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_value(item, f"{path}[{i}]", depth + 1)
        return
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, str):
                raise InvalidRequest(f"{path[:200]} has the key {key!r:.64}; an object's keys are strings")
            _check_value(item, f"{path}.{key}", depth + 1)
        return
    raise InvalidRequest(
        f"{path[:200]} is a {type(value).__name__}; a template variable is null, true or false, a number, "
        "a string, a list or an object"
    )


def to_json(kwargs: Mapping[str, Any]) -> str:
    """The wire's form (`epd.v1.ChatTemplateOptions.chat_template_kwargs_json`): JSON's own text,
    so that an integer stays an integer (protobuf's Struct would make every number a double)."""
    return json.dumps(kwargs, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def from_json(text: str) -> dict[str, Any]:
    """`to_json`'s inverse: {} for ""; InvalidRequest for text that is not a JSON object (what the
    object holds is checked by `check_chat_template_kwargs`)."""
    if not text:
        return {}
    if len(text) > MAX_JSON_CHARS:
        raise InvalidRequest(
            f"chat_template_kwargs is {len(text)} characters of JSON; the limit is {MAX_JSON_CHARS}"
        )
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        raise InvalidRequest("chat_template_kwargs_json is not JSON text; send a JSON object") from None
    if not isinstance(value, dict):
        raise InvalidRequest("chat_template_kwargs_json must be a JSON object of the template's variables")
    return value
