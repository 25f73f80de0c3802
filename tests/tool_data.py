"""The tools, tool history and tool-reading chat template that tests of tool calling share: the
chat API's (tests/integration/test_tool_calls.py), the Responses API's, the request parser's and
`epd ask --tools`' (tests/e2e/test_cli_tools.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

_CONTENT = (
    "{% if content is string %}{{ content }}"
    "{% elif content %}{% for part in content %}"
    "{% if part['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
)
TOOL_TEMPLATE = (
    "{% macro render(content) %}" + _CONTENT + "{% endmacro %}"
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ render(messages[0]['content']) }}"
    "{% else %}You are a helpful assistant.{% endif %}"
    "{{ '\\n\\n' }}# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}"
    "{{ '\\n' }}</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\n</tool_call><|im_end|>\n"
    "{% elif messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and loop.first and tools %}"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ render(message['content']) }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}{% set text = render(message['content']) %}<|im_start|>{{ message['role'] }}\n{{ text }}"
    "{% for call in message['tool_calls'] or [] %}"
    "{% if call['function'] is defined %}{% set call = call['function'] %}{% endif %}"
    "{% if text or not loop.first %}{{ '\\n' }}{% endif %}"
    '<tool_call>\n{"name": "{{ call[\'name\'] }}", "arguments": '
    "{% if call['arguments'] is string %}{{ call['arguments'] }}{% else %}{{ call['arguments'] | tojson }}{% endif %}"
    "{{ '}' }}\n</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""Qwen2.5's chat template's tool handling (Qwen3 and Qwen3-VL render tools alike), reduced as
`epd.model_runtime.tiny_model`'s templates are: no date, no thinking. A newline right after a
block tag is written as an expression, `{{ '\\n' }}`, as the real templates do: transformers'
Jinja drops the first newline after a block (`trim_blocks`)."""

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    },
}
TOOLS = [WEATHER, TIME]
HISTORY = [  # OpenAI's form: the call's arguments JSON text, its content null
    {"role": "user", "content": "weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
"""A hermes call of `WEATHER`, the text a choice grammar forces an answer to (tool_choice "auto")."""


FORECAST = {
    "type": "function",
    "function": {
        "name": "get_forecast",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        },
    },
}
QWEN3_CODER_CALL_TEXT = (
    "<tool_call>\n<function=get_forecast>\n<parameter=city>\nRome\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
)
"""A qwen3_coder call of `FORECAST`: its values typed by the schema (`days` an integer)."""


def no_whitespace_bias(model) -> dict[str, float]:
    """logit_bias against every token of whitespace alone: the random tiny model fills a JSON
    grammar's optional whitespace until max_tokens cuts it, which a real model does not."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    ids = [i for token, i in tokenizer.get_vocab().items() if token and set(token) <= set("ĠĊĉč")]
    return {str(i): -100 for i in ids}


def tool_template_model(model: Path, copy: Path) -> Path:
    """A copy (at `copy`) of the checkpoint `model` with `TOOL_TEMPLATE` as its chat template."""
    shutil.copytree(model, copy)
    (copy / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    return copy
