"""InternVL through `InternVLAdapter` split in one process: the encoder's adapter (InternViT tower +
pixel-shuffle projector only) -> `encode`, the language adapter (Qwen3 or Qwen2 + lm_head) ->
`build_prompt` + `prefill` + a greedy `decode_step` loop, equals `model.generate(do_sample=False)`
token for token on a tiny checkpoint of the real transformers classes, for 8 and 32 frames and a
tiled image. The prompt (one `Frame{i}: <img>...</img>` group per frame) and pixels are the
processor's own, on epd's frames whatever the video processor's own sampling says; positions are
1-D; pixel shuffle and tiling change the answer when left out; frame groups encode independently
(what the encoder's `frames_per_group` relies on); chunked and batched prefill and batched decode
equal the plain paths; each one-part adapter reads only its own part's tensors; three services
answer as generate()."""

from __future__ import annotations

import pytest
import torch

from epd.model_runtime.adapter import VisionInputs
from epd.model_runtime.config import ModelConfig
from epd.model_runtime.hf_reference import whole_model
from epd.model_runtime.internvl import InternVLAdapter, language_key, vision_key
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

TOKENS_PER_FRAME = 16  # 112 px / patch 14 = 8 x 8 patches, pixel-shuffled to 4 x 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("internvl") / "m", TinyVLMSpec(family="internvl"))


@pytest.fixture(scope="module")
def vision(checkpoint):
    return InternVLAdapter(str(checkpoint), ModelConfig(), {"vision"})  # the encoder's


@pytest.fixture(scope="module")
def language(checkpoint):
    return InternVLAdapter(str(checkpoint), ModelConfig(), {"language"})  # prefill's and decode's


@pytest.fixture(scope="module")
def whole(checkpoint):
    return whole_model(checkpoint)


def _split(vision, language, video, embeds=None, inputs=None):
    """Encoder adapter -> language adapter, greedy; returns (tokens, the prefill's last logits)."""
    inputs = vision.preprocess(video) if inputs is None else inputs
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
    assert torch.equal(inputs.pixel_values, ref["pixel_values"])  # frames or tiles, [N, C, H, W]
    placeholders = prompt.input_ids[0] == model.config.image_token_id
    assert torch.equal(prompt.visual_mask, placeholders)
    tiles = inputs.grid_thw[0]
    assert inputs.grid_thw == (tiles, 8, 8)
    assert int(placeholders.sum()) == tiles * TOKENS_PER_FRAME == vision.num_visual_tokens(inputs.grid_thw)
    text = processor.tokenizer.decode(prompt.input_ids[0])
    if video.is_image:  # dynamic resolution: several tiles and the thumbnail, in one <img> group
        assert tiles > 2 and text.count("<img>") == 1
    else:  # one labelled group per frame, no tiling
        assert tiles == num_frames and text.count("<img>") == num_frames
        assert f"Frame{num_frames}: <img>" in text and f"Frame{num_frames + 1}:" not in text
    length = prompt.num_tokens
    assert prompt.position_ids.shape == (4, 1, length)
    assert all(torch.equal(row[0], torch.arange(length)) for row in prompt.position_ids)


def test_epds_frames_are_used_whatever_the_video_processors_own_sampling(checkpoint, vision, media_files):
    """A checkpoint whose video processor samples frames itself (`do_sample_frames`, `num_frames`)
    still gets epd's frames, all of them: epd chooses the frames, as vLLM's --media-io-kwargs do."""
    sampling = InternVLAdapter(str(checkpoint), ModelConfig(), {"vision"})
    vp = sampling.processor.video_processor
    vp.do_sample_frames, vp.num_frames = True, 4
    video = load_video(media_files, "mp4", 8)
    inputs = sampling.preprocess(video)
    assert inputs.grid_thw[0] == 8
    assert torch.equal(inputs.pixel_values, vision.preprocess(video).pixel_values)


@pytest.mark.parametrize("media,num_frames", CASES)
def test_in_process_split_equals_generate(vision, language, media_files, references, media, num_frames):
    tokens, _ = _split(vision, language, load_video(media_files, media, num_frames))
    assert tokens == references[(media, num_frames)]


@pytest.mark.parametrize("text_model", ["qwen2", "llama"])
def test_internvl3s_qwen2_and_llama_language_models_are_exact_too(tmp_path_factory, media_files, text_model):
    """InternVL3's checkpoints carry Qwen2, its 9B InternLM3 as Llama (InternVL3.5's Qwen3): the
    language part is whatever the text config names, built as InternVLModel builds it."""
    checkpoint = build_checkpoint(
        tmp_path_factory.mktemp(f"internvl_{text_model}") / "m",
        TinyVLMSpec(family="internvl", internvl_text_model=text_model),
    )
    vision = InternVLAdapter(str(checkpoint), ModelConfig(), {"vision"})
    language = InternVLAdapter(str(checkpoint), ModelConfig(), {"language"})
    assert language.hf_config.text_config.model_type == text_model
    references = generate_references(whole_model(checkpoint), media_files, own_frames_inputs)
    for media, num_frames in (("mp4", 8), ("png", 1)):
        assert_reference_varies(references[(media, num_frames)])
        tokens, _ = _split(vision, language, load_video(media_files, media, num_frames))
        assert tokens == references[(media, num_frames)], media


def test_next_positions_cross_as_four_equal_ints(vision, language, media_files):
    video = load_video(media_files, "mp4", 8)
    inputs = vision.preprocess(video)
    prompt = language.build_prompt(conversation(video), visual_meta(vision, inputs))
    state = language.prefill(prompt, vision.encode(inputs))
    assert state.next_position_ids.tolist() == [prompt.num_tokens] * 4


def _unshuffled_embeds(vision, inputs) -> torch.Tensor:
    """Tower -> CLS dropped -> each run of 4 patches IN A ROW concatenated (not the model's 2 x 2
    pixel shuffle) -> projector: the same count, another grouping of the patches."""
    part = vision.visual
    with torch.inference_mode():
        hidden = part.vision_tower(pixel_values=inputs.pixel_values).last_hidden_state[:, 1:]
        n, patches, dim = hidden.shape
        return part.multi_modal_projector(hidden.reshape(n, patches // 4, dim * 4)).flatten(0, 1)


def test_negative_controls_change_the_answer(vision, language, media_files, references):
    video = load_video(media_files, "mp4", 8)
    inputs = vision.preprocess(video)
    tokens, logits = _split(vision, language, video)
    assert tokens == references[("mp4", 8)]

    other = _unshuffled_embeds(vision, inputs)
    assert other.shape == vision.encode(inputs).shape  # same count, another grouping
    other_tokens, other_logits = _split(vision, language, video, embeds=other)
    assert not torch.allclose(logits, other_logits, atol=1e-3) and other_tokens != tokens

    # the image without its tiles (the thumbnail alone): another prompt and answer than generate()'s
    image = load_video(media_files, "png", 1)
    thumbnail = vision.processor.image_processor(
        images=[image.frames[0]], crop_to_patches=False, return_tensors="pt"
    )
    alone = VisionInputs("image", thumbnail["pixel_values"], (1, 8, 8), 0.0)
    assert _split(vision, language, image, inputs=alone)[0] != references[("png", 1)]


def test_frame_groups_encode_independently_and_encode_batch_equals_encode(vision, media_files):
    assert_frame_groups_encode_as_the_whole(vision, media_files)


def test_chunked_and_batched_prefill_equal_prefill_alone(vision, language, media_files):
    # the video prompt's chunks cut through its visual tokens and between frames
    assert_chunked_and_batched_prefill_equal_alone(vision, language, media_files, last_cut=-5)


def test_batched_decode_equals_decoding_each_request_alone(vision, language, media_files):
    assert_batched_decode_of_three_prompts_equals_alone(vision, language, media_files)


def test_each_one_part_adapter_reads_only_its_own_tensors_and_loads_them_exactly(
    checkpoint, whole, monkeypatch
):
    model, _ = whole
    keys, vision_keys, language_keys = checkpoint_keys(checkpoint, vision_key, language_key)
    assert not vision_keys & language_keys and vision_keys | language_keys == keys
    assert all(k.startswith(("vision_tower.", "multi_modal_projector.")) for k in vision_keys)
    assert all(k.startswith("language_model.") for k in language_keys)

    tower_only, language_only = load_each_part(
        InternVLAdapter, checkpoint, monkeypatch, vision_keys, language_keys
    )
    expected = {vision_key(k): v for k, v in model.state_dict().items() if vision_key(k)}
    assert_same_state(tower_only.visual.state_dict(), expected)
    expected = {k: v for k, v in model.state_dict().items() if language_key(k)}
    assert_same_state(language_only.model.state_dict(), expected)


def test_module_names_map_to_the_same_parts():
    """A whole model's state_dict names ("model.*", "lm_head.*") and the saved layout's
    ("language_model.model.*", "language_model.lm_head.*") name the same tensors."""
    assert (
        vision_key("model.vision_tower.encoder.layer.0.lambda_1") == "vision_tower.encoder.layer.0.lambda_1"
    )
    assert vision_key("multi_modal_projector.linear_1.bias") == "multi_modal_projector.linear_1.bias"
    assert language_key("model.language_model.norm.weight") == "model.language_model.norm.weight"
    assert language_key("language_model.model.layers.0.self_attn.q_norm.weight") == (
        "model.language_model.layers.0.self_attn.q_norm.weight"
    )
    assert language_key("language_model.lm_head.weight") == language_key("lm_head.weight") == "lm_head.weight"
    assert language_key("vision_tower.embeddings.cls_token") is None
    assert vision_key("language_model.model.norm.weight") is None


def test_a_processor_whose_tokens_per_tile_disagree_with_the_model_is_refused_at_load(checkpoint, tmp_path):
    """The prompt would hold another count of placeholders than the tower makes tokens: refused
    when the checkpoint loads (`epd serve` says so before serving), not at the first request."""
    import json
    import shutil

    from epd.model_runtime.loader import ModelLoadError, load_adapter

    copy = shutil.copytree(checkpoint, tmp_path / "m")
    config = json.loads((copy / "processor_config.json").read_text())
    config["image_seq_length"] = TOKENS_PER_FRAME * 4
    (copy / "processor_config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="writes 64 placeholders per tile but the model makes 16"):
        load_adapter(ModelConfig(model=str(copy)), "prefill")


def test_a_template_that_renders_no_media_placeholder_says_so(language):
    check_a_template_without_the_media_part_is_refused_as_such(language)


def test_the_loader_detects_internvl_and_loads_each_stages_part(checkpoint):
    _, decode = load_stage_adapters(checkpoint, "internvl", InternVLAdapter, "decode")
    assert decode.supports_batched_decode and not decode.supports_sparse_vision


def test_the_whole_model_adapter_equals_the_split(checkpoint, vision, media_files, references):
    both = InternVLAdapter(str(checkpoint), ModelConfig(), {"vision", "language"})
    for media, num_frames in (("mp4", 8), ("png", 1)):
        video = load_video(media_files, media, num_frames)
        assert torch.allclose(both.encode(both.preprocess(video)), vision.encode(vision.preprocess(video)))
        assert _split(both, both, video)[0] == references[(media, num_frames)]


def test_layerwise_pruning_is_refused_by_name_and_the_sizes_are_described(language):
    assert_layerwise_pruning_refused_and_sizes_described(language)


def test_three_services_equal_generate(checkpoint, media_files, references, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs_internvl")
    assert_three_services_equal_references(checkpoint, media_files, references, logs, TOKENS_PER_FRAME)


def test_epd_ask_with_this_model_answers_as_generate(checkpoint, media_files, references, capsys):
    assert_epd_ask_equals_references(checkpoint, media_files, references, capsys)
