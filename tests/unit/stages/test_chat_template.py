"""vLLM's chat templates given instead of the model's: `--chat-template` (a file, or the
template's text; anything else refused at start, as a template that does not parse), a request's
`chat_template` (bounded in size at every door, refused by prefill without
--trust-request-chat-template), and the variables a template reads, found with the parser
transformers renders with."""

from __future__ import annotations

import pytest

from epd.cli.parsers.root import build_parser
from epd.cli.stack_commands import stage_flags
from epd.gateway.chat_request import parse_chat_request
from epd.model_runtime.chat_template import check_syntax, template_variables
from epd.model_runtime.sampling import GenerationConfig
from epd.prefill_svc.config import PrefillConfig
from epd.stages.chat_template import (
    MAX_CHAT_TEMPLATE_CHARS,
    check_request_chat_template,
    load_chat_template,
    refuse_untrusted,
)
from epd.stages.errors import InvalidRequest
from epd.stages.messages import ChatTemplateOptions
from epd.stages.template_kwargs import check_chat_template_kwargs
from epd.transport.message_convert import template_from_proto, template_to_proto
from epd.video.types import SamplingOptions

TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content[0].text }}\n{% endfor %}"
GENERATION_TAGGED = (
    "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}"
    "{% else %}{{ m.content }}{% endif %}{% endfor %}"
    "{% if enable_thinking is defined and enable_thinking is false %}<think></think>{% endif %}"
)
"""transformers' `{% generation %}` tag (assistant masks), which plain jinja2 does not parse."""


def test_the_flag_reads_a_file(tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE + "é 中", encoding="utf-8")
    assert load_chat_template(str(path)) == TEMPLATE + "é 中"


def test_the_flag_takes_the_template_text_itself_escapes_decoded_as_vllm():
    assert load_chat_template(TEMPLATE) == TEMPLATE
    # vLLM decodes the text's backslash escapes ("\\n" typed in a shell is a newline); letters
    # outside ASCII stay themselves (vLLM's own decode would read them as Latin-1 bytes).
    assert load_chat_template("{{ 'a' }}\\n é 中") == "{{ 'a' }}\n é 中"


@pytest.mark.parametrize("value", ["templates/missing.jinja", "chatml", "/"])
def test_a_value_that_is_neither_a_file_nor_a_template_is_refused(value):
    with pytest.raises(ValueError, match="is not a file that can be read .* nor a template"):
        load_chat_template(value)


def test_a_template_that_does_not_parse_stops_prefill_at_start():
    with pytest.raises(ValueError, match="^--chat-template: the chat template does not parse: line 1: "):
        PrefillConfig(chat_template="{% if messages %}no end")
    assert PrefillConfig(chat_template=TEMPLATE).chat_template == TEMPLATE


def test_the_stack_passes_both_flags_to_every_prefill(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    args = build_parser().parse_args(["serve", "--chat-template", str(path), "--trust-request-chat-template"])
    words = stage_flags(args, "prefill")
    assert words[words.index("--chat-template") + 1] == str(path)
    assert "--trust-request-chat-template" in words
    role = build_parser().parse_args(["serve", "prefill", *words])
    from epd.cli.configs import prefill_config

    config = prefill_config(role)
    assert (config.chat_template, config.trust_request_chat_template) == (TEMPLATE, True)
    assert "--chat-template" not in stage_flags(build_parser().parse_args(["serve"]), "prefill")
    from epd.cli.configs import colocated_stages

    colocated = colocated_stages(
        build_parser().parse_args(["serve", "--colocate", "--chat-template", TEMPLATE])
    )
    assert colocated.prefill.chat_template == TEMPLATE


def test_a_request_template_is_bounded_in_size():
    check_request_chat_template(None)
    check_request_chat_template("x" * MAX_CHAT_TEMPLATE_CHARS)
    with pytest.raises(InvalidRequest, match=f"65537 characters; the limit is {MAX_CHAT_TEMPLATE_CHARS}"):
        check_request_chat_template("x" * (MAX_CHAT_TEMPLATE_CHARS + 1))
    with pytest.raises(InvalidRequest, match="'chat_template' must be a string"):
        check_request_chat_template({"default": TEMPLATE})
    with pytest.raises(InvalidRequest, match="'chat_template' is empty"):
        check_request_chat_template("")


def test_the_http_door_reads_the_request_template_and_checks_its_size():
    def parse(**fields):
        body = {"model": "epd", "messages": [{"role": "user", "content": "hi"}], **fields}
        return parse_chat_request(body, "epd", SamplingOptions(), GenerationConfig(max_new_tokens=8))

    assert parse(chat_template=TEMPLATE).template == ChatTemplateOptions(chat_template=TEMPLATE)
    assert parse(chat_template=None).template == ChatTemplateOptions()
    with pytest.raises(InvalidRequest, match="the limit is 65536"):
        parse(chat_template="x" * (MAX_CHAT_TEMPLATE_CHARS + 1))


def test_the_wire_carries_the_request_template():
    options = ChatTemplateOptions(chat_template=TEMPLATE)
    assert template_from_proto(template_to_proto(options)) == options
    plain = template_to_proto(ChatTemplateOptions(continue_final_message=True, add_generation_prompt=False))
    assert template_from_proto(plain).chat_template is None


def test_a_request_template_is_refused_unless_the_server_trusts_them():
    refuse_untrusted(None, trusted=False)
    refuse_untrusted(TEMPLATE, trusted=True)
    with pytest.raises(InvalidRequest, match="not started with --trust-request-chat-template"):
        refuse_untrusted(TEMPLATE, trusted=False)
    # As vLLM's, the template is not a template variable either: the field says where it goes.
    with pytest.raises(InvalidRequest, match="in the request's own 'chat_template' field"):
        check_chat_template_kwargs({"chat_template": TEMPLATE})


def test_the_syntax_check_names_the_line_and_stays_short():
    check_syntax(GENERATION_TAGGED)
    with pytest.raises(ValueError, match="does not parse: line 2: .*'endfor'") as caught:
        check_syntax("ok\n{% for m in messages %}" + "x" * 5000)
    assert len(str(caught.value)) < 400 and "\n" not in str(caught.value)


def test_the_variables_are_found_with_transformers_own_tags():
    """A template with transformers' `{% generation %}` tag did not parse under plain jinja2: every
    request variable was then dropped, `enable_thinking` too."""
    assert {"messages", "enable_thinking"} <= template_variables(GENERATION_TAGGED)
    assert template_variables("{% if %}") is None  # not known: the runtime passes them all


def test_the_stack_refuses_a_bad_template_before_any_service_starts():
    """`epd serve` checks the flags its prefills get (`stage_flag_problem`): one line, not every
    replica importing torch and then exiting."""
    from epd.cli.stack_commands import stage_flag_problem

    bad = build_parser().parse_args(["serve", "--chat-template", "{% for m in messages %}"])
    assert (stage_flag_problem(bad) or "").startswith(
        "--chat-template: the chat template does not parse: line 1: "
    )
    missing = build_parser().parse_args(["serve", "--chat-template", "no_such_template.jinja"])
    assert "is not a file that can be read" in (stage_flag_problem(missing) or "")
