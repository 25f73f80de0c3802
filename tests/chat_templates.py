"""The tiny Qwen2-VL's chat template varied, for the tests of templates given instead of the model's
own (tests/integration/test_chat_template.py, test_chat_template_kwargs.py and `epd ask`'s in
tests/e2e): another system prompt with a variable of its own (`OVERRIDE`), and the template's
generation prompt (`GENERATION_PROMPT`) to swap for Qwen3.5's thinking one (`THINKING_PROMPT`)."""

from __future__ import annotations

from epd.model_runtime.tiny_model import CHAT_TEMPLATE

SYSTEM = "You are a helpful assistant."
OVERRIDE = CHAT_TEMPLATE.replace(SYSTEM, "You answer {{ style | default('in one word') }}.").replace(
    "{% if message['content'] is string %}",
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}{% endgeneration %}"
    "{% elif message['content'] is string %}",
)
"""The tiny Qwen2-VL's template with another system prompt, a variable of its own (`style`) and
transformers' `{% generation %}` tag, which plain jinja2 does not parse (its variables were
then all dropped)."""
GENERATION_PROMPT = "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
THINKING_PROMPT = (
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)
"""Qwen3.5's generation prompt (a thinking block opened, or closed empty with enable_thinking
false), put into the tiny Qwen2-VL's template: a family with a prefix cache whose template reads it."""
