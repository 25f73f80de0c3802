"""One message model for every door: the parts of a conversation keep the user's order and are
rendered with the model's own chat template, so that for [video, text], [text, video],
[text, video, text], an image message and multi-turn history the HTTP API (streaming and not),
the gRPC API and the embedded pipeline all answer `model.generate(do_sample=False)`'s tokens on
`processor.apply_chat_template` of the same messages. One real stack (qwen2_vl) for the file."""

from __future__ import annotations

import asyncio
import base64

import grpc
import openai
import pytest

from epd.client import EpdClient, EpdError
from epd.gateway.ask_types import AskRequest, AskSummary
from epd.gateway.chat_answer import completion_body
from epd.gateway.chat_chunks import chunk_body
from epd.gateway.embedded import build_embedded_pipeline
from epd.model_runtime.config import ModelConfig
from epd.model_runtime.hf_reference import reference_inputs
from epd.model_runtime.sampling import GenerationConfig
from epd.stages.contracts import MediaInput
from epd.stages.messages import VIDEO, Message, from_chat_template
from epd.video.types import SamplingOptions
from tests.reference import decode_for_test, reference_tokens_for_messages
from tests.stack import gateway_over

FAMILY = "qwen2_vl"
MODEL = "tiny"
NUM_FRAMES = 4
MAX_NEW_TOKENS = 12

# The processor's chat form: what the reference model's template and generate() see.
SHAPES = {
    "video_text": ("mp4", [{"role": "user", "content": [
        {"type": "video"}, {"type": "text", "text": "what colour is the moving square?"}]}]),
    "text_video": ("mp4", [{"role": "user", "content": [
        {"type": "text", "text": "what colour is the moving square?"}, {"type": "video"}]}]),
    "text_video_text": ("mp4", [{"role": "user", "content": [
        {"type": "text", "text": "look at this clip:"}, {"type": "video"},
        {"type": "text", "text": "which direction does it move?"}]}]),
    # The video alone, no text (vLLM and OpenAI accept it): the template's own tokens follow it.
    "video_only": ("mp4", [{"role": "user", "content": [{"type": "video"}]}]),
    "image": ("png", [{"role": "user", "content": [
        {"type": "text", "text": "describe this image"}, {"type": "image"}]}]),
    "history": ("mp4", [
        {"role": "system", "content": "answer briefly"},
        {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "how many objects are there?"}]},
        {"role": "assistant", "content": "two"},
        {"role": "user", "content": [{"type": "text", "text": "which appears first?"}]},
    ]),
}  # fmt: skip
MIME = {"mp4": "video/mp4", "png": "image/png"}


def openai_messages(messages: list[dict], url: str) -> list[dict]:
    """The same conversation in OpenAI's form: the media part becomes a video_url / image_url."""
    out = []
    for m in messages:
        content = m["content"]
        if isinstance(content, list):
            content = [
                {"type": f"{p['type']}_url", f"{p['type']}_url": {"url": url}} if p["type"] != "text" else p
                for p in content
            ]
        out.append({"role": m["role"], "content": content})
    return out


@pytest.fixture(scope="module")
def stack(shared_stack, tmp_path_factory):
    """A gateway of its own (--served-model-name is the gateway's) over the session's stages."""
    assert FAMILY == "qwen2_vl"  # shared_stack's model
    flags = ["--served-model-name", MODEL]
    with gateway_over(shared_stack, tmp_path_factory.mktemp("logs_shapes"), flags, http=True) as s:
        yield s


@pytest.fixture(scope="module")
def http(stack):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{stack.http_port}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def grpc_client(stack):
    with EpdClient(stack.gateway, timeout_s=120) as c:
        yield c


@pytest.fixture(scope="module")
def embedded(tiny_models):
    pipeline = build_embedded_pipeline(ModelConfig(model=str(tiny_models[FAMILY])))
    yield pipeline
    pipeline.close()


@pytest.fixture(scope="module")
def references(tiny_models, media_files):
    out = {}
    for name, (media, messages) in SHAPES.items():
        video = decode_for_test(media_files[media], NUM_FRAMES)
        out[name] = reference_tokens_for_messages(tiny_models[FAMILY], video, messages, MAX_NEW_TOKENS)
    return out


def test_the_shapes_give_different_references(references):
    """Otherwise equality below would not show that the order reaches the model."""
    assert len({tuple(t) for t in references.values()}) == len(references), references
    assert all(len(t) >= 4 for t in references.values()), references


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_embedded_equals_generate(embedded, media_files, references, shape):
    media, messages = SHAPES[shape]
    request = AskRequest(
        messages=from_chat_template(messages),
        media=MediaInput(media_files[media].read_bytes()),
        sampling=SamplingOptions(num_frames=NUM_FRAMES),
        generation=GenerationConfig(max_new_tokens=MAX_NEW_TOKENS),
    )

    async def run():
        return [item async for item in embedded.ask(request) if isinstance(item, AskSummary)][0]

    assert asyncio.run(run()).token_ids == references[shape]


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_grpc_equals_generate(grpc_client, media_files, references, shape):
    media, messages = SHAPES[shape]
    result = grpc_client.ask(
        media_files[media], messages=messages, num_frames=NUM_FRAMES, max_new_tokens=MAX_NEW_TOKENS
    )
    assert result.token_ids == references[shape]


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_http_streaming_and_not_equal_generate_and_each_other(http, media_files, references, shape):
    media, messages = SHAPES[shape]
    url = f"data:{MIME[media]};base64," + base64.b64encode(media_files[media].read_bytes()).decode()
    kwargs = dict(model=MODEL, messages=openai_messages(messages, url), max_tokens=MAX_NEW_TOKENS,
                  extra_body={"media": {"num_frames": NUM_FRAMES}})  # fmt: skip
    whole = http.chat.completions.create(**kwargs)
    assert whole.model_extra["epd"]["token_ids"] == references[shape]
    chunks = list(
        http.chat.completions.create(
            stream=True, **{**kwargs, "extra_body": {**kwargs["extra_body"], "return_token_ids": True}}
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    streamed_ids = [t for c in chunks if c.choices for t in (c.choices[0].model_extra.get("token_ids") or [])]
    assert streamed_ids == references[shape]
    assert streamed == whole.choices[0].message.content


def test_the_deprecated_question_is_the_video_text_shape(grpc_client, media_files, references):
    """gRPC AskHeader.question and the SDK's ask(video, question), kept until 0.3: [media, question]."""
    question = SHAPES["video_text"][1][0]["content"][1]["text"]
    result = grpc_client.ask(
        media_files["mp4"], question, num_frames=NUM_FRAMES, max_new_tokens=MAX_NEW_TOKENS
    )
    assert result.token_ids == references["video_text"]


def test_a_conversation_over_http_reuses_its_history_prefill(http, tiny_models, media_files):
    """Three turns over the OpenAI API across the three processes, the whole history sent each
    turn (assistant turns = the earlier answers): each equals generate() on that history, and
    turns 2-3 report the earlier turns' tokens (more than the video's) as cached_tokens."""
    url = "data:video/mp4;base64," + base64.b64encode(media_files["mp4"].read_bytes()).decode()
    video = decode_for_test(media_files["mp4"], NUM_FRAMES)
    history: list[dict] = []
    for turn, question in enumerate(["describe the clip", "what moves?", "in which direction?"]):
        history.append({"role": "user", "content": [*([{"type": "video"}] if turn == 0 else []),
                                                    {"type": "text", "text": question}]})  # fmt: skip
        reply = http.chat.completions.create(model=MODEL, messages=openai_messages(history, url),
                                             max_tokens=MAX_NEW_TOKENS,
                                             extra_body={"media": {"num_frames": NUM_FRAMES}})  # fmt: skip
        epd = reply.model_extra["epd"]
        assert epd["token_ids"] == reference_tokens_for_messages(
            tiny_models[FAMILY], video, history, MAX_NEW_TOKENS
        )
        assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
        cached = reply.usage.prompt_tokens_details.cached_tokens
        assert cached == epd["num_reused_prompt_tokens"]
        if turn > 0:
            assert epd["num_visual_tokens"] < cached < reply.usage.prompt_tokens, f"turn {turn + 1}"
        history.append({"role": "assistant", "content": reply.choices[0].message.content or ""})


def test_one_media_per_request_and_other_refusals(http, grpc_client, media_files):
    url = "data:video/mp4;base64," + base64.b64encode(media_files["mp4"].read_bytes()).decode()
    two = [
        {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "and?"}, {"type": "video"}]}
    ]
    with pytest.raises(openai.BadRequestError, match="at most one video or image per request"):
        http.chat.completions.create(model=MODEL, messages=openai_messages(two, url))
    with pytest.raises(EpdError, match="at most one video or image per request") as info:
        grpc_client.ask(media_files["mp4"], messages=two, num_frames=NUM_FRAMES)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    # An assistant's message last is answered or continued (test_continue_final_message); a system's is not.
    ends_with_system = [*SHAPES["video_text"][1], {"role": "system", "content": "be brief"}]
    with pytest.raises(openai.BadRequestError, match="end with the user's message"):
        http.chat.completions.create(model=MODEL, messages=openai_messages(ends_with_system, url))
    with pytest.raises(EpdError, match="end with the user's message") as info:
        grpc_client.ask(media_files["mp4"], messages=ends_with_system, num_frames=NUM_FRAMES)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT


# -- a character that spans several tokens ----------------------------------------------------

MULTI_BYTE = "é日🙂"


def test_multi_byte_characters_stream_as_they_decode(embedded):
    """The random tiny model cannot be steered to answer a multi-byte character, so its token
    ids go through the decode engine's own text path (a real Generation on the real tokenizer,
    only its sampler replaced by the ids) and then through the HTTP API's streaming and
    non-streaming bodies: the same text, no half characters, equal to decoding all ids at once."""
    import torch

    from epd.decode_svc.engine import Generation
    from epd.model_runtime.kv_cache import KvCache

    adapter = embedded.prefill.engine.adapter
    ids = adapter.tokenizer.encode("it is " + MULTI_BYTE + " ok", add_special_tokens=False)
    for ch in MULTI_BYTE:
        assert len(adapter.tokenizer.encode(ch, add_special_tokens=False)) >= 2, f"{ch!r} is one token"
    cfg = adapter.text_config
    heads, head_dim = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    layer = torch.zeros(1, heads, 3, head_dim)
    cache = KvCache([layer.clone() for _ in range(cfg.num_hidden_layers)],
                    [layer.clone() for _ in range(cfg.num_hidden_layers)])  # fmt: skip
    gen = Generation(adapter, cache, ids[0], [3, 3, 3, 3], GenerationConfig(max_new_tokens=len(ids)))
    forced = iter(ids[1:])
    gen.sampler = lambda logits: next(forced)  # type: ignore[assignment]
    steps = [gen.first()]
    while not gen.done:
        steps.append(gen.step())
    assert [t for s in steps for t in s.token_ids] == ids
    deltas = [s.text for s in steps]
    assert not any("\ufffd" in d for d in deltas), deltas
    assert sum(1 for d in deltas if d == "") >= len(MULTI_BYTE), "the partial bytes were held back"

    summary = AskSummary("r", "".join(deltas), ids, steps[-1].finish_reason, 1, 1, 1, {}, 0, False, "", [])
    whole = completion_body(summary, MODEL)["choices"][0]["message"]["content"]
    streamed = "".join(chunk_body("r", MODEL, 0, {"content": s.text}, token_ids=s.token_ids)
                       ["choices"][0]["delta"]["content"] for s in steps)  # fmt: skip
    assert streamed == whole == adapter.tokenizer.decode(ids, skip_special_tokens=True)
    assert MULTI_BYTE in whole


# -- epd's rendering follows the processor's template, for each family ---------------------------

# Qwen2-VL-Instruct's own template (the hub checkpoint's), beside the tiny models' reduced one:
# string or list content, "Picture N:" / "Video N:" ids when add_vision_id, parts keyed loosely.
QWEN2_VL_INSTRUCT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: "
    "{% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.mark.parametrize("template", ["checkpoint", "qwen2_vl_instruct"])
@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_prompt_ids_are_the_processors(tiny_models, media_files, family, template):
    """epd renders with the processor's own template: for every shape, the prompt's token ids are
    those of `processor(text=apply_chat_template(messages), videos=...)`."""
    from transformers import AutoProcessor

    from epd.model_runtime.adapter import VisualMeta
    from epd.model_runtime.qwen2_vl import Qwen2VLAdapter
    from epd.stages.messages import to_chat_template

    adapter = Qwen2VLAdapter(
        str(tiny_models[family]), ModelConfig(model=str(tiny_models[family])), {"language"}
    )
    processor = AutoProcessor.from_pretrained(tiny_models[family])
    if template != "checkpoint":
        adapter.processor.chat_template = processor.chat_template = QWEN2_VL_INSTRUCT_TEMPLATE
    for name, (media, messages) in SHAPES.items():
        video = decode_for_test(media_files[media], NUM_FRAMES)
        expected = reference_inputs(processor, video, messages)
        key = "image_grid_thw" if video.is_image else "video_grid_thw"
        grid = tuple(int(x) for x in expected[key][0])
        meta = VisualMeta("image" if video.is_image else "video", grid, 0.5, adapter.num_visual_tokens(grid))  # type: ignore[arg-type]
        prompt = adapter.build_prompt(to_chat_template(from_chat_template(messages), meta.modality), meta)
        assert prompt.input_ids.tolist() == expected["input_ids"].tolist(), name


def test_sampled_answers_without_a_seed_differ_and_a_seed_repeats_on_both_doors(
    http, grpc_client, media_files
):
    """A sampled request without a seed took seed 0: every "random" answer was the same one. Now
    the gateway draws a seed per request; a given seed still gives the same tokens on HTTP and gRPC."""
    url = "data:video/mp4;base64," + base64.b64encode(media_files["mp4"].read_bytes()).decode()
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "video_url", "video_url": {"url": url}},
                {"type": "text", "text": "what happens?"},
            ],
        }
    ]

    def http_tokens(**generation):
        answer = http.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=12,
            temperature=5.0,
            extra_body={"media": {"num_frames": NUM_FRAMES}, **generation},
        )
        return tuple(answer.model_extra["epd"]["token_ids"])

    unseeded = {http_tokens() for _ in range(3)}
    assert len(unseeded) == 3, unseeded
    seeded = http_tokens(seed=5)
    assert http_tokens(seed=5) == seeded
    over_grpc = grpc_client.ask(
        media_files["mp4"],
        messages=[Message.user(VIDEO, "what happens?")],
        num_frames=NUM_FRAMES,
        max_new_tokens=12,
        temperature=5.0,
        seed=5,
    )
    assert tuple(over_grpc.token_ids) == seeded
