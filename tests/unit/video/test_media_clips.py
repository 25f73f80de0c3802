"""The tests' own clips (tests/media.py) come out the same bytes every time they are made: the
exactness tests compute `generate()`'s reference tokens from them once per session, so a clip that
differed from session to session gave a different reference, now and then one that stopped early
(tests/integration/test_exactness.py::test_reference_output_varies failed in CI so)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
MAKE_CLIP = (  # the conftest's clip: 112x84, 8 s, a keyframe every 20 frames (B-frames, CRF)
    "import sys; from tests.media import make_video; "
    "make_video(sys.argv[1], size=(112, 84), fps=10.0, seconds=8.0, gop=20)"
)


def test_a_clip_is_the_same_bytes_whatever_the_encoders_fresh_memory_holds(tmp_path):
    """glibc's MALLOC_PERTURB_=n fills newly allocated heap memory with one byte (0: off). x264's
    macroblock tree read some of its memory before writing it (AVX-512 code): each value gave a
    different clip, as a long test session's heap did now and then (`tests.media.X264_SAME_BYTES`).
    On a CPU without AVX-512 the clips agree with the tree on too; there this test proves less."""
    made = set()
    for perturb in ("0", "1", "170"):
        path = tmp_path / f"clip-{perturb}.mp4"
        env = {**os.environ, "MALLOC_PERTURB_": perturb, "PYTHONPATH": str(REPO)}
        subprocess.run(
            [sys.executable, "-c", MAKE_CLIP, str(path)], env=env, cwd=REPO, check=True, timeout=120
        )
        made.add(hashlib.sha256(path.read_bytes()).hexdigest())
    assert len(made) == 1, f"{len(made)} different clips from the same frames"


def test_a_narrow_hevc_clip_is_refused_before_libx265_corrupts_the_heap(tmp_path):
    """libx265 4.2 aborts the process (heap corruption, found at a later free()) on most encodes of
    frames 34-48 px wide (`tests.media.X265_MIN_WIDTH`); `make_video` refuses them up front. In a
    child Python: without the check the abort would take the test session with it."""
    code = (
        "import sys; from tests.media import make_video, encoder_available\n"
        "if not encoder_available('hevc'): sys.exit(3)\n"
        "for i in range(5):\n"
        "    try:\n"
        "        make_video(f'{sys.argv[1]}/narrow{i}.mp4', codec='hevc', size=(40, 24), seconds=1.0)\n"
        "    except ValueError as exc:\n"
        "        print(exc)\n"
    )
    child = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    if child.returncode == 3:
        pytest.skip("this FFmpeg build has no HEVC encoder")
    assert child.returncode == 0, f"exit status {child.returncode}: {child.stderr[-2000:]}"
    assert child.stdout.count("at least 64 px wide") == 5, child.stdout
