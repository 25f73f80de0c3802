"""The bundled sample: one test-split clip (and one still) for README's first command.

    python -m epd.synth.sample --out samples

writes `sample.mp4`, `sample.png` and `sample.json` (seeds and questions with answers). The clip is
the first test-split clip with two or more objects of which exactly one is a circle, visible from
the first frame to the last, so `epd ask samples/sample.mp4 "what colour is the circle?"` has one
right answer. The choice is a pure function of the generator, so rerunning this rewrites the same
files (byte-identical with the same PyAV/x264 build).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from epd.synth.dataset import GENERATOR_VERSION
from epd.synth.questions import QA, make_questions
from epd.synth.render import EncodeConfig, encode_mp4, encode_png, render_frame, render_frames
from epd.synth.scene import Scene, SceneConfig, generate_image_scene, generate_scene
from epd.synth.splits import seed_for

README_QUESTION = "what colour is the circle?"
SAMPLE_SPLIT = "test"
_MAX_SEARCH = 10_000


def _has_one_circle(scene: Scene) -> bool:
    circles = [o for o in scene.objects if o.shape == "circle"]
    if len(scene.objects) < 2 or len(circles) != 1:
        return False
    return circles[0].enter_frame == 0 and circles[0].exit_frame == scene.num_frames


def find_sample_scene(media_type: str = "video", config: SceneConfig = SceneConfig()) -> Scene:
    """The first test-split scene that fits README's question (see the module docstring)."""
    make = generate_scene if media_type == "video" else generate_image_scene
    for index in range(_MAX_SEARCH):
        scene = make(seed_for(SAMPLE_SPLIT, media_type, index), config)
        if _has_one_circle(scene):
            return scene
    raise RuntimeError(f"no {media_type} with exactly one circle among the first {_MAX_SEARCH} test seeds")


def sample_questions(scene: Scene) -> list[QA]:
    """README's question first, then the generator's own questions about the scene."""
    circle = next(o for o in scene.objects if o.shape == "circle")
    out = [QA(README_QUESTION, circle.colour, "colour")]
    return out + [qa for qa in make_questions(scene) if qa.question != README_QUESTION]


def write_sample(out_dir: str | Path, encode: EncodeConfig = EncodeConfig()) -> dict:
    """Write sample.mp4, sample.png and sample.json under `out_dir`; returns the JSON written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    video = find_sample_scene("video")
    image = find_sample_scene("image")
    (out / "sample.mp4").write_bytes(encode_mp4(render_frames(video), video.config.fps, encode))
    (out / "sample.png").write_bytes(encode_png(render_frame(image, 0)))
    info = {
        "generator_version": GENERATOR_VERSION,
        "made_by": "python -m epd.synth.sample",
        "split": SAMPLE_SPLIT,
        "video": {
            "file": "sample.mp4",
            "seed": video.seed,
            "keyframe_interval": encode.keyframe_interval,
            "qp": encode.qp,
            "questions": [qa.__dict__ for qa in sample_questions(video)],
        },
        "image": {
            "file": "sample.png",
            "seed": image.seed,
            "questions": [qa.__dict__ for qa in sample_questions(image)],
        },
    }
    (out / "sample.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m epd.synth.sample", description="write the bundled sample")
    p.add_argument("--out", default="samples", help="directory to write (default: samples)")
    a = p.parse_args(argv)
    info = write_sample(a.out)
    first = info["video"]["questions"][0]
    print(
        f"wrote {a.out}/sample.mp4 (seed {info['video']['seed']}): {first['question']} -> {first['answer']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
