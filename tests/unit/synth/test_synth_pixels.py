"""Answers match what the decoded MP4/PNG shows, measured on pixels, not read from the generator.

Each clip is rendered, encoded with x264, decoded again with PyAV, and measured: blob counts per
frame, the colour under each object's centre, centroid motion, and a from-pixels answer to every
question (epd.synth.oracle). The last tests transform the decoded frames (mirror, time reversal) and
check that the pixel answers change the way they must, so the measurement can't pass vacuously.
"""

import numpy as np
import pytest

from epd.synth.measure import COLOUR_NAMES, count_blobs, decode_media, label_pixels, track_objects
from epd.synth.oracle import answer_from_frames, answer_from_tracks
from epd.synth.questions import VIDEO_QUESTION_TYPES, make_questions
from epd.synth.render import encode_mp4, encode_png, render_frame, render_frames
from epd.synth.scene import END_EVENTS, generate_image_scene, generate_scene
from epd.synth.splits import seed_for

# Test-split clips 0..7 hold every question type and every end event (asserted below).
VIDEO_SEEDS = [seed_for("test", "video", i) for i in range(8)] + [
    seed_for("train", "video", i) for i in range(4)
]
IMAGE_SEEDS = [seed_for("test", "image", i) for i in range(6)]


@pytest.fixture(scope="module")
def decoded():
    """{seed: (scene, decoded frames [T, H, W, 3])} of every clip, encoded and decoded for real."""
    out = {}
    for seed in VIDEO_SEEDS:
        scene = generate_scene(seed)
        out[seed] = (scene, decode_media(encode_mp4(render_frames(scene), scene.config.fps)))
    return out


def test_the_clips_cover_every_question_type_and_end_event(decoded):
    types = {qa.question_type for scene, _ in decoded.values() for qa in make_questions(scene)}
    assert types == set(VIDEO_QUESTION_TYPES)
    assert {scene.end_event for scene, _ in decoded.values()} == set(END_EVENTS)


def test_every_answer_matches_the_decoded_pixels(decoded):
    for seed, (scene, frames) in decoded.items():
        tracks = track_objects(frames)
        for qa in make_questions(scene):
            got = answer_from_tracks(tracks, len(frames), qa.question_type, qa.question)
            assert got == qa.answer, (
                f"seed {seed}: {qa.question!r} labelled {qa.answer!r}, pixels say {got!r}"
            )


def test_answers_hold_on_frames_sampled_at_2_fps(decoded):
    """What the serving path feeds the model (2 fps, the frame at or before (i + 0.5) / fps) still
    shows every answer: late entries are absent from the first sample, early exits gone before the
    end window, the end event inside it."""
    for seed, (scene, frames) in decoded.items():
        n = len(frames)
        k = int(round(scene.config.duration_s * 2))
        sampled = frames[np.floor((np.arange(k) + 0.5) * n / k + 1e-9).astype(int)]
        tracks = track_objects(sampled)
        for qa in make_questions(scene):
            got = answer_from_tracks(tracks, k, qa.question_type, qa.question)
            assert got == qa.answer, (
                f"seed {seed} at 2 fps: {qa.question!r} is {qa.answer!r}, pixels say {got!r}"
            )


def test_blob_count_per_frame_is_the_number_of_visible_objects(decoded):
    for seed, (scene, frames) in decoded.items():
        assert len(frames) == scene.num_frames
        counts = [count_blobs(f) for f in frames]
        assert counts == [len(scene.visible_objects(f)) for f in range(len(frames))], seed


def test_dominant_colour_at_each_object_is_its_colour(decoded):
    for seed, (scene, frames) in decoded.items():
        for f in (0, len(frames) // 2, len(frames) - 1):
            labels = label_pixels(frames[f])
            for obj in scene.visible_objects(f):
                x, y = (int(round(v)) for v in obj.position(f))
                # A 5x5 patch around the centre (inside even the smallest triangle).
                patch = labels[y - 1 : y + 4, x - 2 : x + 3].ravel()
                patch = patch[patch >= 0]
                dominant = COLOUR_NAMES[np.bincount(patch).argmax()]
                assert dominant == obj.colour, (seed, f, obj)


def test_images_answer_from_their_pixels():
    for seed in IMAGE_SEEDS:
        scene = generate_image_scene(seed)
        frames = decode_media(encode_png(render_frame(scene, 0)))
        assert count_blobs(frames[0]) == len(scene.objects)
        for qa in make_questions(scene):
            assert answer_from_frames(frames, qa.question_type, qa.question) == qa.answer, (seed, qa)


def test_mirrored_video_flips_left_and_right(decoded):
    flipped = 0
    for seed in VIDEO_SEEDS[:8]:
        scene, frames = decoded[seed]
        tracks = track_objects(frames[:, :, ::-1])
        for obj in scene.objects:
            q = f"which direction does the {obj.colour} object move?"
            swap = {"left": "right", "right": "left"}.get(obj.direction, obj.direction)
            assert answer_from_tracks(tracks, len(frames), "direction", q) == swap
            flipped += obj.direction in ("left", "right")
    assert flipped > 0


def test_reversed_video_turns_entries_into_exits(decoded):
    checked = 0
    for seed in VIDEO_SEEDS[:8]:
        scene, frames = decoded[seed]
        forwards, backwards = track_objects(frames), track_objects(frames[::-1])
        for obj in scene.objects:
            enters = answer_from_tracks(
                forwards, len(frames), "enters", f"does the {obj.colour} object enter?"
            )
            leaves = answer_from_tracks(
                backwards, len(frames), "leaves", f"does the {obj.colour} object leave?"
            )
            assert enters == leaves
            checked += enters == "yes"
    assert checked > 0
