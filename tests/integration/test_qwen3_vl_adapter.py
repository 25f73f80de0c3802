"""Qwen3-VL (dense) through `Qwen3VLAdapter` split in one process: the encoder's adapter (tower
only) -> `encode_features`, the language adapter -> `build_prompt` + `prefill` + a greedy
`decode_step` loop, equals `model.generate(do_sample=False)` token for token on a tiny checkpoint
of the real transformers classes, for 8 and 32 frames and an image. The prompt (timestamps per
temporal group included) is the processor's own, id for id; dropping the DeepStack features
changes the answer; the one-tensor paths refuse rather than drop DeepStack; batched decode equals
decoding alone; each one-part adapter reads only its own part's tensors. Frame groups told their
clip's frame count are the processor's patches of the whole clip."""

from __future__ import annotations

import pytest
import torch
from transformers.video_utils import VideoMetadata

from epd.model_runtime.adapter import PrefillChunk, VisualFeatures, VisualMeta
from epd.model_runtime.config import ModelConfig
from epd.model_runtime.hf_loading import language_key, vision_key
from epd.model_runtime.hf_reference import whole_model
from epd.model_runtime.qwen2_vl import Qwen2VLAdapter
from epd.model_runtime.qwen3_vl import Qwen3VLAdapter
from epd.model_runtime.tiny_model import TinyVLMSpec, build_checkpoint
from epd.resources import demo_model_dir
from tests.families import (
    CASES,
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
from tests.reference import decode_for_test


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """Built here, not in conftest's `tiny_models`: that fixture builds every family it lists for
    every session that uses it."""
    return build_checkpoint(tmp_path_factory.mktemp("qwen3_vl") / "m", TinyVLMSpec(family="qwen3_vl"))


@pytest.fixture(scope="module")
def vision(checkpoint):
    return Qwen3VLAdapter(str(checkpoint), ModelConfig(), {"vision"})  # the encoder's


@pytest.fixture(scope="module")
def language(checkpoint):
    return Qwen3VLAdapter(str(checkpoint), ModelConfig(), {"language"})  # prefill's and decode's


@pytest.fixture(scope="module")
def whole(checkpoint):
    return whole_model(checkpoint)


def _split(vision, language, video, drop_deepstack=False):
    """Encoder adapter -> language adapter, greedy; returns (tokens, the prefill's last logits)."""
    inputs = vision.preprocess(video)
    features = vision.encode_features(inputs)
    prompt = language.build_prompt(conversation(video), visual_meta(vision, inputs))
    if drop_deepstack:
        state = language.prefill(prompt, features.embeds, None)
    else:
        state = language.prefill_features(prompt, features)
    return greedy(language, state), state.last_logits


@pytest.fixture(scope="module")
def references(whole, media_files):
    return generate_references(whole, media_files, _processor_inputs)


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
    assert torch.equal(
        prompt.visual_mask.long() * (1 if video.is_image else 2), ref["mm_token_type_ids"][0].long()
    )
    expected = model._prepare_position_ids_for_generation(ref["input_ids"], dict(ref))  # what generate() uses
    assert torch.equal(prompt.position_ids, expected)
    if not video.is_image:  # one "<t seconds>" per temporal group, the decoded frames' real times
        text = processor.tokenizer.decode(prompt.input_ids[0])
        assert text.count(" seconds>") == inputs.grid_thw[0] == num_frames // 2
        fps = video.source_fps
        first = (round(video.timestamps_s[0] * fps) / fps + round(video.timestamps_s[1] * fps) / fps) / 2
        assert f"<{first:.1f} seconds>" in text and first > 0


@pytest.mark.parametrize("num_frames", [32, 5])
def test_frame_groups_sized_as_their_clip_are_the_processors_patches_of_the_whole_clip(
    vision, whole, tmp_path, num_frames
):
    """The encoder preprocesses 2-frame groups: told the clip's frame count, they are the rows of
    the processor's output on the whole clip, pixel for pixel (32 frames over size.longest_edge:
    shrunk; 5 frames: the 1-frame last group padded with its frame), with the clip's group times.
    Sized alone, the groups of the 32 frames keep larger frames."""
    from dataclasses import replace

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


def test_without_group_times_the_prompt_assumes_evenly_spaced_frames_from_zero(
    vision, language, whole, media_files
):
    """What prefill builds while the wire does not carry the times yet (VisualMeta without them):
    the processor's prompt for frames 0..T-1 at the sampled rate."""
    _, processor = whole
    video = load_video(media_files, "mp4", 8)
    inputs = vision.preprocess(video)
    meta = VisualMeta(
        inputs.modality, inputs.grid_thw, inputs.second_per_grid_t, vision.num_visual_tokens(inputs.grid_thw)
    )
    prompt = language.build_prompt(conversation(video), meta)
    metadata = VideoMetadata(total_num_frames=8, fps=video.sampled_fps, frames_indices=list(range(8)))
    assert torch.equal(prompt.input_ids, _processor_inputs(processor, video, metadata)["input_ids"])
    real_times = language.build_prompt(conversation(video), visual_meta(vision, inputs))
    assert not torch.equal(prompt.input_ids, real_times.input_ids), (
        "the clip starts after 0 s; the times must differ"
    )


@pytest.mark.parametrize("media,num_frames", CASES)
def test_in_process_split_equals_generate(vision, language, media_files, references, media, num_frames):
    tokens, _ = _split(vision, language, load_video(media_files, media, num_frames))
    assert tokens == references[(media, num_frames)]


def test_dropping_the_deepstack_features_changes_the_logits_and_the_answers(
    vision, language, media_files, references
):
    """Negative control: without the DeepStack features every case's first logits move, and the
    answers with them. A tiny random model's greedy answer to one input can survive that move (the
    8-frame clip's did once the test clip changed), so the answers are held as a whole: each case
    that keeps its answer must be outvoted by one that changes."""
    kept = 0
    for media, num_frames in CASES:
        video = load_video(media_files, media, num_frames)
        tokens, logits = _split(vision, language, video)
        dropped_tokens, dropped_logits = _split(vision, language, video, drop_deepstack=True)
        assert tokens == references[(media, num_frames)]
        assert not torch.allclose(logits, dropped_logits, atol=1e-3), (media, num_frames)
        kept += dropped_tokens == tokens
    assert kept < len(CASES) / 2, f"{kept} of {len(CASES)} answers unchanged without the DeepStack features"


def test_the_tower_yields_one_deepstack_feature_per_layer_aligned_with_the_embeds(vision, media_files):
    inputs = vision.preprocess(load_video(media_files, "mp4", 8))
    features = vision.encode_features(inputs)
    num_tokens = vision.num_visual_tokens(inputs.grid_thw)
    assert vision.num_deepstack_layers == len(vision.hf_config.vision_config.deepstack_visual_indexes) == 2
    assert features.embeds.shape == (num_tokens, vision.hidden_size)
    assert features.deepstack is not None and len(features.deepstack) == 2
    assert all(d.shape == features.embeds.shape for d in features.deepstack)


def test_the_one_tensor_paths_refuse_rather_than_drop_deepstack(vision, language, media_files):
    video = load_video(media_files, "mp4", 8)
    inputs = vision.preprocess(video)
    with pytest.raises(NotImplementedError, match="encode_features"):
        vision.encode(inputs)
    features = vision.encode_features(inputs)
    prompt = language.build_prompt(conversation(video), visual_meta(vision, inputs))
    with pytest.raises(ValueError, match="needs the tower's DeepStack features"):
        language.prefill_features(prompt, VisualFeatures(features.embeds))
    with pytest.raises(ValueError, match="1 DeepStack features; this model adds 2"):
        language.prefill(prompt, features.embeds, features.deepstack[:1])
    with pytest.raises(ValueError, match="row for row"):
        language.prefill(prompt, features.embeds, [d[:-1] for d in features.deepstack])
    with pytest.raises(ValueError, match="needs DeepStack features"):  # the default would drop them
        language.prefill_chunks([PrefillChunk(prompt, features.embeds, 0, prompt.num_tokens)])


def test_batched_decode_equals_decoding_each_request_alone(vision, language, media_files):
    states = []
    for media, num_frames in (("mp4", 8), ("png", 1)):  # prompts of different lengths
        video = load_video(media_files, media, num_frames)
        inputs = vision.preprocess(video)
        prompt = language.build_prompt(conversation(video), visual_meta(vision, inputs))
        states.append(language.prefill_features(prompt, vision.encode_features(inputs)))
    assert language.kv_bytes_per_token * states[0].num_prompt_tokens == states[0].cache.num_bytes
    assert_batched_decode_equals_alone(language, states)


def test_a_family_without_deepstack_refuses_deepstack_features():
    adapter = Qwen2VLAdapter(str(demo_model_dir()), ModelConfig(), set())  # prompts only, no weights
    embeds = torch.zeros(4, adapter.hidden_size)
    with pytest.raises(ValueError, match="Qwen2VLAdapter has no DeepStack layers"):
        adapter.prefill_features(None, VisualFeatures(embeds, [embeds]))  # type: ignore[arg-type]


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
    assert any("deepstack_merger_list" in k for k in vision_keys)

    tower_only, language_only = load_each_part(
        Qwen3VLAdapter, checkpoint, monkeypatch, vision_keys, language_keys
    )
    assert_qwen_parts_load_exactly(model, tower_only, language_only)


def test_a_template_that_renders_no_media_placeholder_says_so(language):
    check_a_template_without_the_media_part_is_refused_as_such(language)


def test_the_loader_detects_qwen3_vl_and_loads_each_stages_part(checkpoint):
    load_stage_adapters(checkpoint, "qwen3_vl", Qwen3VLAdapter, "prefill")


def test_epd_ask_with_this_model_answers_as_generate(checkpoint, media_files, references, capsys):
    assert_epd_ask_equals_references(checkpoint, media_files, references, capsys)
