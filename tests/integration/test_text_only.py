"""Conversations without a video or image (a client's "hello", LiteLLM's health ping, Open WebUI's
title request), as vLLM and SGLang answer them on a vision-language model: no encoder call, the
prompt the chat template renders from the text alone, and tokens equal to
`model.generate(do_sample=False)` on the unsplit model for every family, in one process and
through the real stack's HTTP and gRPC doors."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import grpc
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from epd.client import EpdClient, EpdError, Message
from epd.gateway.ask_types import AskRequest, AskSummary
from epd.gateway.embedded import build_embedded_pipeline
from epd.model_runtime.adapter import VisualMeta
from epd.model_runtime.config import ModelConfig
from epd.model_runtime.loader import load_adapter
from epd.model_runtime.sampling import GenerationConfig
from epd.stages.contracts import MediaInput
from epd.stages.errors import InvalidRequest
from epd.stages.messages import from_chat_template
from epd.stages.names import LEGACY_STAGE_NAMES, TIMING_NAMES
from epd.stages.tokenize import TokenizeInput
from epd.token_pruning import PruningConfig
from epd.video.types import SamplingOptions
from tests.embedded import request_summary
from tests.families import FAMILIES, family_checkpoints
from tests.reference import decode_for_test, reference_tokens_for_messages, text_only_reference

MAX_NEW_TOKENS = 12
NUM_FRAMES = 4

# The processor's chat form: what the reference model's template and generate() see.
CONVERSATIONS = {
    "system_and_text": [
        {"role": "system", "content": [{"type": "text", "text": "answer briefly"}]},
        {"role": "user", "content": [{"type": "text", "text": "hello, who are you?"}]},
    ],
    "multi_turn": [
        {"role": "system", "content": [{"type": "text", "text": "answer briefly"}]},
        {"role": "user", "content": [{"type": "text", "text": "name a colour"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "red"}]},
        {"role": "user", "content": [{"type": "text", "text": "and another one?"}]},
    ],
}
# A conversation whose first turn is text alone and whose later turn brings the video.
VIDEO_LATER = [
    {"role": "user", "content": [{"type": "text", "text": "I will show you a clip"}]},
    {"role": "assistant", "content": [{"type": "text", "text": "ok, send it"}]},
    {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "what moves?"}]},
]


async def _summary(pipeline, messages: list[dict], media: MediaInput | None = None, **options) -> AskSummary:
    sampling, generation = (
        SamplingOptions(num_frames=NUM_FRAMES),
        GenerationConfig(max_new_tokens=MAX_NEW_TOKENS),
    )
    request = AskRequest(from_chat_template(messages), media, sampling, generation, **options)
    return await request_summary(pipeline, request)


def summary(pipeline, messages: list[dict], media: MediaInput | None = None, **options) -> AskSummary:
    return asyncio.run(_summary(pipeline, messages, media, **options))


# -- every family, in one process ---------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoints(tiny_models, tmp_path_factory):
    return family_checkpoints(tiny_models, tmp_path_factory.mktemp("text_only_models"))


@pytest.mark.parametrize("family", FAMILIES)
def test_text_only_conversations_equal_generate_in_every_family(checkpoints, media_files, family):
    """A system message and a question; a multi-turn text-only history; then a conversation
    whose first turn was text alone and whose last brings the video. The encoder is not called
    for the first two (no video_decode or encode timing, no media in the answer)."""
    path = checkpoints[family]
    with build_embedded_pipeline(ModelConfig(model=str(path))) as pipeline:
        for name, messages in CONVERSATIONS.items():
            got = summary(pipeline, messages)
            want = text_only_reference(path, messages, MAX_NEW_TOKENS)
            assert len(set(want)) > 2, (
                f"{name}: the tiny model repeats one token; the comparison would prove little"
            )
            assert got.token_ids == want, name
            assert got.num_visual_tokens == 0 and got.num_frames == 0 and got.media_sha256 == ""
            assert not got.encoder_cache_hit and got.grid_thw == (0, 0, 0)
            # Every timing, as in a media answer: the stages it skipped took 0 ms.
            assert list(got.timings_ms) == list(TIMING_NAMES)
            assert got.timings_ms["encode"] == 0.0 and got.timings_ms["video_decode"] == 0.0
            assert got.num_prompt_tokens > 0
            tokenize = TokenizeInput(messages=from_chat_template(messages), add_special_tokens=False)
            # /tokenize's count
            assert (
                len(asyncio.run(pipeline.prefill.tokenize(tokenize, name)).token_ids) == got.num_prompt_tokens
            )
        video = decode_for_test(media_files["mp4"], NUM_FRAMES)
        # The conversation's text-only first turn, then the turn that brings the video: that turn
        # reuses the first turn's KV for the text before its video (its entry is text-only), and
        # still equals generate() (Qwen3.5's recurrent layers keep no prefix cache at all).
        opening = summary(pipeline, VIDEO_LATER[:1])
        later = summary(pipeline, VIDEO_LATER, MediaInput(media_files["mp4"].read_bytes()))
        assert later.token_ids == reference_tokens_for_messages(path, video, VIDEO_LATER, MAX_NEW_TOKENS)
        assert later.num_visual_tokens > 0 and list(later.timings_ms) == list(TIMING_NAMES)
        if family != "qwen3_5":
            assert opening.num_prompt_tokens <= later.num_reused_prompt_tokens < later.num_prompt_tokens


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_text_only_and_media_requests_batched_together_each_equal_generate(checkpoints, media_files, family):
    """A text-only prompt (no visual rows; for Qwen3-VL, empty DeepStack features) in the same
    prefill and decode batches as media prompts: each answers as it does alone."""
    path = checkpoints[family]
    video = decode_for_test(media_files["mp4"], NUM_FRAMES)
    media_messages = [
        {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "what moves?"}]}
    ]
    data = media_files["mp4"].read_bytes()
    with build_embedded_pipeline(ModelConfig(model=str(path))) as pipeline:

        async def run():
            return await asyncio.gather(
                _summary(pipeline, media_messages, MediaInput(data)),
                _summary(pipeline, CONVERSATIONS["system_and_text"]),
                _summary(pipeline, CONVERSATIONS["multi_turn"]),
            )

        with_media, text, multi = asyncio.run(run())
    assert with_media.token_ids == reference_tokens_for_messages(path, video, media_messages, MAX_NEW_TOKENS)
    assert text.token_ids == text_only_reference(path, CONVERSATIONS["system_and_text"], MAX_NEW_TOKENS)
    assert multi.token_ids == text_only_reference(path, CONVERSATIONS["multi_turn"], MAX_NEW_TOKENS)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_text_part_holding_the_visual_placeholder_is_refused_alike_in_every_family(checkpoints, family):
    """Only a media part places the model's placeholder: one in a text part would take the media's
    embeddings or miscount them. Every family refuses it, with the media and without (and on
    /tokenize's path), with one message (`HfTextAdapter._render`)."""
    adapter = load_adapter(ModelConfig(model=str(checkpoints[family])), "prefill")
    meta = VisualMeta("video", (2, 4, 4), 1.0, adapter.num_visual_tokens((2, 4, 4)))
    for token in (adapter.processor.video_token, adapter.processor.image_token):
        half = len(token) // 2
        # one part holding it, or two that the template joins into it (the model's templates put
        # nothing between a message's parts)
        for said in (
            [{"type": "text", "text": f"what is {token}?"}],
            [
                {"type": "text", "text": f"what is {token[:half]}"},
                {"type": "text", "text": f"{token[half:]}?"},
            ],
        ):
            text_only = [{"role": "user", "content": said}]
            with_media = [{"role": "user", "content": [{"type": "video"}, *said]}]
            calls = (
                (adapter.build_prompt, text_only, None),
                (adapter.build_prompt, with_media, meta),
                (adapter.tokenize_conversation, text_only, False),
            )
            for call, *args in calls:
                with pytest.raises(
                    ValueError,
                    match=r"^a text part contains the model's visual placeholder token \(or a message's "
                    r"text parts make one together\); remove it$",
                ):
                    call(*args)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_template_that_writes_a_placeholder_of_its_own_is_its_authors_error(checkpoints, family):
    """A chat template that writes a visual placeholder beside the media part's (a second one, or
    one of the other kind, which Qwen's and GLM-4.1V's prompts took as text, a prompt generate()
    has no answer for) or into a conversation without media: the request's template is the
    client's error (400), the operator's (--chat-template) the server's (INTERNAL), as for a
    template that fails to render; in every family, with one check (`check_media_placeholders`)."""
    from epd.model_runtime.adapter import RenderOptions
    from epd.transport.errors import status_of

    adapter = load_adapter(ModelConfig(model=str(checkpoints[family])), "prefill")
    video, image = adapter.processor.video_token, adapter.processor.image_token
    own = adapter.processor.chat_template
    assert isinstance(own, str)
    question = {"type": "text", "text": "what moves?"}
    video_meta = VisualMeta("video", (2, 4, 4), 1.0, adapter.num_visual_tokens((2, 4, 4)), (0.0, 1.0))
    image_meta = VisualMeta("image", (1, 4, 4), 0.0, adapter.num_visual_tokens((1, 4, 4)))
    cases = (  # (media part, its meta, what the template writes after the conversation)
        ("video", video_meta, image),
        ("video", video_meta, video),
        ("image", image_meta, video),
        (None, None, video),
    )
    for kind, meta, extra in cases:
        conversation = [{"role": "user", "content": [*([{"type": kind}] if kind else []), question]}]
        template = own + extra
        with pytest.raises(
            ValueError, match="^the request's chat template writes a visual placeholder of its own"
        ):
            adapter.build_prompt(
                conversation, meta, RenderOptions(chat_template=template, requests_template=True)
            )
        with pytest.raises(RuntimeError) as failed:
            adapter.build_prompt(conversation, meta, RenderOptions(chat_template=template))
        assert str(failed.value).startswith(
            "the server's chat template (--chat-template) writes a visual placeholder of its own"
        ), (kind, extra)
        assert status_of(failed.value) == (
            grpc.StatusCode.INTERNAL,
            "internal error; the server log has details",
        )


def test_media_options_and_pruning_have_nothing_to_act_on_without_media(checkpoints):
    """As vLLM ignores multimodal processor options on a request without media: frame sampling
    and every token-dropping stage (a preset a Qwen3-VL media request is refused) leave a
    text-only answer as it was; the prefill drop and KV compression do not run on zero tokens."""
    messages = CONVERSATIONS["system_and_text"]
    for family, preset in (("qwen2_vl", "aggressive"), ("qwen3_vl", "balanced")):
        path = checkpoints[family]
        want = text_only_reference(path, messages, MAX_NEW_TOKENS)
        with build_embedded_pipeline(ModelConfig(model=str(path))) as pipeline:
            got = summary(pipeline, messages, pruning=PruningConfig.from_preset(preset))
            assert got.token_ids == want, family
            assert got.pruning.stages == [] and got.kept_visual_token_index == []
            # Prefill's own rule, for a caller other than the gateway (its PrefillService):
            # nothing runs whole and alone, only kv_dtype is kept.
            prepared = pipeline.prefill.engine.render(
                from_chat_template(messages), None, GenerationConfig(max_new_tokens=MAX_NEW_TOKENS),
                PruningConfig.from_preset(preset, kv_dtype="bfloat16"),
            )  # fmt: skip
            assert not prepared.exclusive and prepared.pruning == PruningConfig(kv_dtype="bfloat16")


def test_media_without_a_part_to_place_it_is_refused(tiny_models, media_files):
    """Bytes (or a sha256) beside text-only messages: refused, not silently dropped."""
    with build_embedded_pipeline(ModelConfig(model=str(tiny_models["qwen2_vl"]))) as pipeline:
        for media in (MediaInput(media_files["mp4"].read_bytes()), MediaInput(None, "ab" * 32)):
            with pytest.raises(InvalidRequest, match="no message has a video or image part"):
                summary(pipeline, CONVERSATIONS["system_and_text"], media)
        # A media part with nothing sent: the encoder's own refusal of an empty upload.
        with pytest.raises(Exception, match="empty"):
            summary(pipeline, VIDEO_LATER, None)


def test_prefill_service_takes_a_header_without_visual_and_refuses_what_disagrees(tiny_models, media_files):
    """PrefillService.Prefill (the servicer in this process, a stand-in for its RPC context): a
    header without `visual` is a text-only prompt; media messages without `visual`, and tensor
    chunks without it, are INVALID_ARGUMENT saying what to change; a call whose deadline has
    passed (`time_remaining()` 0) is DEADLINE_EXCEEDED before its prompt renders."""
    from epd.prefill_svc.config import PrefillConfig
    from epd.prefill_svc.servicer import PrefillServicer
    from epd.transport import convert
    from epd.v1 import prefill_pb2

    class Context:
        def __init__(self, remaining_s: float | None = None) -> None:
            self.status: tuple[grpc.StatusCode, str] | None = None
            self.remaining_s = remaining_s

        def add_done_callback(self, callback) -> None:
            pass

        def time_remaining(self) -> float | None:
            return self.remaining_s  # None: the caller set no deadline

        async def abort(self, code, message, trailing_metadata=()):
            self.status = (code, message)
            raise RuntimeError("aborted")

    generation = convert.generation_to_proto(GenerationConfig(max_new_tokens=MAX_NEW_TOKENS))
    with build_embedded_pipeline(ModelConfig(model=str(tiny_models["qwen2_vl"]))) as pipeline:
        servicer = PrefillServicer(PrefillConfig(), pipeline.prefill.kv_store)
        servicer.stage = pipeline.prefill
        media = asyncio.run(pipeline.encoder.encode(MediaInput(media_files["png"].read_bytes()), SamplingOptions(),
                                                    lambda event: None, "chunks"))  # fmt: skip

        def call(
            messages: list[dict], chunks=(), remaining_s: float | None = None
        ) -> tuple[prefill_pb2.PrefillResult | None, Context]:
            header = prefill_pb2.PrefillHeader(request_id="t", messages=convert.messages_to_proto(
                from_chat_template(messages)), generation=generation)  # fmt: skip

            async def requests():
                yield prefill_pb2.PrefillRequest(header=header)
                for chunk in chunks:
                    yield prefill_pb2.PrefillRequest(visual_embeds=chunk)

            async def answer() -> prefill_pb2.PrefillResult:
                (response,) = [r async for r in servicer.Prefill(requests(), context)]  # no prompt logprobs
                return response.result

            context = Context(remaining_s)
            try:
                return asyncio.run(answer()), context
            except RuntimeError:
                return None, context

        result, _ = call(CONVERSATIONS["system_and_text"])
        assert result is not None and result.num_prompt_tokens > 0 and result.num_visual_tokens_in == 0
        pipeline.prefill.kv_store.release(result.kv_handle)
        _, context = call(VIDEO_LATER)
        assert context.status == (grpc.StatusCode.INVALID_ARGUMENT, "the messages have a video or image part but "
                                  "no visual tokens were sent (set visual)")  # fmt: skip
        _, context = call(CONVERSATIONS["system_and_text"], list(convert.encoded_media_chunks(media)))
        assert context.status is not None and context.status[0] == grpc.StatusCode.INVALID_ARGUMENT
        assert "visual_embeds were sent without the header's visual metadata" in context.status[1]
        # The call's deadline reaches the render: one already past is refused before it renders.
        _, context = call(CONVERSATIONS["system_and_text"], remaining_s=0.0)
        assert context.status is not None and context.status[0] == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "reached its deadline before its prompt was rendered" in context.status[1]


# -- the prefix cache ----------------------------------------------------------------------------


def test_a_text_only_follow_up_reuses_its_history_and_never_a_media_entry(tiny_models, media_files):
    path = tiny_models["qwen2_vl"]
    with build_embedded_pipeline(ModelConfig(model=str(path))) as pipeline:
        first = CONVERSATIONS["multi_turn"][:2]
        one = summary(pipeline, first)
        assert one.num_reused_prompt_tokens == 0
        follow_up = [
            *first,
            {"role": "assistant", "content": [{"type": "text", "text": one.answer}]},
            {"role": "user", "content": [{"type": "text", "text": "and another one?"}]},
        ]
        two = summary(pipeline, follow_up)
        # The whole first prompt is reused (its answer's tokens follow it in the second).
        assert one.num_prompt_tokens <= two.num_reused_prompt_tokens < two.num_prompt_tokens
        assert two.token_ids == text_only_reference(path, follow_up, MAX_NEW_TOKENS)

        # The same text as a media request's, then as text alone: two entries, and the text-only
        # request reuses nothing of the media request's (nor, below, the media one of it).
        prefix_cache = pipeline.prefill.engine.prefix_cache
        prefix_cache.clear()
        text = {"type": "text", "text": "what colour is the moving square?"}
        with_media = summary(
            pipeline,
            [{"role": "user", "content": [text, {"type": "video"}]}],
            MediaInput(media_files["mp4"].read_bytes()),
        )
        alone = summary(pipeline, [{"role": "user", "content": [text]}])
        assert with_media.num_reused_prompt_tokens == 0 and alone.num_reused_prompt_tokens == 0
        assert prefix_cache.stats().num_entries == 2
        again = summary(
            pipeline,
            [{"role": "user", "content": [text, {"type": "video"}]}],
            MediaInput(media_files["mp4"].read_bytes()),
        )
        assert again.num_reused_prompt_tokens > 0 and again.token_ids == with_media.token_ids
        # A conversation that opens with its media reuses no text-only entry: it had no text-only
        # turns (here the LCP with `alone` is the template's preamble and the question's words).
        other = summary(
            pipeline,
            [{"role": "user", "content": [{**text, "text": text["text"] + " and why?"}, {"type": "video"}]}],
            MediaInput(media_files["mp4"].read_bytes()),
        )
        assert other.num_reused_prompt_tokens == 0


# -- the real stack: HTTP and gRPC ---------------------------------------------------------------


def _steps_by_stage(http_port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "epd_engine_steps_total":
                out[sample.labels["stage"]] = out.get(sample.labels["stage"], 0.0) + sample.value
    return out


def test_http_and_grpc_answer_text_alone_without_calling_the_encoder(shared_stack, tiny_models):
    messages = CONVERSATIONS["system_and_text"]
    want = text_only_reference(tiny_models["qwen2_vl"], messages, MAX_NEW_TOKENS)
    before = _steps_by_stage(shared_stack.http_port)
    http = openai.OpenAI(
        base_url=f"http://127.0.0.1:{shared_stack.http_port}/v1", api_key="none", max_retries=0
    )
    openai_messages = [{"role": "system", "content": "answer briefly"},
                       {"role": "user", "content": "hello, who are you?"}]  # fmt: skip
    # What LiteLLM's health check sends: a string content, no media at all.
    reply = http.chat.completions.create(
        model="epd",
        messages=openai_messages,
        max_tokens=MAX_NEW_TOKENS,
        # ignored: no media
        extra_body={"media": {"num_frames": NUM_FRAMES}},
    )
    epd = reply.model_extra["epd"]
    assert epd["token_ids"] == want
    assert epd["num_visual_tokens"] == 0 and epd["media_sha256"] == "" and not epd["encoder_cache_hit"]
    # The same timing keys as every answer (a client reading one answer's keys reads them all).
    assert set(epd["timings_ms"]) == {*TIMING_NAMES, *LEGACY_STAGE_NAMES}
    assert epd["timings_ms"]["encode"] == 0.0 and epd["timings_ms"]["video_decode"] == 0.0
    assert reply.usage is not None and reply.usage.prompt_tokens == epd["num_prompt_tokens"]

    stream = http.chat.completions.create(
        model="epd",
        messages=openai_messages,
        max_tokens=MAX_NEW_TOKENS,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"return_token_ids": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reply.choices[0].message.content
    assert [
        t for c in chunks if c.choices for t in (c.choices[0].model_extra or {}).get("token_ids") or []
    ] == want

    with EpdClient(shared_stack.gateway, timeout_s=120) as client:
        result = client.ask(
            None,
            messages=[Message.system("answer briefly"), Message.user("hello, who are you?")],
            max_new_tokens=MAX_NEW_TOKENS,
            num_frames=NUM_FRAMES,
        )
        assert result.token_ids == want
        assert result.timings_ms.encode_ms == 0.0 and result.timings_ms.video_decode_ms == 0.0
        assert result.media_num_bytes_sent == 0 and result.num_visual_tokens == 0
        # The question form without a video: the question alone.
        alone = client.ask(None, "hello, who are you?", max_new_tokens=MAX_NEW_TOKENS)
        assert alone.token_ids == text_only_reference(
            tiny_models["qwen2_vl"],
            [{"role": "user", "content": [{"type": "text", "text": "hello, who are you?"}]}],
            MAX_NEW_TOKENS,
        )
        # A text-only conversation through the SDK: the follow-up reuses the first turn's prompt.
        chat = client.conversation(None, max_new_tokens=MAX_NEW_TOKENS)
        chat.ask("name a colour")
        second = chat.ask("and another one?")
        assert second.num_reused_prompt_tokens > 0
        # Media bytes beside messages without a media part: INVALID_ARGUMENT, saying what to change.
        with pytest.raises(EpdError, match="no message has a video or image part") as info:
            client.ask(b"\x00" * 64, messages=[Message.user("hello")])
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    after = _steps_by_stage(shared_stack.http_port)
    assert after["encoder"] == before["encoder"], "a text-only request called the encoder"
    assert after["prefill"] > before["prefill"] and after["decode"] > before["decode"]


def test_a_raw_http_body_without_media_answers(shared_stack):
    """The smallest body a client sends (no max_tokens, no options): 200 with an answer."""
    body = json.dumps(
        {"model": "epd", "messages": [{"role": "user", "content": "ping"}], "max_tokens": 4}
    ).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{shared_stack.http_port}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=120) as resp:
        answer = json.loads(resp.read())
    assert answer["choices"][0]["finish_reason"] in ("stop", "length")
    assert answer["usage"]["completion_tokens"] >= 1
