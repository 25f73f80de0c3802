"""LLaVA-OneVision through `LlavaOnevisionAdapter` split in one process: the encoder's adapter
(SigLIP tower + projector + image_newline only) -> `encode`, the language adapter (Qwen2 + lm_head
+ image_newline) -> `build_prompt` + `prefill` + a greedy `decode_step` loop, equals
`model.generate(do_sample=False)` token for token on a tiny checkpoint of the real transformers
classes, for 8 and 32 frames and an (anyres-tiled) image. The prompt and pixels are the
processor's own; positions are 1-D (all four interface rows equal); skipping the video pooling's
bilinear interpolation or the video's closing newline changes the answer; frame groups encode
independently (what the encoder's `frames_per_group` relies on); chunked and batched prefill and
batched decode equal the plain paths; each one-part adapter reads only its own part's tensors."""

from __future__ import annotations

import pytest
import torch

from epd.model_runtime.config import ModelConfig
from epd.model_runtime.hf_reference import whole_model
from epd.model_runtime.llava_onevision import LlavaOnevisionAdapter, language_key, vision_key
from epd.model_runtime.tiny_model import TinyVLMSpec, build_checkpoint
from tests.families import (
    CASES,
    assert_batched_decode_of_three_prompts_equals_alone,
    assert_chunked_and_batched_prefill_equal_alone,
    assert_epd_ask_equals_references,
    assert_frame_groups_encode_as_the_whole,
    assert_layerwise_pruning_refused_and_sizes_described,
    assert_reference_varies,
    assert_same_state,
    assert_three_services_equal_references,
    check_a_template_without_the_media_part_is_refused_as_such,
    checkpoint_keys,
    conversation,
    generate_references,
    greedy,
    load_each_part,
    load_stage_adapters,
    load_video,
    own_frames_inputs,
    visual_meta,
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_checkpoint(
        tmp_path_factory.mktemp("llava_onevision") / "m", TinyVLMSpec(family="llava_onevision")
    )


@pytest.fixture(scope="module")
def vision(checkpoint):
    return LlavaOnevisionAdapter(str(checkpoint), ModelConfig(), {"vision"})  # the encoder's


@pytest.fixture(scope="module")
def language(checkpoint):
    return LlavaOnevisionAdapter(str(checkpoint), ModelConfig(), {"language"})  # prefill's and decode's


@pytest.fixture(scope="module")
def whole(checkpoint):
    return whole_model(checkpoint)


def _split(vision, language, video, embeds=None):
    """Encoder adapter -> language adapter, greedy; returns (tokens, the prefill's last logits)."""
    inputs = vision.preprocess(video)
    if embeds is None:
        embeds = vision.encode(inputs)
    prompt = language.build_prompt(conversation(video), visual_meta(vision, inputs))
    state = language.prefill(prompt, embeds)
    return greedy(language, state), state.last_logits


@pytest.fixture(scope="module")
def references(whole, media_files):
    return generate_references(whole, media_files, own_frames_inputs)


@pytest.mark.parametrize("media,num_frames", CASES)
def test_reference_output_varies(references, media, num_frames):
    assert_reference_varies(references[(media, num_frames)])


@pytest.mark.parametrize("media,num_frames", CASES)
def test_prompt_pixels_and_positions_are_the_processors_and_1d(
    vision, language, whole, media_files, media, num_frames
):
    model, processor = whole
    video = load_video(media_files, media, num_frames)
    ref = own_frames_inputs(processor, video)
    inputs = vision.preprocess(video)
    prompt = language.build_prompt(conversation(video), visual_meta(vision, inputs))

    assert torch.equal(prompt.input_ids, ref["input_ids"])
    if video.is_image:  # anyres: the base crop and at least one tile; grid = the image's pixels
        assert torch.equal(inputs.pixel_values, ref["pixel_values"][0]) and inputs.pixel_values.shape[0] > 2
        assert inputs.grid_thw == (1, *ref["image_sizes"][0].tolist())
        placeholders = prompt.input_ids[0] == model.config.image_token_id
        assert torch.equal(prompt.visual_mask, placeholders)
    else:  # one pooled grid per frame, then ONE closing newline placeholder outside the mask
        assert torch.equal(inputs.pixel_values, ref["pixel_values_videos"][0])
        assert inputs.grid_thw == (num_frames, 5, 5)
        placeholders = prompt.input_ids[0] == model.config.video_token_id
        assert int(placeholders.sum()) == num_frames * 3 * 3 + 1
        assert int(prompt.visual_mask.sum()) == num_frames * 9 == vision.num_visual_tokens(inputs.grid_thw)
        closing = placeholders & ~prompt.visual_mask
        assert closing.nonzero().flatten().tolist() == [int(placeholders.nonzero()[-1])]
    length = prompt.num_tokens
    assert prompt.position_ids.shape == (4, 1, length)
    assert all(torch.equal(row[0], torch.arange(length)) for row in prompt.position_ids)


@pytest.mark.parametrize("media,num_frames", CASES)
def test_in_process_split_equals_generate(vision, language, media_files, references, media, num_frames):
    tokens, _ = _split(vision, language, load_video(media_files, media, num_frames))
    assert tokens == references[(media, num_frames)]


def test_next_positions_cross_as_four_equal_ints(vision, language, media_files):
    video = load_video(media_files, "mp4", 8)
    inputs = vision.preprocess(video)
    prompt = language.build_prompt(conversation(video), visual_meta(vision, inputs))
    state = language.prefill(prompt, vision.encode(inputs))
    assert state.next_position_ids.tolist() == [prompt.num_tokens] * 4


def _unpooled_video_embeds(vision, inputs) -> torch.Tensor:
    """Tower -> projector -> 2x2 AVERAGE pooling (not the model's bilinear interpolation)."""
    part = vision.visual
    with torch.inference_mode():
        hidden = part.vision_tower(inputs.pixel_values, output_hidden_states=True).hidden_states[-1]
        feats = part.multi_modal_projector(hidden)  # [T, p*p, hidden]
        t, n, d = feats.shape
        side = int(n**0.5)
        grid = feats.view(t, side, side, d).permute(0, 3, 1, 2)
        pooled = torch.nn.functional.avg_pool2d(grid, 2, ceil_mode=True)
        return pooled.permute(0, 2, 3, 1).reshape(-1, d)


def test_negative_controls_change_the_answer(vision, language, media_files, references, monkeypatch):
    video = load_video(media_files, "mp4", 8)
    inputs = vision.preprocess(video)
    tokens, logits = _split(vision, language, video)
    assert tokens == references[("mp4", 8)]

    other = _unpooled_video_embeds(vision, inputs)
    assert other.shape == vision.encode(inputs).shape  # same count, another pooling
    pooled_tokens, pooled_logits = _split(vision, language, video, embeds=other)
    assert not torch.allclose(logits, pooled_logits, atol=1e-3) and pooled_tokens != tokens

    # The video's closing placeholder left as its own token's embedding, not image_newline
    with torch.inference_mode():
        own = language.embed(torch.tensor([language.video_token_id]))[0]
    monkeypatch.setattr(language, "image_newline", own)
    no_newline_tokens, no_newline_logits = _split(vision, language, video)
    assert not torch.allclose(logits, no_newline_logits, atol=1e-3) and no_newline_tokens != tokens


def test_frame_groups_encode_independently_and_encode_batch_equals_encode(vision, media_files):
    assert_frame_groups_encode_as_the_whole(vision, media_files)


def test_chunked_and_batched_prefill_equal_prefill_alone(vision, language, media_files):
    # the video prompt's chunks cut through its visual tokens and its closing newline
    assert_chunked_and_batched_prefill_equal_alone(vision, language, media_files, last_cut=1)


def test_batched_decode_equals_decoding_each_request_alone(vision, language, media_files):
    assert_batched_decode_of_three_prompts_equals_alone(vision, language, media_files)


def test_each_one_part_adapter_reads_only_its_own_tensors_and_loads_them_exactly(
    checkpoint, whole, monkeypatch
):
    model, _ = whole
    keys, vision_keys, language_keys = checkpoint_keys(checkpoint, vision_key, language_key)
    # only the 1 x hidden image_newline is read by both (the encoder packs image rows with it,
    # prefill closes a video with it)
    assert vision_keys & language_keys == {"image_newline"}
    assert vision_keys | language_keys == keys
    assert all(k.startswith(("vision_tower.", "multi_modal_projector.")) for k in vision_keys - language_keys)
    assert all(k.startswith("language_model.") for k in language_keys - vision_keys)

    tower_only, language_only = load_each_part(
        LlavaOnevisionAdapter, checkpoint, monkeypatch, vision_keys, language_keys
    )
    expected = {vision_key(k): v for k, v in model.state_dict().items() if vision_key(k)}
    assert_same_state(tower_only.visual.state_dict(), expected)
    expected = {k: v for k, v in model.state_dict().items() if language_key(k) and k != "model.image_newline"}
    assert_same_state(language_only.model.state_dict(), expected)
    assert torch.equal(language_only.image_newline, model.model.image_newline)


def test_hub_key_layout_maps_to_the_same_parts():
    """llava-hf's checkpoints (transformers 4) nest SigLIP under "vision_model."; module names
    (a whole model's state_dict) carry "model."."""
    assert vision_key("vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight") == (
        "vision_tower.encoder.layers.0.mlp.fc1.weight"
    )
    assert vision_key("model.vision_tower.encoder.layers.0.mlp.fc1.weight") == (
        "vision_tower.encoder.layers.0.mlp.fc1.weight"
    )
    assert language_key("model.language_model.norm.weight") == "model.language_model.norm.weight"
    assert vision_key("multi_modal_projector.linear_1.bias") == "multi_modal_projector.linear_1.bias"
    assert vision_key("image_newline") == language_key("image_newline") == "image_newline"
    assert language_key("language_model.model.layers.0.self_attn.q_proj.weight") == (
        "model.language_model.layers.0.self_attn.q_proj.weight"
    )
    assert language_key("language_model.lm_head.weight") == "lm_head.weight"
    assert language_key("vision_tower.vision_model.post_layernorm.weight") is None
    assert vision_key("language_model.model.norm.weight") is None


def test_a_template_that_renders_no_media_placeholder_says_so(language):
    check_a_template_without_the_media_part_is_refused_as_such(language)


def test_the_loader_detects_llava_onevision_and_loads_each_stages_part(checkpoint):
    _, decode = load_stage_adapters(checkpoint, "llava_onevision", LlavaOnevisionAdapter, "decode")
    assert decode.supports_batched_decode and not decode.supports_sparse_vision


def test_the_whole_model_adapter_equals_the_split(checkpoint, vision, media_files, references):
    both = LlavaOnevisionAdapter(str(checkpoint), ModelConfig(), {"vision", "language"})
    for media, num_frames in (("mp4", 8), ("png", 1)):
        video = load_video(media_files, media, num_frames)
        assert torch.allclose(both.encode(both.preprocess(video)), vision.encode(vision.preprocess(video)))
        assert _split(both, both, video)[0] == references[(media, num_frames)]


def test_layerwise_pruning_is_refused_by_name_and_the_sizes_are_described(language):
    assert_layerwise_pruning_refused_and_sizes_described(language)


def test_three_services_equal_generate(checkpoint, media_files, references, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs_llava_onevision")
    assert_three_services_equal_references(checkpoint, media_files, references, logs, 9)


def test_epd_ask_with_this_model_answers_as_generate(checkpoint, media_files, references, capsys):
    assert_epd_ask_equals_references(checkpoint, media_files, references, capsys)
