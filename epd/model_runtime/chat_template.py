"""Chat templates as transformers renders them: the syntax check of a template the server or a
request gives (vLLM's --chat-template, and a request's `chat_template` under
--trust-request-chat-template), and which variables a template reads (vLLM's
`resolve_chat_template_kwargs`).

Both parse with transformers' own environment (`_compile_jinja_template`: an
ImmutableSandboxedEnvironment with its `{% generation %}` tag, loopcontrols and its globals), the
one `apply_chat_template` renders with, so a template that passes here is one transformers takes,
and the variables found are those its renderer sees. Plain jinja2 did not know the `generation`
tag: such a template did not parse, and every `chat_template_kwargs` variable was dropped."""

from __future__ import annotations

import functools

import jinja2
import jinja2.meta
from transformers.utils.chat_template_utils import _compile_jinja_template


def check_syntax(chat_template: str) -> None:
    """ValueError, one line with the line number and jinja's message, unless `chat_template`
    parses as transformers parses a chat template."""
    try:
        _compile_jinja_template(chat_template)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"the chat template does not parse: {error_text(exc)}") from None


def error_text(exc: BaseException) -> str:
    """A template error's message for a client or an operator: one line (jinja's line number for a
    syntax error), at most 300 characters, no traceback nor the template's source."""
    message = " ".join(str(exc).split())[:300] or type(exc).__name__
    if isinstance(exc, jinja2.TemplateSyntaxError) and exc.lineno:
        return f"line {exc.lineno}: {message}"
    return message


@functools.lru_cache(maxsize=16)
def template_variables(chat_template: str) -> frozenset[str] | None:
    """The variables a chat template reads without setting them (`messages`,
    `add_generation_prompt`, a Qwen3 template's `enable_thinking`, ...), as transformers' parser
    finds them; None for a template that does not parse (its variables are not known)."""
    try:
        ast = _compile_jinja_template(chat_template).environment.parse(chat_template)
    except jinja2.TemplateSyntaxError:
        return None
    return frozenset(jinja2.meta.find_undeclared_variables(ast))
