"""Exactness beyond the fixed cases of test_exactness.py: clips and sampling options that a
randomized differential audit drew (odd and portrait sizes, display rotation, B-frames, variable
frame rate, fps-driven sampling inside [start_time_s, end_time_s), max_pixels, odd frame counts)
and a conversation whose media sits in a later user turn between two texts, after a system
prompt and an earlier answer. Several requests at once through the embedded pipeline (what
`epd serve --colocate` runs), prefilled in 33-token chunks (boundaries inside the visual
tokens), give each `model.generate(do_sample=False)`'s tokens on the processor's own inputs for
the same frames and messages (Qwen3-VL: the frames' `<t seconds>` from their presentation times)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from epd.gateway.ask_types import AskRequest, AskSummary
from epd.gateway.embedded import build_embedded_pipeline
from epd.model_runtime.config import ModelConfig
from epd.model_runtime.hf_reference import reference_inputs, whole_model
from epd.model_runtime.sampling import GenerationConfig
from epd.prefill_svc.config import PrefillConfig, PrefillSchedulerConfig
from epd.stages.contracts import MediaInput
from epd.stages.messages import from_chat_template
from epd.video import simple_decoder
from epd.video.types import SamplingOptions
from tests.families import qwen_processor_inputs
from tests.media import make_video

MAX_NEW_TOKENS = 20


@dataclass(frozen=True)
class Case:
    family: str
    clip: dict[str, Any] = field(hash=False)
    """make_video's arguments."""
    sampling: SamplingOptions


CASES = [
    Case(
        "qwen2_vl",
        dict(size=(171, 79), pix_fmt="yuv444p", fps=10.0, seconds=2.0),
        SamplingOptions(num_frames=5),
    ),
    Case(
        "qwen2_vl",
        dict(size=(112, 262), fps=5.0, seconds=3.0, codec="mpeg4"),
        SamplingOptions(fps=0.5, max_frames=6, min_frames=3),
    ),
    Case(
        "qwen2_5_vl",
        dict(size=(72, 114), rotation_deg=90, fps=12.5, seconds=3.0),
        SamplingOptions(fps=1.0, max_frames=12, min_frames=10),
    ),
    Case(
        "qwen2_5_vl",
        dict(size=(146, 58), fps=29.97, seconds=2.0, bframes=3),
        SamplingOptions(fps=3.7, max_frames=7, start_time_s=0.25, end_time_s=1.05, max_pixels=64 * 48),
    ),
    Case(
        "qwen3_vl",
        dict(size=(88, 90), fps=24.0, seconds=2.0, vfr=True),
        SamplingOptions(fps=8.0, max_frames=15, min_frames=4, start_time_s=0.1, end_time_s=0.9),
    ),
    Case(
        "qwen3_vl",
        dict(size=(160, 96), rotation_deg=270, fps=10.0, seconds=1.0),
        SamplingOptions(num_frames=7),
    ),
]

CONVERSATION = [
    {"role": "system", "content": [{"type": "text", "text": "answer in one word"}]},
    {"role": "user", "content": [{"type": "text", "text": "how many objects are there?"}]},
    {"role": "assistant", "content": [{"type": "text", "text": "two"}]},
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "in this"},
            {"type": "video"},
            {"type": "text", "text": "which direction does the square move?"},
        ],
    },
]


@pytest.fixture(scope="module")
def checkpoints(tiny_models, tmp_path_factory) -> dict[str, Path]:
    from epd.model_runtime.tiny_model import TinyVLMSpec, build_checkpoint

    qwen3 = build_checkpoint(tmp_path_factory.mktemp("qwen3_vl") / "m", TinyVLMSpec(family="qwen3_vl"))
    return {**tiny_models, "qwen3_vl": qwen3}


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("shapes")
    return [make_video(root / f"clip{i}.mp4", **{"gop": 10, **case.clip}) for i, case in enumerate(CASES)]


def generate_tokens(model_dir: Path, family: str, data: bytes, sampling: SamplingOptions) -> list[int]:
    """generate() on the processor's own inputs for CONVERSATION and the frames the reference
    decoder samples with `sampling`."""
    model, processor = whole_model(model_dir)
    video = simple_decoder.decode(data, sampling)
    if family == "qwen3_vl":  # the frames' times from the source's fps and their indices
        inputs = qwen_processor_inputs(processor, video, messages=CONVERSATION)
    else:
        inputs = reference_inputs(processor, video, CONVERSATION)
    with torch.inference_mode():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=MAX_NEW_TOKENS)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def pipeline_tokens(model_dir: Path, requests: list[tuple[bytes, SamplingOptions]]) -> list[list[int]]:
    """Every request at once through one embedded pipeline, prompts prefilled in 33-token chunks."""
    scheduler = PrefillSchedulerConfig(max_prefill_tokens_per_step=99, prefill_chunk_tokens=33)
    model = ModelConfig(model=str(model_dir))

    async def one(pipeline, data: bytes, sampling: SamplingOptions) -> list[int]:
        request = AskRequest(
            messages=from_chat_template(CONVERSATION),
            media=MediaInput(data),
            sampling=sampling,
            generation=GenerationConfig(max_new_tokens=MAX_NEW_TOKENS),
        )
        async for item in pipeline.ask(request):
            if isinstance(item, AskSummary):
                return item.token_ids
        raise AssertionError("the pipeline ended without a summary")

    with build_embedded_pipeline(model, prefill=PrefillConfig(model=model, scheduler=scheduler)) as pipeline:

        async def run():
            return await asyncio.gather(*(one(pipeline, data, sampling) for data, sampling in requests))

        return asyncio.run(run())


@pytest.mark.parametrize("family", sorted({case.family for case in CASES}))
def test_clip_shapes_and_sampling_options_equal_generate(checkpoints, clips, family):
    mine = [
        (clip.read_bytes(), case.sampling)
        for case, clip in zip(CASES, clips, strict=True)
        if case.family == family
    ]
    want = [generate_tokens(checkpoints[family], family, data, sampling) for data, sampling in mine]
    for tokens in want:
        assert len(tokens) >= 8 and len(set(tokens)) > 4, "the reference says too little to compare"
    assert pipeline_tokens(checkpoints[family], mine) == want
