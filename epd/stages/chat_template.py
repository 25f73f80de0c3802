"""A chat template given instead of the model's own (vLLM's): the server's `--chat-template` (a
file, or the template's text) and, on a server started with `--trust-request-chat-template`, a
request's `chat_template` field. Plain Python, as `epd.stages.template_kwargs`: every door checks a
request's template here (`check_request_chat_template`, from `ChatTemplateOptions.check`); prefill,
which renders prompts, refuses one unless trusted (`refuse_untrusted`) and parses it
(`epd.model_runtime.chat_template`)."""

from __future__ import annotations

import codecs
from pathlib import Path
from typing import Any

from epd.stages.errors import InvalidRequest

MAX_CHAT_TEMPLATE_CHARS = 65536
"""A request's `chat_template` at most (64 Ki characters): checkpoints' own templates are a few
thousand characters (Qwen3.5's about 7,000); the bound keeps one request's template, which prefill
parses and caches compiled, small."""

_JINJA_CHARS = "{}\n"
"""A `--chat-template` value with none of these that names no file is a path mistyped, not a
template (vLLM's `load_chat_template`)."""


def load_chat_template(value: str) -> str:
    """vLLM's `--chat-template VALUE`: the text of the file VALUE names; else VALUE itself when it
    looks like a template (a brace or a newline), its backslash escapes decoded as vLLM decodes them
    (`\\n` a newline); else ValueError, one line saying what to pass."""
    path = Path(value)
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the name, or not UTF-8 text
        if not any(c in value for c in _JINJA_CHARS):
            reason = getattr(exc, "strerror", None) or exc
            raise ValueError(
                f"--chat-template {value[:200]!r} is not a file that can be read ({reason}) nor a template: "
                "pass the path of a Jinja chat template file, or the template's text"
            ) from None
    # As vLLM's codecs.decode(value, "unicode_escape"), without its reading of non-ASCII letters as Latin-1.
    return codecs.decode(value.encode("latin-1", "backslashreplace"), "unicode_escape")


def check_request_chat_template(chat_template: Any) -> None:
    """InvalidRequest, saying what to change, unless a request's `chat_template` is None (not sent)
    or a template's text of 1 to `MAX_CHAT_TEMPLATE_CHARS` characters."""
    if chat_template is None:
        return
    if not isinstance(chat_template, str):
        raise InvalidRequest(
            f"'chat_template' must be a string, the Jinja template's text, got {type(chat_template).__name__}"
        )
    if not chat_template:
        raise InvalidRequest("'chat_template' is empty: send the template's text, or leave it out")
    if len(chat_template) > MAX_CHAT_TEMPLATE_CHARS:
        raise InvalidRequest(
            f"'chat_template' is {len(chat_template)} characters; the limit is {MAX_CHAT_TEMPLATE_CHARS}: "
            "send a shorter template"
        )


def refuse_untrusted(chat_template: str | None, trusted: bool) -> None:
    """InvalidRequest for a request's template on a server that does not trust them (vLLM's 400
    without --trust-request-chat-template): a template is code the server runs for the request."""
    if chat_template is not None and not trusted:
        raise InvalidRequest(
            "'chat_template' is passed with the request, but the server was not started with "
            "--trust-request-chat-template: leave it out (the server's own template renders the "
            "prompt), or ask the operator to trust request templates"
        )
