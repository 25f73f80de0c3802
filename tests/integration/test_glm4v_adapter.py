"""GLM-4.1V (dense, model_type glm4v) through `Glm4vAdapter` split in one process: the encoder's
adapter (tower only) -> `encode`, the language adapter -> `build_prompt` + `prefill` + a greedy
`decode_step` loop, equals `model.generate(do_sample=False)` token for token on a tiny checkpoint
of the real transformers classes, for 8 and 32 frames, an image and a conversation that goes on
after an answer. The prompt (one `<|begin_of_image|>...<|end_of_image|>{seconds}` per temporal
group, the seconds of the decoded frames' real times) is the processor's own, id for id, with the
processor's frame sampling off; positions are `get_rope_index`'s (plain positions change the
answer); frame groups sized as their clip are the processor's patches of the whole clip; chunked and
batched prefill and batched decode equal the plain paths; each one-part adapter reads only its own
part's tensors; the three services answer as generate() does."""

from __future__ import annotations

import asyncio
import inspect
import re
from dataclasses import replace

import numpy as np
import pytest
import torch
from transformers.video_utils import VideoMetadata

from epd.model_runtime.adapter import PrefillChunk, PrefillState, RenderOptions, VisualMeta
from epd.model_runtime.config import ModelConfig
from epd.model_runtime.glm4v import Glm4vAdapter
from epd.model_runtime.hf_loading import language_key, vision_key
from epd.model_runtime.hf_reference import whole_model
from epd.model_runtime.reasoning_markers import REASONING_MARKERS
from epd.model_runtime.tiny_glm4v import GLM4V_CHAT_TEMPLATE
from epd.model_runtime.tiny_model import TinyVLMSpec, build_checkpoint
from epd.video.types import DecodedVideo
from tests.families import (
    CASES,
    MAX_NEW_TOKENS,
    QUESTION,
    assert_batched_decode_equals_alone,
    assert_epd_ask_equals_references,
    assert_qwen_parts_load_exactly,
    assert_reference_varies,
    check_a_template_without_the_media_part_is_refused_as_such,
    checkpoint_keys,
    conversation,
    generate_references,
    greedy,
    load_each_part,
    load_stage_adapters,
    load_video,
    make_clip_over_qwen3_size_limit,
    visual_meta,
)
from tests.families import qwen_processor_inputs as _processor_inputs
from tests.reference import decode_for_test, reference_tokens

# A conversation that goes on after the model's answer: the video stays in the first turn.
FOLLOW_UP = [
    {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": QUESTION}]},
    {"role": "assistant", "content": [{"type": "text", "text": "red"}]},
    {"role": "user", "content": [{"type": "text", "text": "and which direction does it move?"}]},
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("glm4v") / "m", TinyVLMSpec(family="glm4v"))


@pytest.fixture(scope="module")
def vision(checkpoint):
    return Glm4vAdapter(str(checkpoint), ModelConfig(), {"vision"})  # the encoder's


@pytest.fixture(scope="module")
def language(checkpoint):
    return Glm4vAdapter(str(checkpoint), ModelConfig(), {"language"})  # prefill's and decode's


@pytest.fixture(scope="module")
def whole(checkpoint):
    return whole_model(checkpoint)


@pytest.fixture(scope="module")
def references(whole, media_files):
    return generate_references(whole, media_files, _processor_inputs)


def _split(vision, language, video, messages=None):
    """Encoder adapter -> language adapter, greedy; returns (tokens, the prefill's last logits)."""
    inputs = vision.preprocess(video)
    prompt = language.build_prompt(messages or conversation(video), visual_meta(vision, inputs))
    state = language.prefill(prompt, vision.encode(inputs))
    return greedy(language, state), state.last_logits


def _prompt_and_embeds(vision, language, media_files, media, num_frames):
    video = load_video(media_files, media, num_frames)
    inputs = vision.preprocess(video)
    return language.build_prompt(conversation(video), visual_meta(vision, inputs)), vision.encode(inputs)


@pytest.mark.parametrize("media,num_frames", CASES)
def test_reference_output_varies(references, media, num_frames):
    assert_reference_varies(references[(media, num_frames)])


@pytest.mark.parametrize("media,num_frames", CASES)
def test_prompt_pixels_and_positions_are_the_processors_and_generates(
    vision, language, whole, media_files, media, num_frames
):
    model, processor = whole
    video = load_video(media_files, media, num_frames)
    ref = _processor_inputs(processor, video)
    inputs = vision.preprocess(video)
    prompt = language.build_prompt(conversation(video), visual_meta(vision, inputs))

    assert torch.equal(prompt.input_ids, ref["input_ids"])
    pixels, grid = (
        ("pixel_values", "image_grid_thw") if video.is_image else ("pixel_values_videos", "video_grid_thw")
    )
    assert torch.equal(inputs.pixel_values, ref[pixels]) and inputs.grid_thw == tuple(ref[grid][0].tolist())
    # a video's tokens are <|image|> tokens too: the processor types them by the markers around them
    assert torch.equal(prompt.visual_mask, prompt.input_ids[0] == model.config.image_token_id)
    assert torch.equal(
        prompt.visual_mask.long() * (1 if video.is_image else 2), ref["mm_token_type_ids"][0].long()
    )
    expected = model._prepare_position_ids_for_generation(ref["input_ids"], dict(ref))  # what generate() uses
    assert torch.equal(prompt.position_ids, expected)
    if not video.is_image:  # "<|end_of_image|>{whole seconds}" per temporal group: its first frame's time
        text = processor.tokenizer.decode(prompt.input_ids[0])
        groups = inputs.grid_thw[0]
        assert groups == num_frames // 2 and text.count("<|begin_of_image|>") == groups
        fps = video.source_fps
        firsts = [int(round(t * fps) / fps) for t in video.timestamps_s[::2]]
        assert [int(s) for s in inputs.group_timestamps_s] == firsts and firsts[-1] > 0
        stamps = [part.split("<")[0] for part in text.split("<|end_of_image|>")[1:]]
        assert stamps == [str(s) for s in firsts]


@pytest.mark.parametrize("num_frames", [32, 5])
def test_frame_groups_sized_as_their_clip_are_the_processors_patches_of_the_whole_clip(
    vision, whole, tmp_path, num_frames
):
    """The encoder preprocesses 2-frame groups: told the clip's frame count, they are the rows of
    the processor's output on the whole clip, pixel for pixel (32 frames of 224x192 over the
    video processor's t x h x w bound: shrunk; 5 frames: the 1-frame last group padded with its
    frame), with the clip's group times. Sized alone, the groups of the 32 frames keep larger frames."""
    _, processor = whole
    video = decode_for_test(make_clip_over_qwen3_size_limit(tmp_path), num_frames)
    ref = _processor_inputs(processor, video)
    slices = [slice(i, i + 2) for i in range(0, num_frames, 2)]
    groups = [replace(video, frames=video.frames[s], timestamps_s=video.timestamps_s[s]) for s in slices]
    inputs = [vision.preprocess(group, clip_num_frames=num_frames) for group in groups]

    assert torch.equal(torch.cat([i.pixel_values for i in inputs]), ref["pixel_values_videos"])
    ((t, h, w),) = ref["video_grid_thw"].tolist()
    assert {i.grid_thw[1:] for i in inputs} == {(h, w)} and sum(i.grid_thw[0] for i in inputs) == t
    assert sum((i.group_timestamps_s for i in inputs), ()) == vision.preprocess(video).group_timestamps_s
    if num_frames == 32:
        assert vision.preprocess(groups[0]).grid_thw[1:] != (h, w)


def test_the_video_processor_resizes_a_clip_as_qwen3_vls_does():
    """`clip_frame_size` (and so `frame_resizer`) is Qwen3-VL's code on Qwen3-VL's smart_resize:
    right only while GLM-4.1V's is the same function, line for line."""
    from transformers.models.glm4v import video_processing_glm4v
    from transformers.models.qwen3_vl import video_processing_qwen3_vl

    glm, qwen = (
        inspect.getsource(m.smart_resize) for m in (video_processing_glm4v, video_processing_qwen3_vl)
    )
    assert glm == qwen


def test_frames_resized_one_at_a_time_are_the_processors_pixels_of_the_whole_clip(vision):
    """Bit for bit: `preprocess` (group by group, as the encoder runs it) of frames the decoder's
    resizer made one at a time for the clip's frame count equals the processor on the whole clip as
    decoded (generate()'s input): under the tiny processor's t x h x w bound (enlarged to multiples
    of 28), over it (shrunk), at odd counts; a frame whose target is not its own fixed point stays
    as decoded."""
    vp = vision.processor.video_processor
    assert vision.frame_resizer(1) is None  # `preprocess` refuses a 1-frame clip with its own message
    rng = np.random.default_rng(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the tower's threads split the processor's resize across frames
    try:
        for (height, width), num_frames in [
            ((180, 320), 3),
            ((180, 320), 31),
            ((1080, 1920), 9),
            ((61, 97), 5),
            ((30, 40), 2),
        ]:
            frames = rng.integers(0, 256, size=(num_frames, height, width, 3), dtype=np.uint8)  # [T, H, W, 3]
            resize = vision.frame_resizer(num_frames)
            assert resize is not None
            resized = np.stack([resize(f) for f in frames])  # [T, h, w, 3]
            times = [i / 2.0 for i in range(num_frames)]
            groups = [
                vision.preprocess(
                    DecodedVideo(resized[i : i + 2], times[i : i + 2], 2.0, num_frames / 2, 2.0),
                    clip_num_frames=num_frames,
                )
                for i in range(0, num_frames, 2)
            ]
            want = vp(videos=[frames], do_sample_frames=False, return_tensors="pt")
            assert torch.equal(torch.cat([g.pixel_values for g in groups]), want["pixel_values_videos"])
            _, grid_h, grid_w = want["video_grid_thw"][0].tolist()
            assert {g.grid_thw[1:] for g in groups} == {(grid_h, grid_w)}
            assert resized.shape[1:3] in {(grid_h * 14, grid_w * 14), (height, width)}
            assert (height, width) == (1080, 1920) or resized.shape[1:3] != (height, width)
    finally:
        torch.set_num_threads(threads)


def test_an_answer_about_a_clip_the_decoder_shrank_equals_generate(checkpoint, tmp_path):
    """generate() gets 23 frames as decoded (320x180) and its processor shrinks the clip; the
    pipeline's decoder resized them already, and its encoder preprocessed them group by group."""
    from epd.gateway.embedded import build_embedded_pipeline
    from tests.embedded import ask_tokens
    from tests.media import make_video

    clip = make_video(tmp_path / "wide.mp4", size=(320, 180), seconds=3.0, gop=10)
    want = reference_tokens(checkpoint, decode_for_test(clip, 23), QUESTION, 12)
    assert_reference_varies(want, 12)
    with build_embedded_pipeline(ModelConfig(model=str(checkpoint))) as pipeline:
        assert asyncio.run(ask_tokens(pipeline, clip, QUESTION, 23, 12)) == want


def test_without_group_times_the_prompt_assumes_evenly_spaced_frames_from_zero(
    vision, language, whole, media_files
):
    """What prefill builds from a VisualMeta without the times: the processor's prompt for frames
    0..T-1 at the sampled rate."""
    _, processor = whole
    video = load_video(media_files, "mp4", 32)
    inputs = vision.preprocess(video)
    meta = VisualMeta(
        inputs.modality, inputs.grid_thw, inputs.second_per_grid_t, vision.num_visual_tokens(inputs.grid_thw)
    )
    prompt = language.build_prompt(conversation(video), meta)
    metadata = VideoMetadata(total_num_frames=32, fps=video.sampled_fps, frames_indices=list(range(32)))
    assert torch.equal(prompt.input_ids, _processor_inputs(processor, video, metadata)["input_ids"])


@pytest.mark.parametrize("media,num_frames", CASES)
def test_in_process_split_equals_generate(vision, language, media_files, references, media, num_frames):
    tokens, _ = _split(vision, language, load_video(media_files, media, num_frames))
    assert tokens == references[(media, num_frames)]


def test_a_conversation_that_goes_on_after_an_answer_equals_generate(vision, language, whole, media_files):
    model, processor = whole
    video = load_video(media_files, "mp4", 8)
    ref = _processor_inputs(processor, video, messages=FOLLOW_UP)
    with torch.inference_mode():
        out = model.generate(**ref, do_sample=False, max_new_tokens=MAX_NEW_TOKENS)
    expected = out[0, ref["input_ids"].shape[1] :].tolist()
    assert_reference_varies(expected)
    assert _split(vision, language, video, FOLLOW_UP)[0] == expected


def test_plain_positions_change_the_answer(vision, language, media_files, references):
    """Negative control: the same prompt and embeddings with every M-RoPE row the plain text
    position (what a 1-D family uses) move the logits and the answer."""
    video = load_video(media_files, "mp4", 8)
    inputs = vision.preprocess(video)
    prompt = language.build_prompt(conversation(video), visual_meta(vision, inputs))
    embeds = vision.encode(inputs)
    right = language.prefill(prompt, embeds)
    length = prompt.num_tokens
    plain = replace(prompt, position_ids=torch.arange(length).view(1, 1, length).expand(4, 1, length).clone())
    wrong = language.prefill(plain, embeds)
    assert greedy(language, right) == references[("mp4", 8)]
    assert not torch.allclose(right.last_logits, wrong.last_logits, atol=1e-3)
    assert greedy(language, wrong) != greedy(language, right)


def test_frame_groups_encode_independently_and_encode_batch_equals_encode(vision, media_files):
    """The tower attends within one frame group: groups encoded apart and concatenated are the
    whole video's tokens (what the encoder's `frames_per_group` relies on); one tower call for a
    group, an image and a video equals each alone."""
    video = load_video(media_files, "mp4", 8)
    inputs = vision.preprocess(video)
    whole = vision.encode(inputs)
    per_group = inputs.pixel_values.shape[0] // inputs.grid_thw[0]
    groups = [
        replace(
            inputs,
            pixel_values=inputs.pixel_values[i * per_group : (i + 1) * per_group],
            grid_thw=(1, *inputs.grid_thw[1:]),
        )
        for i in range(inputs.grid_thw[0])
    ]
    assert torch.allclose(torch.cat([vision.encode(g) for g in groups]), whole, atol=1e-5)
    image = vision.preprocess(load_video(media_files, "png", 1))
    batched = vision.encode_batch([groups[0], image, inputs])
    alone = [vision.encode(groups[0]), vision.encode(image), whole]
    assert [b.shape for b in batched] == [a.shape for a in alone]
    assert all(torch.allclose(b, a, atol=1e-5) for b, a in zip(batched, alone, strict=True))


def test_chunked_and_batched_prefill_equal_prefill_alone(vision, language, media_files):
    (p1, e1), (p2, e2) = (
        _prompt_and_embeds(vision, language, media_files, m, n) for m, n in (("mp4", 8), ("png", 1))
    )
    alone = [language.prefill(p, e) for p, e in ((p1, e1), (p2, e2))]
    rows = language.prefill_chunks(
        [PrefillChunk(p1, e1, 0, p1.num_tokens), PrefillChunk(p2, e2, 0, p2.num_tokens)]
    )
    for got, want in zip(rows, alone, strict=True):
        assert torch.allclose(got.last_logits, want.last_logits, atol=1e-4)
        kv = language.chunk_cache_to_kv(got.cache)
        assert all(torch.allclose(a, b, atol=1e-4) for a, b in zip(kv.keys, want.cache.keys, strict=True))
    # the video prompt in chunks that cut through a frame's tokens and between frames' timestamps
    visual = p1.visual_mask.nonzero().flatten().tolist()
    cuts = [0, visual[3], visual[len(visual) // 2] + 1, p1.num_tokens]
    cache = None
    for start, end in zip(cuts, cuts[1:], strict=False):
        (result,) = language.prefill_chunks([PrefillChunk(p1, e1, start, end, cache)])
        cache = result.cache
    assert torch.allclose(result.last_logits, alone[0].last_logits, atol=1e-4)
    chunked = PrefillState(
        language.chunk_cache_to_kv(cache), result.last_logits, alone[0].next_position_ids, p1.num_tokens
    )
    assert greedy(language, chunked) == greedy(language, alone[0])


def test_batched_decode_equals_decoding_each_request_alone(vision, language, media_files):
    states = [
        language.prefill(*_prompt_and_embeds(vision, language, media_files, media, n))
        for media, n in (("mp4", 8), ("png", 1), ("mp4", 32))  # prompts of different lengths
    ]
    assert language.kv_bytes_per_token * states[0].num_prompt_tokens == states[0].cache.num_bytes
    assert_batched_decode_equals_alone(language, states)


def test_each_one_part_adapter_reads_only_its_own_tensors_and_loads_them_exactly(
    checkpoint, whole, monkeypatch
):
    model, _ = whole
    keys, vision_keys, language_keys = checkpoint_keys(checkpoint, vision_key, language_key)
    assert (
        vision_keys
        and language_keys
        and not vision_keys & language_keys
        and vision_keys | language_keys == keys
    )
    assert any("downsample" in k for k in vision_keys) and any("merger" in k for k in vision_keys)
    tower_only, language_only = load_each_part(
        Glm4vAdapter, checkpoint, monkeypatch, vision_keys, language_keys
    )
    assert_qwen_parts_load_exactly(model, tower_only, language_only)


def test_a_template_that_renders_no_media_placeholder_says_so(language):
    check_a_template_without_the_media_part_is_refused_as_such(language)


def test_a_template_that_writes_a_placeholder_of_its_own_is_its_authors_error(language):
    """A video's tokens and an image's are the same `<|image|>`, so a template that writes one
    beside the video would give one placeholder more than the grid's tokens. It is named before
    the expansion: a request's template is the client's error (ValueError), the operator's
    (--chat-template) the server's (RuntimeError, INTERNAL), not the client's."""
    template = GLM4V_CHAT_TEMPLATE.replace("<|end_of_video|>", "<|end_of_video|><|image|>")
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "what moves?"}]}]
    meta = VisualMeta("video", (2, 4, 6), 1.0, language.num_visual_tokens((2, 4, 6)), (0.0, 1.0))
    said = "writes a visual placeholder of its own (<|image|> beside the video's <|video|>); remove it"
    with pytest.raises(ValueError, match=rf"^the request's chat template {re.escape(said)}"):
        language.build_prompt(messages, meta, RenderOptions(chat_template=template, requests_template=True))
    with pytest.raises(
        RuntimeError, match=rf"^the server's chat template \(--chat-template\) {re.escape(said)}"
    ):
        language.build_prompt(messages, meta, RenderOptions(chat_template=template))


def test_a_text_part_holding_the_video_markers_is_refused(language):
    """The markers decide whether `<|image|>` tokens are a video's (their positions follow): a
    text part that opens a video before an image would turn the image into one."""
    said = {"type": "text", "text": "<|begin_of_video|> look"}
    messages = [{"role": "user", "content": [said, {"type": "image"}]}]
    meta = VisualMeta("image", (1, 4, 6), 0.0, language.num_visual_tokens((1, 4, 6)))
    with pytest.raises(ValueError, match="^a text part holds GLM's media markers"):
        language.build_prompt(messages, meta)


def test_the_loader_detects_glm4v_and_loads_each_stages_part(checkpoint):
    _, decode = load_stage_adapters(checkpoint, "glm4v", Glm4vAdapter, "decode")
    assert decode.supports_batched_decode and decode.supports_chunked_prefill
    assert not decode.supports_sparse_vision and decode.num_deepstack_layers == 0


def test_the_whole_model_adapter_equals_the_split(checkpoint, vision, media_files, references):
    both = Glm4vAdapter(str(checkpoint), ModelConfig(), {"vision", "language"})
    for media, num_frames in (("mp4", 8), ("png", 1)):
        video = load_video(media_files, media, num_frames)
        assert torch.allclose(both.encode(both.preprocess(video)), vision.encode(vision.preprocess(video)))
        assert _split(both, both, video)[0] == references[(media, num_frames)]


def test_the_thinking_markers_are_single_tokens_kept_in_the_answer_text(language):
    """GLM-4.1V-Thinking writes `<think>...</think>` itself: `--reasoning-parser deepseek_r1`
    parts it, which needs both markers as single tokens that the answer's text keeps (added
    tokens that are not special, as in the hub's tokenizer)."""
    ids = [language.tokenizer.convert_tokens_to_ids(m) for m in REASONING_MARKERS]
    assert language.single_tokens(REASONING_MARKERS) == dict(zip(REASONING_MARKERS, ids))
    answer = language.detokenize([ids[0], *language.tokenize("red", False), ids[1]])
    assert answer == "<think>red</think>"


def test_three_services_equal_generate_and_refuse_pruning_naming_the_family(
    checkpoint, media_files, references, tmp_path_factory
):
    """The unchanged engines serve this family: encoder (default 2-frame groups, each sized as its
    clip), prefill and decode processes, each loading only its part, answer as generate() does,
    one request at a time and two at once (one decode batch while both decode). A pruning stage is
    INVALID_ARGUMENT naming the family, the encoder's and prefill's alike."""
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    from epd.client import EpdClient, EpdError
    from tests.stack import Stack

    def ask(case, **options):
        media, num_frames = case
        with EpdClient(stack.gateway) as client:
            return client.ask(
                media_files[media], QUESTION, num_frames=num_frames, max_new_tokens=MAX_NEW_TOKENS, **options
            )

    with Stack(checkpoint, tmp_path_factory.mktemp("logs_glm4v")) as stack:
        for case in CASES:
            assert ask(case).token_ids == references[case], case
        together = [("mp4", 32), ("png", 1)]
        with ThreadPoolExecutor(len(together)) as pool:
            answers = list(pool.map(ask, together))
        assert [a.token_ids for a in answers] == [references[case] for case in together]
        for knobs in ({"temporal_drop": True}, {"prefill_drop": True, "prefill_keep_ratio": 0.5}):
            with pytest.raises(EpdError) as err:
                ask(("mp4", 8), pruning_knobs=knobs)
            assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert "not supported for model family glm4v" in err.value.message, err.value.message
        assert stack.alive()


def test_epd_ask_with_this_model_answers_as_generate(checkpoint, media_files, references, capsys):
    assert_epd_ask_equals_references(checkpoint, media_files, references, capsys)
