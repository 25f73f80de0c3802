"""The encoder keeps a request's frames at the size the model's processor gives them, not at the
source size, and that changes no pixel the tower sees (EncoderConfig.frames_at_model_size,
VLMAdapter.frame_resizer): Qwen2-VL's processor shrinks a 320x180 frame to 140x84 here (the tiny
checkpoints' 112x112 pixel bound), so the decoder stores 1.6% of the bytes."""

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
from tests.reference import decode_for_test, reference_tokens

QUESTION = "what colour is the moving square?"
NO_CACHE = TokenCacheConfig(memory_budget_bytes=0)


@pytest.fixture(scope="module")
def wide_clip(tmp_path_factory):
    """320x180 (16:9), 3 s at 10 fps: the processor resizes its frames to 140x84."""
    return make_video(tmp_path_factory.mktemp("wide") / "wide.mp4", size=(320, 180), seconds=3.0, gop=10)


def _processor_pixels(adapter, frames: np.ndarray):
    out = adapter.processor.video_processor(
        videos=[frames], do_sample_frames=False, cap_pixels_per_frame=False, return_tensors="pt"
    )
    return out["pixel_values_videos"], out["video_grid_thw"]


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_resized_frames_give_the_processors_own_pixels(tiny_models, family):
    """Bit for bit: the processor on frames the resizer made, one at a time, equals the processor
    on the frames as decoded, for shrunk, enlarged (under min_pixels), odd and unchanged sizes."""
    adapter = load_adapter(ModelConfig(model=str(tiny_models[family])), "encoder")
    resize = adapter.frame_resizer()
    assert resize is not None
    rng = np.random.default_rng(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the tower's threads split the processor's resize across frames
    try:
        for height, width in [(180, 320), (1080, 1920), (61, 97), (30, 40), (84, 112)]:
            frames = rng.integers(0, 256, size=(4, height, width, 3), dtype=np.uint8)  # [T, H, W, 3]
            resized = np.stack([resize(f) for f in frames])  # [T, h, w, 3]
            want_pixels, want_grid = _processor_pixels(adapter, frames)
            got_pixels, got_grid = _processor_pixels(adapter, resized)
            assert torch.equal(got_grid, want_grid)
            assert torch.equal(got_pixels, want_pixels), (height, width)
            _, grid_h, grid_w = want_grid[0].tolist()
            assert resized.shape[1:3] == (grid_h * 14, grid_w * 14)  # patch 14: the processor's target
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


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_answer_about_a_shrunk_video_equals_generate(tiny_models, wide_clip, family):
    """generate() gets the frames as decoded (320x180) and its processor resizes them; the
    pipeline's decoder resized them already."""
    want = reference_tokens(tiny_models[family], decode_for_test(wide_clip, 8), QUESTION, 12)
    with build_embedded_pipeline(ModelConfig(model=str(tiny_models[family]))) as pipeline:
        got = asyncio.run(ask_tokens(pipeline, wide_clip, QUESTION, 8, 12))
    assert got == want
