"""vLLM's chat templates given instead of the model's own: prefill's `--chat-template` renders
every prompt exactly as `processor.apply_chat_template(..., chat_template=that)` does (text alone,
a video, the template's own variables), and the answer is generate()'s on it; a request's
`chat_template` renders its own prompt only on a prefill started with
--trust-request-chat-template (else 400), a template that fails is a 400 with jinja's message,
and the prefix cache, keyed on token ids, reuses only the common prefix of two templates'
prompts. Through the embedded pipeline and the real stack (HTTP, /tokenize); a template that
does not parse stops `epd serve prefill` at start, in one line."""

from __future__ import annotations

import asyncio

import pytest
from jinja2.exceptions import SecurityError

from epd.client import EpdClient
from epd.gateway.ask_types import AskRequest
from epd.gateway.embedded import build_embedded_pipeline
from epd.model_runtime.config import ModelConfig
from epd.model_runtime.sampling import GenerationConfig
from epd.model_runtime.tiny_model import CHAT_TEMPLATE
from epd.prefill_svc.config import PrefillConfig
from epd.stages.contracts import MediaInput
from epd.stages.errors import InvalidRequest
from epd.stages.messages import ChatTemplateOptions, from_chat_template
from epd.stages.tokenize import TokenizeInput
from epd.video.types import SamplingOptions
from tests.chat_templates import GENERATION_PROMPT, OVERRIDE
from tests.embedded import request_summary
from tests.local_http import post_json
from tests.reference import decode_for_test, template_reference
from tests.stack import INSECURE_STAGE, Stack, run_epd_forked

MAX_NEW_TOKENS = 8
NUM_FRAMES = 4
TEXT_ONLY = [{"role": "user", "content": [{"type": "text", "text": "name a colour"}]}]
VIDEO = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "what moves?"}]}]

REQUEST_TEMPLATE = CHAT_TEMPLATE.replace(
    GENERATION_PROMPT, "{% if add_generation_prompt %}<|im_start|>assistant (in French)\n{% endif %}"
)
"""Another generation prompt: its prompt parts from the model's own after the system and user turns."""


def _ask(pipeline, messages, media=None, **template):
    request = AskRequest(
        from_chat_template(messages),
        MediaInput(media) if media else None,
        SamplingOptions(num_frames=NUM_FRAMES),
        GenerationConfig(max_new_tokens=MAX_NEW_TOKENS),
        template=ChatTemplateOptions(**template),
    )
    return asyncio.run(request_summary(pipeline, request))


def _tokenize(pipeline, messages, **template) -> list[int]:
    request = TokenizeInput(
        messages=from_chat_template(messages),
        add_special_tokens=False,
        template=ChatTemplateOptions(**template),
    )
    return asyncio.run(pipeline.prefill.tokenize(request, "t")).token_ids


def test_the_servers_template_renders_every_prompt_as_the_processor_does_with_it(tiny_models, media_files):
    path = tiny_models["qwen2_vl"]
    video = decode_for_test(media_files["mp4"], NUM_FRAMES)
    model = ModelConfig(model=str(path))
    with build_embedded_pipeline(
        model, prefill=PrefillConfig(model=model, chat_template=OVERRIDE)
    ) as pipeline:
        for messages, media in ((TEXT_ONLY, None), (VIDEO, video)):
            default_ids, _ = template_reference(path, messages, 1, media)
            prompt_ids, want = template_reference(
                path, messages, MAX_NEW_TOKENS, media, chat_template=OVERRIDE
            )
            assert prompt_ids != default_ids
            got = _ask(pipeline, messages, media_files["mp4"].read_bytes() if media else None)
            assert (got.token_ids, got.num_prompt_tokens) == (want, len(prompt_ids))
        assert (
            _tokenize(pipeline, TEXT_ONLY)
            == template_reference(path, TEXT_ONLY, 1, chat_template=OVERRIDE)[0]
        )
        # Its own variable reaches it, though the checkpoint's template does not read it.
        styled_ids, styled_want = template_reference(
            path, TEXT_ONLY, MAX_NEW_TOKENS, chat_template=OVERRIDE, style="in French"
        )
        styled = _ask(pipeline, TEXT_ONLY, chat_template_kwargs={"style": "in French"})
        assert (styled.token_ids, styled.num_prompt_tokens) == (styled_want, len(styled_ids))
        # Not trusted: a request's own template is refused, before any work.
        with pytest.raises(InvalidRequest, match="not started with --trust-request-chat-template"):
            _ask(pipeline, TEXT_ONLY, chat_template=REQUEST_TEMPLATE)
        with pytest.raises(InvalidRequest, match="not started with --trust-request-chat-template"):
            _tokenize(pipeline, TEXT_ONLY, chat_template=REQUEST_TEMPLATE)


def test_the_servers_template_failing_is_the_servers_error_and_its_raise_exception_the_clients(tiny_models):
    """--chat-template is the operator's: its own failure (`{{ x / 0 }}`) is INTERNAL to the client,
    "internal error", the message naming the flag for the log; its `raise_exception` refuses the
    conversation (INVALID_ARGUMENT), as the model's own template's does, naming the server's
    template, not the request's (which sent none)."""
    import grpc

    from epd.transport.errors import status_of

    template = (
        "{% if 'refuse' in messages[0].content[0].text %}{{ raise_exception('no system prompt here') }}"
        "{% elif 'undefined' in messages[0].content[0].text %}{{ missing.attr }}"
        "{% else %}{{ messages[0].content[0].text / 0 }}{% endif %}"
    )
    model = ModelConfig(model=str(tiny_models["qwen2_vl"]))
    refused = [{"role": "user", "content": [{"type": "text", "text": "refuse this"}]}]
    undefined = [{"role": "user", "content": [{"type": "text", "text": "an undefined name"}]}]
    with build_embedded_pipeline(
        model, prefill=PrefillConfig(model=model, chat_template=template)
    ) as pipeline:
        for call in (_ask, _tokenize):
            with pytest.raises(InvalidRequest) as info:
                call(pipeline, refused)
            assert str(info.value) == (
                "the server's chat template (--chat-template) cannot render this conversation: no "
                "system prompt here; send its messages in a shape the model takes (for example with "
                "a user message before the assistant's)"
            )
            # jinja's own failures, an undefined name's attribute (a TemplateError, as
            # `raise_exception`'s, which was a 400 too) among them: the server's.
            for messages, said in (
                (TEXT_ONLY, "TypeError: unsupported operand"),
                (undefined, "UndefinedError: 'missing' is undefined"),
            ):
                with pytest.raises(RuntimeError) as failed:
                    call(pipeline, messages)
                assert not isinstance(failed.value, ValueError)
                assert str(failed.value).startswith(
                    f"the server's chat template (--chat-template) failed to render: {said}"
                )
                assert status_of(failed.value) == (
                    grpc.StatusCode.INTERNAL,
                    "internal error; the server log has details",
                )


def test_the_models_own_template_failing_is_the_servers_error_named_in_the_log(tiny_models, caplog):
    """The checkpoint's own template (here: the loaded processor's, replaced by one that reads an
    undefined name's attribute) failing of itself is INTERNAL, as --chat-template's: jinja's
    UndefinedError, a TemplateError, was a 400 like a template's `raise_exception`. The log names
    whose template failed (its traceback shows only jinja's frames). A request's own template
    failing so stays its caller's error (400)."""
    import logging

    import grpc
    from jinja2 import UndefinedError

    from epd.transport.errors import status_of

    model = ModelConfig(model=str(tiny_models["qwen2_vl"]))
    trusted = PrefillConfig(model=model, trust_request_chat_template=True)
    with build_embedded_pipeline(model, prefill=trusted) as pipeline:
        processor = pipeline.prefill.engine.adapter.processor
        processor.chat_template = "{{ missing.attr }}"
        for call in (_ask, _tokenize):
            caplog.clear()
            with caplog.at_level(logging.ERROR, logger="epd.model_runtime.template_errors"):
                with pytest.raises(UndefinedError) as failed:
                    call(pipeline, TEXT_ONLY)
            assert status_of(failed.value)[0] == grpc.StatusCode.INTERNAL
            assert "the model's chat template failed to render: UndefinedError: 'missing' is undefined" in [
                r.getMessage() for r in caplog.records
            ]
            with pytest.raises(
                InvalidRequest, match="the request's chat template failed to render: UndefinedError"
            ):
                call(pipeline, TEXT_ONLY, chat_template="{{ missing.attr }}")


def test_a_trusted_request_template_renders_its_own_prompt_and_the_cache_stays_exact(tiny_models):
    path = tiny_models["qwen2_vl"]
    model = ModelConfig(model=str(path))
    trusted = PrefillConfig(model=model, trust_request_chat_template=True)
    with build_embedded_pipeline(model, prefill=trusted) as pipeline:
        default_ids, default_want = template_reference(path, TEXT_ONLY, MAX_NEW_TOKENS)
        assert _ask(pipeline, TEXT_ONLY).token_ids == default_want
        prompt_ids, want = template_reference(path, TEXT_ONLY, MAX_NEW_TOKENS, chat_template=REQUEST_TEMPLATE)
        common = next(i for i, (a, b) in enumerate(zip(default_ids, prompt_ids, strict=False)) if a != b)
        assert common < len(prompt_ids) - 1
        got = _ask(pipeline, TEXT_ONLY, chat_template=REQUEST_TEMPLATE)
        # The cache, keyed on token ids, reused the part the two templates' prompts share and no more.
        assert (got.token_ids, got.num_prompt_tokens) == (want, len(prompt_ids))
        assert got.num_reused_prompt_tokens == common
        assert _tokenize(pipeline, TEXT_ONLY, chat_template=REQUEST_TEMPLATE) == prompt_ids
        assert _ask(pipeline, TEXT_ONLY).token_ids == default_want  # the next request: the model's again
        for template, said in (
            (
                "{{ raise_exception('no system prompt here') }}",
                "cannot render this conversation: no system prompt here",
            ),
            ("{{ messages[0].content[0].text / 0 }}", "failed to render: TypeError: unsupported operand"),
            (
                "{{ ''.__class__.__mro__ }}",
                "stopped by the sandbox it renders in: access to attribute '__class__' of 'str' object is unsafe",
            ),
            ("{% for m in messages %}", "'chat_template': the chat template does not parse: line 1: "),
        ):
            with pytest.raises(InvalidRequest, match=said):
                _ask(pipeline, TEXT_ONLY, chat_template=template)


def test_the_stack_serves_a_prefill_started_with_a_template_file(tiny_models, tmp_path):
    path = tiny_models["qwen2_vl"]
    template_file = tmp_path / "override.jinja"
    template_file.write_text(OVERRIDE)
    extra = {
        "prefill": ["--chat-template", str(template_file), "--trust-request-chat-template"],
    }
    body = {"model": "epd", "messages": TEXT_ONLY, "max_tokens": MAX_NEW_TOKENS}
    with Stack(path, tmp_path / "logs", extra=extra, http=True) as stack:
        http_port = stack.http_port
        for template in (OVERRIDE, REQUEST_TEMPLATE):
            prompt_ids, want = template_reference(path, TEXT_ONLY, MAX_NEW_TOKENS, chat_template=template)
            fields = {} if template is OVERRIDE else {"chat_template": template}
            status, reply = post_json(http_port, "/v1/chat/completions", {**body, **fields})
            assert status == 200, reply
            assert reply["epd"]["token_ids"] == want and reply["usage"]["prompt_tokens"] == len(prompt_ids)
            status, counted = post_json(http_port, "/tokenize", {"messages": TEXT_ONLY, **fields})
            assert status == 200 and counted["tokens"] == prompt_ids, counted
        status, reply = post_json(http_port, "/v1/chat/completions", {**body, "chat_template": "{{ 1 / }}"})
        assert status == 400 and "does not parse: line 1" in reply["error"]["message"], reply
        # The gRPC door (the SDK) carries the request's template as the HTTP door does.
        prompt_ids, want = template_reference(path, TEXT_ONLY, MAX_NEW_TOKENS, chat_template=REQUEST_TEMPLATE)
        with EpdClient(stack.gateway, timeout_s=120) as client:
            result = client.ask(
                None, messages=TEXT_ONLY, max_new_tokens=MAX_NEW_TOKENS, chat_template=REQUEST_TEMPLATE
            )
            assert (result.token_ids, result.num_prompt_tokens) == (want, len(prompt_ids))
            assert client.tokenize(messages=TEXT_ONLY, chat_template=REQUEST_TEMPLATE).token_ids == prompt_ids


def test_a_template_that_does_not_parse_stops_the_prefill_service_at_start(tiny_models):
    # forked from the session's zygote, as a stack's prefill is: the same `epd serve prefill`
    proc = run_epd_forked(
        "serve", "prefill", "--port", "0", "--model", str(tiny_models["qwen2_vl"]),
        "--chat-template", "{% if messages %}unclosed", *INSECURE_STAGE, timeout_s=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines == [lines[-1]] and lines[0].startswith(
        "epd serve prefill: --chat-template: the chat template does not parse: line 1: "
    ), proc.stderr


@pytest.mark.parametrize(
    "template, error",
    [
        ("{{ messages[0].content[0].text / 0 }}", TypeError),
        ("{{ messages.__class__.__mro__ }}", SecurityError),
    ],
)
def test_the_models_own_template_failing_is_raised_as_it_is_not_as_its_own_cause(
    tiny_models, template, error
):
    """The model's own template (no --chat-template) that fails to render, by its own error or the
    sandbox's, is the server's error, raised as it is: its cause is not itself (it was raised `from`
    itself, a cycle in the chain a traceback walks)."""
    from epd.model_runtime.loader import load_adapter

    adapter = load_adapter(ModelConfig(model=str(tiny_models["qwen2_vl"])), "prefill")
    adapter.processor.chat_template = template
    with pytest.raises(error) as failed:
        adapter.tokenize_conversation(TEXT_ONLY, add_special_tokens=False)
    assert failed.value.__cause__ is not failed.value
