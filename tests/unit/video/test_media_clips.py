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
