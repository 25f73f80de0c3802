"""Shared fixtures: tiny real checkpoints, test media, and a real loopback stack.

Tests are marked by folder: tests/unit -> unit, tests/integration -> integration, tests/e2e -> e2e.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

_ROOT = Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        rel = Path(str(item.fspath)).resolve().relative_to(_ROOT.resolve())
        if rel.parts and rel.parts[0] in ("unit", "integration", "e2e"):
            item.add_marker(getattr(pytest.mark, rel.parts[0]))


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """Qwen2-VL and Qwen2.5-VL checkpoints built from the real configs, saved with save_pretrained."""
    from epd.model_runtime.tiny_model import TinyVLMSpec, build_checkpoint

    root = tmp_path_factory.mktemp("models")
    return {
        family: build_checkpoint(root / family, TinyVLMSpec(family=family))
        for family in ("qwen2_vl", "qwen2_5_vl")
    }


@pytest.fixture(scope="session")
def media_files(tmp_path_factory) -> dict[str, Path]:
    """A real H.264 MP4 (8 s at 10 fps, 80 frames) and a PNG, made with PyAV and Pillow."""
    import numpy as np
    from PIL import Image

    from tests.media import make_video

    root = tmp_path_factory.mktemp("media")
    files = {
        "mp4": make_video(root / "clip.mp4", codec="h264", size=(112, 84), fps=10.0, seconds=8.0, gop=20),
        "mp4_b": make_video(root / "clip_b.mp4", codec="h264", size=(96, 64), fps=10.0, seconds=4.0, gop=10,
                            pattern="noise"),
    }
    rng = np.random.default_rng(3)
    img = rng.integers(0, 256, size=(70, 90, 3), dtype=np.uint8)
    Image.fromarray(img).save(root / "image.png")
    files["png"] = root / "image.png"
    return files


@pytest.fixture(scope="session")
def shared_stack(tiny_models, tmp_path_factory):
    """One plain stack (tiny Qwen2-VL, default flags, HTTP API on `.http_port`) for the modules that
    need nothing special: each stack costs ~10-15 s of start-up on two cores. Modules that need
    their own flags, or kill and restart processes, start their own."""
    from tests.stack import Stack, free_port

    http_port = free_port()
    extra = {"gateway": ["--http-port", str(http_port)]}
    with Stack(tiny_models["qwen2_vl"], tmp_path_factory.mktemp("logs_shared"), extra=extra) as s:
        s.http_port = http_port
        yield s
