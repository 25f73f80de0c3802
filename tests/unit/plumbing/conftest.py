"""Shared fixtures of the plumbing tests that run the real tiny model in one process: the test
videos' bytes and an embedded pipeline (one per test module)."""

from __future__ import annotations

import pytest

from epd.gateway.embedded import build_embedded_pipeline
from epd.model_runtime.config import ModelConfig


@pytest.fixture(scope="module")
def videos(media_files) -> dict[str, bytes]:
    return {name: media_files[name].read_bytes() for name in ("mp4", "mp4_b")}


@pytest.fixture(scope="module")
def embedded(tiny_models):
    pipeline = build_embedded_pipeline(ModelConfig(model=str(tiny_models["qwen2_vl"])))
    yield pipeline
    pipeline.close()
