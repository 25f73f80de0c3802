"""The encoder keeps a request's frames at the size the model's processor gives them, not at the
source size, and that changes no pixel the tower sees (EncoderConfig.frames_at_model_size,
VLMAdapter.frame_resizer): Qwen2-VL's processor shrinks a 320x180 frame to 140x84 here (the tiny
checkpoints' 112x112 pixel bound), so the decoder stores 20% of the bytes; LLaVA-OneVision's
resizes every frame to one fixed size; Qwen3-VL's and Qwen3.5's size frames by the whole clip's
t x h x w (the tiny checkpoints' 1 Mpx bound: 23 frames of 320x180 are 160x256, 24 are 128x256),
so each request's frames are resized for its own frame count."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from epd.encoder_svc.config import EncoderConfig
from epd.encoder_svc.engine import EncoderEngine
from epd.encoder_svc.token_cache import TokenCacheConfig
from epd.gateway.embedded import build_embedded_pipeline
from epd.model_runtime.config import ModelConfig
from epd.model_runtime.hf_reference import whole_model
from epd.model_runtime.loader import load_adapter
from epd.stages.contracts import MediaInput
from epd.video.types import DecodedVideo, SamplingOptions
from tests.embedded import ask_tokens
from tests.families import assert_pipeline_answers_as_generate, build_qwen3_5_checkpoint
from tests.media import make_video
from tests.reference import decode_for_test, reference_tokens

QUESTION = "what colour is the moving square?"
NO_CACHE = TokenCacheConfig(memory_budget_bytes=0)


@pytest.fixture(scope="module")
def wide_clip(tmp_path_factory):
    """320x180 (16:9), 3 s at 10 fps: the processor resizes its frames to 140x84."""
    return make_video(tmp_path_factory.mktemp("wide") / "wide.mp4", size=(320, 180), seconds=3.0, gop=10)


QWEN3_FAMILIES = ["qwen3_vl", "qwen3_5"]
FIXED_SIZE_FAMILIES = ["llava_onevision", "internvl"]  # every frame resized to one square


@pytest.fixture(scope="module")
def models(tiny_models, tmp_path_factory):
    """The families with a resizer: Qwen2-VL, Qwen2.5-VL (per-frame bounds), LLaVA-OneVision and
    InternVL (one fixed size), Qwen3-VL and Qwen3.5 (the whole clip's bound)."""
    from epd.model_runtime.tiny_model import TinyVLMSpec, build_checkpoint

    def tiny(family: str):
        return build_checkpoint(tmp_path_factory.mktemp(family) / "m", TinyVLMSpec(family=family))

    return {
        **tiny_models,
        "llava_onevision": tiny("llava_onevision"),
        "internvl": tiny("internvl"),
        "qwen3_vl": tiny("qwen3_vl"),
        "qwen3_5": build_qwen3_5_checkpoint(tmp_path_factory.mktemp("qwen3_5") / "m"),
    }


def _processor_pixels(adapter, frames: np.ndarray) -> dict:
    """What the family's `preprocess` gets from its video processor for `frames` [T, H, W, 3]."""
    vp = adapter.processor.video_processor
    kwargs = {} if adapter.family in FIXED_SIZE_FAMILIES else {"cap_pixels_per_frame": False}
    return dict(vp(videos=[frames], do_sample_frames=False, return_tensors="pt", **kwargs))


def _target_size(adapter, pixels: dict) -> tuple[int, int]:
    if adapter.family in FIXED_SIZE_FAMILIES:
        return adapter.processor.video_processor.size.height, adapter.processor.video_processor.size.width
    _, grid_h, grid_w = pixels["video_grid_thw"][0].tolist()
    return grid_h * 14, grid_w * 14  # patch 14


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", *FIXED_SIZE_FAMILIES])
def test_resized_frames_give_the_processors_own_pixels(models, family):
    """Bit for bit: the processor on frames the resizer made, one at a time, equals the processor
    on the frames as decoded, for shrunk, enlarged (under min_pixels), odd and unchanged sizes."""
    adapter = load_adapter(ModelConfig(model=str(models[family])), "encoder")
    resize = adapter.frame_resizer(4)
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


@pytest.mark.parametrize("family", QWEN3_FAMILIES)
def test_qwen3_frames_resized_one_at_a_time_are_the_processors_pixels_of_the_whole_clip(models, family):
    """Bit for bit: `preprocess` (group by group, as the encoder runs it) of frames the resizer
    made one at a time for the clip's frame count equals transformers' processor on the whole
    clip as decoded (generate()'s input), under the tiny processor's t x h x w bound (enlarged to
    multiples of 32), over it (shrunk), at odd counts; 3 frames of 1080p, whose smart_resize
    output is not its own fixed point (416x768, then 416x800), stay as decoded."""
    adapter = load_adapter(ModelConfig(model=str(models[family])), "encoder")
    vp = adapter.processor.video_processor
    assert adapter.frame_resizer(1) is None  # `preprocess` refuses a 1-frame clip with its own message
    rng = np.random.default_rng(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the tower's threads split the processor's resize across frames
    try:
        for (height, width), num_frames, held in [
            ((180, 320), 3, (192, 320)),
            ((180, 320), 8, (192, 320)),
            ((180, 320), 31, (128, 224)),
            ((1080, 1920), 9, (256, 448)),
            ((1080, 1920), 3, (1080, 1920)),
            ((61, 97), 5, (64, 96)),
            ((30, 40), 2, (64, 96)),
        ]:
            frames = rng.integers(0, 256, size=(num_frames, height, width, 3), dtype=np.uint8)  # [T, H, W, 3]
            resize = adapter.frame_resizer(num_frames)
            assert resize is not None
            resized = np.stack([resize(f) for f in frames])  # [T, h, w, 3]
            assert resized.shape[1:3] == held, (height, width, num_frames)
            times = [i / 2.0 for i in range(num_frames)]
            groups = [
                adapter.preprocess(
                    DecodedVideo(resized[i : i + 2], times[i : i + 2], 2.0, num_frames / 2, 2.0),
                    clip_num_frames=num_frames,
                )
                for i in range(0, num_frames, 2)
            ]
            want = vp(
                videos=[frames], do_sample_frames=False, cap_pixels_per_frame=False, return_tensors="pt"
            )
            assert torch.equal(torch.cat([g.pixel_values for g in groups]), want["pixel_values_videos"])
            _, grid_h, grid_w = want["video_grid_thw"][0].tolist()
            assert {g.grid_thw[1:] for g in groups} == {(grid_h, grid_w)}
    finally:
        torch.set_num_threads(threads)


def _spy_on_preprocess(adapter) -> list[tuple[int | None, tuple[int, ...]]]:
    """Records (clip_num_frames, frames.shape) of every group the encoder preprocesses."""
    seen: list[tuple[int | None, tuple[int, ...]]] = []
    preprocess = adapter.preprocess

    def spy(video: DecodedVideo, clip_num_frames: int | None = None):
        seen.append((clip_num_frames, video.frames.shape))  # [g, H, W, 3]: what the decoder handed over
        return preprocess(video, clip_num_frames)

    adapter.preprocess = spy  # type: ignore[method-assign]
    return seen


def _assert_same_encoding(got, want) -> None:
    assert got.meta == want.meta
    assert torch.equal(got.embeds, want.embeds)
    assert len(got.deepstack) == len(want.deepstack)
    assert all(torch.equal(g, w) for g, w in zip(got.deepstack, want.deepstack, strict=True))


@pytest.mark.parametrize(
    "family,num_frames,model_size",
    [
        ("qwen2_vl", 16, (84, 140)),
        ("qwen3_vl", 23, (160, 256)),
        ("qwen3_5", 24, (128, 256)),
    ],
)
def test_the_encoder_holds_frames_at_the_model_size_with_the_same_embeddings(
    models, wide_clip, family, num_frames, model_size
):
    adapter = load_adapter(ModelConfig(model=str(models[family])), "encoder")
    seen = _spy_on_preprocess(adapter)
    data = wide_clip.read_bytes()
    sampling = SamplingOptions(num_frames=num_frames)
    small = EncoderEngine(EncoderConfig(cache=NO_CACHE), adapter)
    full = EncoderEngine(EncoderConfig(cache=NO_CACHE, frames_at_model_size=False), adapter)
    try:
        got = small.encode(MediaInput(data, ""), sampling, lambda event: None)
        assert {(n, shape[1:]) for n, shape in seen} == {(num_frames, (*model_size, 3))}
        seen.clear()
        want = full.encode(MediaInput(data, ""), sampling, lambda event: None)
        assert {(n, shape[1:]) for n, shape in seen} == {(num_frames, (180, 320, 3))}
    finally:
        small.close()
        full.close()
    _assert_same_encoding(got, want)
    assert (len(got.deepstack) > 0) == (family == "qwen3_vl")  # the DeepStack features were compared


@pytest.mark.parametrize("family", QWEN3_FAMILIES)
def test_requests_encoding_at_once_each_hold_frames_at_their_own_clips_size(models, wide_clip, family):
    """Three requests for one clip at 9, 23 and 24 frames, encoding at once, groups not merged:
    each request's frames are resized for its own frame count (192x320, 160x256, 128x256) and give
    the embeddings (and DeepStack features) of its frames kept as decoded."""
    adapter = load_adapter(ModelConfig(model=str(models[family])), "encoder")
    seen = _spy_on_preprocess(adapter)
    data = wide_clip.read_bytes()
    counts = {9: (192, 320, 3), 23: (160, 256, 3), 24: (128, 256, 3)}
    small = EncoderEngine(EncoderConfig(cache=NO_CACHE, merge_decoded_groups=False), adapter)
    full = EncoderEngine(EncoderConfig(cache=NO_CACHE, frames_at_model_size=False), adapter)

    def encode(engine, num_frames: int):
        return engine.encode(MediaInput(data, ""), SamplingOptions(num_frames=num_frames), lambda event: None)

    try:
        with ThreadPoolExecutor(len(counts)) as pool:
            got = dict(zip(counts, pool.map(lambda n: encode(small, n), counts), strict=True))
        assert {(n, shape[1:]) for n, shape in seen} == {(n, size) for n, size in counts.items()}
        assert max(shape[0] for _, shape in seen) <= 2  # groups of --frames-per-group, unmerged
        want = {n: encode(full, n) for n in counts}
    finally:
        small.close()
        full.close()
    for n in counts:
        _assert_same_encoding(got[n], want[n])


def test_the_decord_backend_which_keeps_frames_as_decoded_gives_the_same_qwen3_encoding(models, wide_clip):
    """decord decodes whole samples at the source size in its child process (no resizer there);
    `preprocess` resizes them as the PyAV decode threads did."""
    from epd.video.decord_backend import decord_available

    if not decord_available():
        pytest.skip("decord is not installed (optional backend: pip install 'epd[decord]')")
    adapter = load_adapter(ModelConfig(model=str(models["qwen3_vl"])), "encoder")
    seen = _spy_on_preprocess(adapter)
    data, sampling = wide_clip.read_bytes(), SamplingOptions(num_frames=23)
    got = {}
    for backend in ("pyav", "decord"):
        engine = EncoderEngine(EncoderConfig(cache=NO_CACHE, decode_backend=backend), adapter)
        try:
            got[backend] = engine.encode(MediaInput(data, ""), sampling, lambda event: None)
        finally:
            engine.close()
    assert {shape[1:3] for _, shape in seen} == {(160, 256), (180, 320)}  # PyAV's resized, decord's decoded
    _assert_same_encoding(got["decord"], got["pyav"])


@pytest.mark.parametrize("family", QWEN3_FAMILIES)
def test_qwen3_answer_about_a_shrunk_odd_clip_equals_generate(models, wide_clip, family):
    """generate() gets 23 frames as decoded (320x180) and its processor shrinks the clip to
    160x256; the pipeline's decoder resized them already."""
    with build_embedded_pipeline(ModelConfig(model=str(models[family]))) as pipeline:
        assert_pipeline_answers_as_generate(pipeline, whole_model(models[family]), wide_clip, 23, 12)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", *FIXED_SIZE_FAMILIES])
def test_answer_about_a_shrunk_video_equals_generate(models, wide_clip, family):
    """generate() gets the frames as decoded (320x180) and its processor resizes them; the
    pipeline's decoder resized them already."""
    video = decode_for_test(wide_clip, 8)  # [8, 180, 320, 3]
    want = reference_tokens(models[family], video, QUESTION, 12)  # each processor's own inputs
    with build_embedded_pipeline(ModelConfig(model=str(models[family]))) as pipeline:
        got = asyncio.run(ask_tokens(pipeline, wide_clip, QUESTION, 8, 12))
    assert got == want
