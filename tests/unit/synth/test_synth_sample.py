"""The bundled sample clip: small, real H.264, from the test split, and its answers are true."""

import io
import json
from pathlib import Path

import av
import numpy as np

from epd.synth.measure import decode_media
from epd.synth.oracle import answer_from_frames
from epd.synth.render import render_frame, render_frames
from epd.synth.sample import README_QUESTION, find_sample_scene
from epd.synth.scene import generate_image_scene, generate_scene
from epd.synth.splits import split_of

SAMPLES = Path(__file__).resolve().parents[3] / "samples"


def test_sample_clip_is_small_h264_from_the_test_split():
    data = (SAMPLES / "sample.mp4").read_bytes()
    assert len(data) < 200_000
    with av.open(io.BytesIO(data)) as container:
        ctx = container.streams.video[0].codec_context
        assert (ctx.name, ctx.pix_fmt) == ("h264", "yuv420p")
        assert ctx.width % 2 == 0 and ctx.height % 2 == 0
    info = json.loads((SAMPLES / "sample.json").read_text())
    assert split_of(info["video"]["seed"]) == "test" and split_of(info["image"]["seed"]) == "test"
    assert info["video"]["seed"] == find_sample_scene("video").seed  # still what epd.synth.sample picks


def test_sample_files_are_what_the_generator_makes_from_their_seeds():
    info = json.loads((SAMPLES / "sample.json").read_text())
    frames = decode_media(SAMPLES / "sample.mp4")
    drawn = render_frames(generate_scene(info["video"]["seed"]))
    assert frames.shape == drawn.shape
    assert np.abs(frames.astype(int) - drawn).mean() < 3
    still = decode_media(SAMPLES / "sample.png")[0]
    assert np.array_equal(still, render_frame(generate_image_scene(info["image"]["seed"]), 0))


def test_sample_answers_match_its_pixels():
    info = json.loads((SAMPLES / "sample.json").read_text())
    for key in ("video", "image"):
        frames = decode_media(SAMPLES / info[key]["file"])
        questions = info[key]["questions"]
        assert questions[0]["question"] == README_QUESTION
        for qa in questions:
            assert answer_from_frames(frames, qa["question_type"], qa["question"]) == qa["answer"], qa
