"""The encoder keeps a request's frames at the size the model's processor gives them, not at the
source size, and that changes no pixel the tower sees (EncoderConfig.frames_at_model_size,
VLMAdapter.frame_resizer): Qwen2-VL's processor shrinks a 320x180 frame to 140x84 here (the tiny
checkpoints' 112x112 pixel bound), so the decoder stores 20% of the bytes; LLaVA-OneVision's
resizes every frame to one fixed size."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from epd.encoder_svc.config import EncoderConfig
from epd.encoder_svc.engine import EncoderEngine
from epd.encoder_svc.token_cache import TokenCacheConfig
from epd.gateway.embedded import build_embedded_pipeline
from epd.model_runtime.config import ModelConfig
from epd.model_runtime.loader import load_adapter
from epd.stages.contracts import MediaInput
from epd.video.types import DecodedVideo, SamplingOptions
from tests.embedded import ask_tokens
from tests.media import make_video
from tests.reference import decode_for_test, question_message, reference_tokens, whole_model

QUESTION = "what colour is the moving square?"
NO_CACHE = TokenCacheConfig(memory_budget_bytes=0)


@pytest.fixture(scope="module")
def wide_clip(tmp_path_factory):
    """320x180 (16:9), 3 s at 10 fps: the processor resizes its frames to 140x84."""
    return make_video(tmp_path_factory.mktemp("wide") / "wide.mp4", size=(320, 180), seconds=3.0, gop=10)


@pytest.fixture(scope="module")
def models(tiny_models, tmp_path_factory):
    """The families with a resizer: Qwen2-VL, Qwen2.5-VL (per-frame bounds) and LLaVA-OneVision
    (one fixed size)."""
    from epd.model_runtime.tiny_model import TinyVLMSpec, build_checkpoint

    llava = build_checkpoint(tmp_path_factory.mktemp("llava_onevision") / "m", TinyVLMSpec(family="llava_onevision"))
    return {**tiny_models, "llava_onevision": llava}


def _processor_pixels(adapter, frames: np.ndarray) -> dict:
    """What the family's `preprocess` gets from its video processor for `frames` [T, H, W, 3]."""
    vp = adapter.processor.video_processor
    kwargs = {} if adapter.family == "llava_onevision" else {"cap_pixels_per_frame": False}
    return dict(vp(videos=[frames], do_sample_frames=False, return_tensors="pt", **kwargs))


def _target_size(adapter, pixels: dict) -> tuple[int, int]:
    if adapter.family == "llava_onevision":
        return adapter.processor.video_processor.size.height, adapter.processor.video_processor.size.width
    _, grid_h, grid_w = pixels["video_grid_thw"][0].tolist()
    return grid_h * 14, grid_w * 14  # patch 14


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "llava_onevision"])
def test_resized_frames_give_the_processors_own_pixels(models, family):
    """Bit for bit: the processor on frames the resizer made, one at a time, equals the processor
    on the frames as decoded, for shrunk, enlarged (under min_pixels), odd and unchanged sizes."""
    adapter = load_adapter(ModelConfig(model=str(models[family])), "encoder")
    resize = adapter.frame_resizer()
    assert resize is not None
    rng = np.random.default_rng(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the tower's threads split the processor's resize across frames
    try:
        for height, width in [(180, 320), (1080, 1920), (61, 97), (30, 40), (84, 112)]:
            frames = rng.integers(0, 256, size=(4, height, width, 3), dtype=np.uint8)  # [T, H, W, 3]
            resized = np.stack([resize(f) for f in frames])  # [T, h, w, 3]
            want = _processor_pixels(adapter, frames)
            got = _processor_pixels(adapter, resized)
            assert want.keys() == got.keys()
            for key in want:
                assert torch.equal(got[key], want[key]), (key, height, width)
            assert resized.shape[1:3] == _target_size(adapter, want)
    finally:
        torch.set_num_threads(threads)


def test_the_encoder_holds_frames_at_the_model_size_with_the_same_embeddings(tiny_models, wide_clip):
    adapter = load_adapter(ModelConfig(model=str(tiny_models["qwen2_vl"])), "encoder")
    seen: list[tuple[int, ...]] = []
    preprocess = adapter.preprocess

    def spy(video: DecodedVideo, clip_num_frames: int | None = None):
        seen.append(video.frames.shape)  # [g, H, W, 3]: what the decoder handed over
        return preprocess(video, clip_num_frames)

    adapter.preprocess = spy  # type: ignore[method-assign]
    data = wide_clip.read_bytes()
    sampling = SamplingOptions(num_frames=16)
    small = EncoderEngine(EncoderConfig(cache=NO_CACHE), adapter)
    full = EncoderEngine(EncoderConfig(cache=NO_CACHE, frames_at_model_size=False), adapter)
    try:
        got = small.encode(MediaInput(data, ""), sampling, lambda event: None)
        assert {shape[1:] for shape in seen} == {(84, 140, 3)}
        seen.clear()
        want = full.encode(MediaInput(data, ""), sampling, lambda event: None)
        assert {shape[1:] for shape in seen} == {(180, 320, 3)}
    finally:
        small.close()
        full.close()
    assert got.meta == want.meta
    assert torch.equal(got.embeds, want.embeds)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "llava_onevision"])
def test_answer_about_a_shrunk_video_equals_generate(models, wide_clip, family):
    """generate() gets the frames as decoded (320x180) and its processor resizes them; the
    pipeline's decoder resized them already."""
    video = decode_for_test(wide_clip, 8)  # [8, 180, 320, 3]
    if family == "llava_onevision":  # its processor takes no Qwen video kwargs (tests/integration/test_llava_onevision_adapter.py)
        model, processor = whole_model(models[family])
        text = processor.apply_chat_template(question_message(video, QUESTION), add_generation_prompt=True, tokenize=False)
        inputs = processor(text=[text], videos=[video.frames], return_tensors="pt", videos_kwargs={"do_sample_frames": False})
        with torch.inference_mode():
            generated = model.generate(**inputs, do_sample=False, max_new_tokens=12)
        want = generated[0, inputs["input_ids"].shape[1] :].tolist()
    else:
        want = reference_tokens(models[family], video, QUESTION, 12)
    with build_embedded_pipeline(ModelConfig(model=str(models[family]))) as pipeline:
        got = asyncio.run(ask_tokens(pipeline, wide_clip, QUESTION, 8, 12))
    assert got == want
