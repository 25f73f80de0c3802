"""A chat template's failures and wrong renderings (a visual placeholder it writes itself, a media
part it leaves out), and whose error each is: the request's template, ValueError
(INVALID_ARGUMENT); the operator's (--chat-template, or the model's own), the server's."""

from __future__ import annotations

import logging
from typing import Any, NoReturn

from jinja2 import UndefinedError

from epd.model_runtime.adapter import RenderOptions
from epd.model_runtime.chat_template import error_text

log = logging.getLogger(__name__)


def whose_template(options: RenderOptions) -> str:
    """The template an error names: the model's own (no `chat_template`), the server's
    (--chat-template), or the request's (`RenderOptions.requests_template`)."""
    if options.chat_template is None:
        return "the model's chat template"
    if not options.requests_template:
        return "the server's chat template (--chat-template)"
    return "the request's chat template"


def raise_render_failure(options: RenderOptions, exc: Exception, has_variables: bool) -> NoReturn:
    """A template failed to render of itself (`{{ 1 / 0 }}`, a method of nothing, an undefined
    name's attribute), not by its `raise_exception`: the request's own template, or a request's
    variable the template cannot use (`{{ n + 1 }}` with n a string, `{{ tool.function.name }}` of
    a tool without one), is the client's error (ValueError); the operator's otherwise the server's
    (`raise_servers_failure`)."""
    if not options.requests_template and not (has_variables and isinstance(exc, (TypeError, UndefinedError))):
        raise_servers_failure(options, exc)
    raise ValueError(
        f"{whose_template(options)} failed to render: {type(exc).__name__}: {error_text(exc)}; "
        "send values (chat_template_kwargs) and a template that render together"
    ) from None


def raise_servers_failure(options: RenderOptions, exc: Exception) -> NoReturn:
    """The operator's template failed to render: the model's own, `exc` as it is (INTERNAL to the
    client, the traceback in the server log; raised again, not `from` itself, which made it its own
    cause); --chat-template's, saying so in that log."""
    if options.chat_template is None:
        # The traceback the client's INTERNAL leaves in the log shows jinja's frames, not whose
        # template they render: this line says it.
        log.error("%s failed to render: %s: %s", whose_template(options), type(exc).__name__, error_text(exc))
        raise exc
    raise RuntimeError(
        f"{whose_template(options)} failed to render: {type(exc).__name__}: {error_text(exc)}"
    ) from exc


def check_media_placeholders(text: str, processor: Any, modality: str, options: RenderOptions) -> None:
    """Refuse a chat template's rendering `text` unless it holds the request's media part as the
    one placeholder a family expands (the processor's video or image token) and no other visual
    placeholder. None: the template leaves the media part out (a given one may): ValueError, the
    client may send the question without it. More, of either kind: the template writes a
    placeholder of its own (`refuse_templates_placeholder`), which would otherwise be expanded in
    the media's place or stay a media token without media (with the other kind's placeholder:
    Qwen's and GLM-4.1V's would read it as text, a prompt generate() has no answer for)."""
    pad, other = (
        (processor.video_token, processor.image_token)
        if modality == "video"
        else (processor.image_token, processor.video_token)
    )
    num_rendered = text.count(pad)
    if num_rendered == 0:
        raise ValueError(
            f"the chat template rendered 0 {modality} placeholders: it leaves the {modality} part out; "
            "use a chat template that renders it (the model's own does) or send the question without it"
        )
    if num_rendered > 1:
        refuse_templates_placeholder(options, f"({num_rendered} of {pad} for one {modality})")
    if other in text:
        refuse_templates_placeholder(options, f"({other} beside the {modality}'s {pad})")


def refuse_templates_placeholder(options: RenderOptions, which: str) -> NoReturn:
    """The chat template wrote a visual placeholder of its own (`which` says where): neither a
    client's text (`HfTextAdapter._render`) nor its one media part (`check_messages`) can, so the
    template is at fault, and its author's is the error, as for a template that fails to render: the
    request's template, ValueError (INVALID_ARGUMENT); the operator's (--chat-template, or the
    model's own), RuntimeError (INTERNAL), which names it for the server's log."""
    message = f"{whose_template(options)} writes a visual placeholder of its own {which}; remove it from the template"
    if options.requests_template:
        raise ValueError(message)
    raise RuntimeError(message)
