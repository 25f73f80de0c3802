"""Mirroring prepared inputs (epd/train/augment.py) equals preprocessing the mirrored frames, and the
targets and answers follow the mirror."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from epd.stages.messages import question_messages, to_chat_template
from epd.synth.scene import DIRECTIONS, ObjectSpec, Scene, SceneConfig
from epd.train.augment import (
    mirror_answer,
    mirror_pixels,
    mirror_sequence,
    mirror_targets,
    mirrored_answer_ids,
)
from epd.train.aux_targets import IGNORE, token_targets


@pytest.fixture(scope="module")
def adapter(tiny_models):
    from epd.model_runtime.config import ModelConfig
    from epd.model_runtime.qwen2_vl import Qwen2VLAdapter

    return Qwen2VLAdapter(str(tiny_models["qwen2_vl"]), ModelConfig(), {"vision"})


def _video(frames: np.ndarray):
    from epd.video.types import DecodedVideo

    n = len(frames)
    return DecodedVideo(
        frames=frames,
        timestamps_s=[i / 2.0 for i in range(n)],
        sampled_fps=2.0,
        duration_s=n / 2.0,
        source_fps=2.0,
    )


@pytest.mark.parametrize("size", [(112, 112), (84, 140)])
def test_mirrored_patches_equal_the_processor_on_mirrored_frames(adapter, size):
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 256, size=(6, *size, 3), dtype=np.uint8)
    plain = adapter.preprocess(_video(frames))
    mirrored = adapter.preprocess(_video(np.ascontiguousarray(frames[:, :, ::-1])))
    assert plain.grid_thw == mirrored.grid_thw
    got = mirror_pixels(plain.pixel_values, plain.grid_thw)
    assert torch.allclose(got, mirrored.pixel_values, atol=1e-5)
    assert not torch.allclose(got, plain.pixel_values, atol=1e-3)


def test_targets_mirror_columns_and_swap_left_right():
    sq = ObjectSpec("red", "square", 8, (20.0, 20.0), (90.0, 20.0), 0, 24, 0, 23)  # moves right
    scene = Scene(
        seed=1,
        config=SceneConfig(),
        background="static",
        background_rgb=(16, 16, 16),
        objects=(sq,),
        end_event="stops",
        num_frames=24,
    )
    t = token_targets(scene, [2, 6, 10, 14, 18, 22], (3, 8, 8))
    m = mirror_targets(t, (3, 8, 8))
    lit = t.cell_present.reshape(3, 4, 4, -1)
    assert torch.equal(m.cell_present.reshape(3, 4, 4, -1), lit.flip(2))
    left, right = DIRECTIONS.index("left"), DIRECTIONS.index("right")
    assert set(t.group_dir.unique().tolist()) == {IGNORE, right}
    assert set(m.group_dir.unique().tolist()) == {IGNORE, left}
    assert torch.equal(m.group_shape, t.group_shape[torch.arange(48).reshape(3, 4, 4).flip(2).reshape(-1)])
    assert torch.equal(mirror_targets(m, (3, 8, 8)).cell_dir, t.cell_dir), "mirroring twice is the identity"


def test_mirrored_direction_examples_equal_examples_prepared_with_the_other_answer():
    """A direction question about a mirrored clip: the same prompt, and ids, positions and labels
    exactly as the trainer prepares the same question with the mirrored answer."""
    from epd.model_runtime.adapter import VisualMeta
    from epd.model_runtime.config import ModelConfig
    from epd.model_runtime.qwen2_vl import Qwen2VLAdapter
    from epd.model_runtime.tiny_model import build_model, build_processor
    from epd.train.config import TrainConfig
    from epd.train.model import model_spec, save_model

    assert [mirror_answer(a) for a in ("left", "right", "up", "red", "yes")] == [
        "right",
        "left",
        "up",
        "red",
        "yes",
    ]
    spec = model_spec(TrainConfig())  # the trained model's tokenizer: "left" is not one token
    processor = build_processor(spec)
    with tempfile.TemporaryDirectory() as d:
        save_model(build_model(spec, processor.tokenizer), processor, Path(d))
        adapter = Qwen2VLAdapter(d, ModelConfig(), set())
        meta = VisualMeta("video", (3, 8, 8), 1.0, 48)
        question = "which direction does the red object move?"
        answer_ids = mirrored_answer_ids(processor.tokenizer)

        def prepared(answer: str):
            prompt = adapter.build_prompt(to_chat_template(question_messages(question), "video"), meta)
            ids = torch.cat([prompt.input_ids[0], answer_ids[answer]])
            positions = adapter._prompt_positions(ids[None], meta)[:, 0]
            labels = torch.full_like(ids, IGNORE)
            labels[prompt.num_tokens :] = ids[prompt.num_tokens :]
            return ids, positions, labels

        for answer, other in (("left", "right"), ("right", "left")):
            got = mirror_sequence(*prepared(answer), answer, answer_ids)
            for a, b in zip(got, prepared(other)):
                assert torch.equal(a, b)
        same = prepared("left")
        assert mirror_sequence(*same, "up", answer_ids) == same
