"""vLLM's `chat_template_kwargs` (extra variables of the model's chat template; the common one:
`{"enable_thinking": false}`, which Qwen3.5's template reads): the prompt is the processor's own
`apply_chat_template(messages, add_generation_prompt=True, **kwargs)`, and the answer's tokens equal
`model.generate(do_sample=False)` on it, in every family in one process (text alone and with a video
in an earlier turn) and through the real stack's HTTP (plain and streamed), gRPC (the SDK) and
/tokenize doors. A variable the template does not read is dropped (the prompt is the default's), as
vLLM's; the prefix cache, keyed on token ids, reuses only the common prefix of two renderings."""

from __future__ import annotations

import asyncio
import base64
import shutil

import grpc
import pytest

from epd.client import EpdClient, EpdError
from epd.gateway.ask_types import AskRequest
from epd.gateway.embedded import build_embedded_pipeline
from epd.model_runtime.chat_template import template_variables
from epd.model_runtime.config import ModelConfig
from epd.model_runtime.sampling import GenerationConfig
from epd.model_runtime.tiny_model import QWEN3_5_CHAT_TEMPLATE
from epd.stages.contracts import MediaInput
from epd.stages.errors import InvalidRequest
from epd.stages.messages import ChatTemplateOptions, from_chat_template
from epd.stages.raw_prompt import RawPrompt
from epd.stages.tokenize import TokenizeInput
from epd.video.types import SamplingOptions
from tests.chat_templates import GENERATION_PROMPT, THINKING_PROMPT
from tests.embedded import request_summary
from tests.families import FAMILIES, family_checkpoints
from tests.local_http import post_json, sse_chunks
from tests.reference import decode_for_test, template_reference
from tests.stack import Stack

MAX_NEW_TOKENS = 8
NUM_FRAMES = 4
NO_THINKING = {"enable_thinking": False}
READS_IT = {"qwen3_5"}
"""The families whose tiny template reads `enable_thinking` (Qwen3.5's, as the hub's does)."""

TEXT_ONLY = [
    {"role": "system", "content": [{"type": "text", "text": "answer briefly"}]},
    {"role": "user", "content": [{"type": "text", "text": "name a colour"}]},
]
VIDEO_EARLIER = [
    {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "what moves?"}]},
    {"role": "assistant", "content": [{"type": "text", "text": "a square"}]},
    {"role": "user", "content": [{"type": "text", "text": "which colour is it?"}]},
]


@pytest.fixture(scope="module")
def checkpoints(tiny_models, tmp_path_factory):
    return family_checkpoints(tiny_models, tmp_path_factory.mktemp("kwargs_models"))


@pytest.fixture(scope="module")
def thinking_qwen2_vl(tiny_models, tmp_path_factory):
    """The tiny Qwen2-VL checkpoint with Qwen3.5's thinking generation prompt in its template."""
    model = tmp_path_factory.mktemp("thinking") / "qwen2_vl_thinking"
    shutil.copytree(tiny_models["qwen2_vl"], model)
    template = model / "chat_template.jinja"
    text = template.read_text()
    assert GENERATION_PROMPT in text
    template.write_text(text.replace(GENERATION_PROMPT, THINKING_PROMPT))
    return model


def _ask(pipeline, messages: list[dict], media: bytes | None, kwargs: dict):
    request = AskRequest(
        from_chat_template(messages),
        MediaInput(media) if media else None,
        SamplingOptions(num_frames=NUM_FRAMES),
        GenerationConfig(max_new_tokens=MAX_NEW_TOKENS),
        template=ChatTemplateOptions(chat_template_kwargs=kwargs),
    )
    return asyncio.run(request_summary(pipeline, request))


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_renders_the_templates_variables_as_the_processor_and_answers_as_generate(
    checkpoints, media_files, family
):
    """With `enable_thinking: false` (and a variable no template reads), each answer equals
    generate() on the processor's own rendering with the same variable, its prompt length too:
    Qwen3.5's prompt closes the thinking block (another prompt than the default's), the other
    families' templates do not read it (the default's prompt). /tokenize counts the same ids."""
    path = checkpoints[family]
    video = decode_for_test(media_files["mp4"], NUM_FRAMES)
    data = media_files["mp4"].read_bytes()
    with build_embedded_pipeline(ModelConfig(model=str(path))) as pipeline:
        for name, messages, media in (("text", TEXT_ONLY, None), ("video", VIDEO_EARLIER, video)):
            default_ids, _ = template_reference(path, messages, 1, media)
            prompt_ids, want = template_reference(path, messages, MAX_NEW_TOKENS, media, **NO_THINKING)
            assert (prompt_ids != default_ids) == (family in READS_IT), name
            got = _ask(
                pipeline, messages, data if media is not None else None, {**NO_THINKING, "unread": [1, "x"]}
            )
            assert len(set(want)) > 2, (
                f"{name}: the tiny model repeats one token; the comparison proves little"
            )
            assert got.token_ids == want, name
            assert got.num_prompt_tokens == len(prompt_ids), name
            if media is None:
                tokenize = TokenizeInput(
                    messages=from_chat_template(messages),
                    add_special_tokens=False,
                    template=ChatTemplateOptions(chat_template_kwargs=NO_THINKING),
                )
                assert asyncio.run(pipeline.prefill.tokenize(tokenize, "t")).token_ids == prompt_ids
        with pytest.raises(InvalidRequest, match="a raw prompt has no template"):
            asyncio.run(
                request_summary(
                    pipeline,
                    AskRequest(
                        [],
                        raw_prompt=RawPrompt("once"),
                        template=ChatTemplateOptions(chat_template_kwargs=NO_THINKING),
                    ),
                )
            )


def test_the_prefix_cache_reuses_only_what_two_renderings_share(thinking_qwen2_vl):
    """The prefix cache keys on token ids: after the default's prompt (thinking opened), the same
    conversation with `enable_thinking: false` reuses the tokens up to where the two renderings
    part (never past), and both answers are generate()'s on their own rendering."""
    path = thinking_qwen2_vl
    with build_embedded_pipeline(ModelConfig(model=str(path))) as pipeline:
        default_ids, default_want = template_reference(path, TEXT_ONLY, MAX_NEW_TOKENS)
        assert _ask(pipeline, TEXT_ONLY, None, {}).token_ids == default_want
        prompt_ids, want = template_reference(path, TEXT_ONLY, MAX_NEW_TOKENS, **NO_THINKING)
        # Where they part (the default's prompt ends in "<think>\n", a prefix of the other's text).
        common = next(
            (i for i, (a, b) in enumerate(zip(default_ids, prompt_ids, strict=False)) if a != b),
            min(len(default_ids), len(prompt_ids)),
        )
        assert common < len(prompt_ids) - 1  # the two renderings part before the last token
        got = _ask(pipeline, TEXT_ONLY, None, NO_THINKING)
        assert got.token_ids == want
        assert got.num_reused_prompt_tokens == common


def test_the_runtime_passes_only_the_variables_the_template_reads(tiny_models):
    """Qwen3.5's template reads `enable_thinking` (and its own `messages`, `add_generation_prompt`);
    a name it does not read never reaches `apply_chat_template` (where transformers would take it
    for the processor's own options), so its value is not looked at; one it reads may not hold a
    visual placeholder, which would take the media's embeddings."""
    assert "enable_thinking" in template_variables(QWEN3_5_CHAT_TEMPLATE)
    from epd.model_runtime.adapter import RenderOptions
    from epd.model_runtime.config import ModelConfig
    from epd.model_runtime.loader import load_adapter

    adapter = load_adapter(ModelConfig(model=str(tiny_models["qwen2_vl"])), "prefill")
    conversation = [{"role": "user", "content": [{"type": "text", "text": "name a colour"}]}]
    plain = adapter.tokenize_conversation(conversation, False)
    unread = {"enable_thinking": False, "num_frames": 1, "note": "<|video_pad|>"}
    assert adapter.tokenize_conversation(conversation, False, RenderOptions(variables=unread)) == plain
    # Variables not known (a template transformers' parser refuses): all passed, not all dropped.
    assert adapter._template_variables(unread, "{% if %}") == unread
    adapter.processor.chat_template = adapter.processor.chat_template + "{{ note }}"
    with pytest.raises(
        ValueError, match="a chat_template_kwargs value or a tool contains the model's visual placeholder"
    ):
        adapter.tokenize_conversation(conversation, False, RenderOptions(variables=unread))
    noted = adapter.tokenize_conversation(conversation, False, RenderOptions(variables={"note": " red"}))
    assert noted[: len(plain)] == plain and len(noted) > len(plain)


def test_a_template_that_renders_no_media_placeholder_says_how_many_it_rendered(tiny_models):
    """A given template (--chat-template, a trusted request's) may leave the media part out: the
    400 counts the placeholders rendered (0), not a negative number, and says what to change."""
    from epd.model_runtime.config import ModelConfig
    from epd.model_runtime.loader import load_adapter
    from tests.families import check_a_template_without_the_media_part_is_refused_as_such

    adapter = load_adapter(ModelConfig(model=str(tiny_models["qwen2_vl"])), "prefill")
    check_a_template_without_the_media_part_is_refused_as_such(adapter)


# -- through the real processes ----------------------------------------------------------------


def _chat(port: int, body: dict) -> tuple[int, dict]:
    return post_json(port, "/v1/chat/completions", body)


def _streamed_text(port: int, body: dict) -> str:
    chunks = sse_chunks(port, "/v1/chat/completions", body)
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


def test_the_stack_takes_the_templates_variables_at_every_door(thinking_qwen2_vl, media_files, tmp_path):
    """HTTP (plain and SSE), gRPC (the SDK's ask) and /tokenize render `enable_thinking: false`
    as the processor does, with a video and text alone: generate()'s tokens on that rendering,
    not the default's. Names the server sets itself, values that are not JSON's and an oversized
    object are 400 / INVALID_ARGUMENT saying what to change; the stack keeps serving."""
    from transformers import AutoProcessor

    path = thinking_qwen2_vl
    tokenizer = AutoProcessor.from_pretrained(str(path)).tokenizer
    video = decode_for_test(media_files["mp4"], NUM_FRAMES)
    prompt_ids, want = template_reference(path, VIDEO_EARLIER, MAX_NEW_TOKENS, video, **NO_THINKING)
    default_ids, _ = template_reference(path, VIDEO_EARLIER, 1, video)
    assert prompt_ids != default_ids
    text = tokenizer.decode(want, skip_special_tokens=True)
    url = "data:video/mp4;base64," + base64.b64encode(media_files["mp4"].read_bytes()).decode()
    openai_messages = [
        {
            "role": m["role"],
            "content": [
                {"type": "video_url", "video_url": {"url": url}} if p["type"] == "video" else p
                for p in m["content"]
            ],
        }
        for m in VIDEO_EARLIER
    ]
    body = {
        "model": "epd",
        "messages": openai_messages,
        "max_tokens": MAX_NEW_TOKENS,
        "media": {"num_frames": NUM_FRAMES},
        "chat_template_kwargs": NO_THINKING,
    }
    text_ids, text_want = template_reference(path, TEXT_ONLY, MAX_NEW_TOKENS, **NO_THINKING)
    with Stack(path, tmp_path / "logs", http=True) as stack:
        http_port = stack.http_port
        status, reply = _chat(http_port, body)
        assert status == 200, reply
        assert reply["epd"]["token_ids"] == want and reply["usage"]["prompt_tokens"] == len(prompt_ids)
        assert reply["choices"][0]["message"]["content"] == text
        assert _streamed_text(http_port, body) == text
        status, reply = _chat(http_port, {**body, "messages": TEXT_ONLY})
        assert status == 200 and reply["epd"]["token_ids"] == text_want, reply
        status, counted = post_json(
            http_port, "/tokenize", {"messages": TEXT_ONLY, "chat_template_kwargs": NO_THINKING}
        )
        assert status == 200 and counted["tokens"] == text_ids, counted

        with EpdClient(stack.gateway, timeout_s=120) as client:
            result = client.ask(
                media_files["mp4"],
                messages=VIDEO_EARLIER,
                num_frames=NUM_FRAMES,
                max_new_tokens=MAX_NEW_TOKENS,
                chat_template_kwargs=NO_THINKING,
            )
            assert result.token_ids == want and result.answer == text
            # gRPC's Tokenize renders the variables as /tokenize does (the SDK's tokenize).
            counted_grpc = client.tokenize(messages=TEXT_ONLY, chat_template_kwargs=NO_THINKING)
            assert counted_grpc.token_ids == text_ids
            assert client.tokenize(messages=TEXT_ONLY).token_ids != text_ids  # the default's rendering
            for kwargs, said in (
                ({"add_generation_prompt": False}, "chat_template_kwargs cannot set 'add_generation_prompt': set the request's own"),
                ({"messages": []}, "chat_template_kwargs cannot set 'messages'"),
                ({"bad name": 1}, "a template variable's name is letters, digits and underscores"),
                ({"prompt": "x" * 20000}, "the limit is 16384"),
            ):  # fmt: skip
                with pytest.raises(EpdError, match=said) as refused:
                    client.ask(None, messages=TEXT_ONLY, max_new_tokens=2, chat_template_kwargs=kwargs)
                assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
                status, reply = _chat(
                    http_port, {**body, "messages": TEXT_ONLY, "chat_template_kwargs": kwargs}
                )
                assert status == 400 and said in reply["error"]["message"], reply
            status, reply = _chat(http_port, {**body, "chat_template_kwargs": "enable_thinking"})
            assert status == 400 and "'chat_template_kwargs' must be an object" in reply["error"]["message"]
            served = client.ask(
                None, messages=TEXT_ONLY, max_new_tokens=MAX_NEW_TOKENS, chat_template_kwargs=NO_THINKING
            )
            assert served.token_ids == text_want  # still serving
