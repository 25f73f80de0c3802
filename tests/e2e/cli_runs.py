"""The CLI tests' shared runs: `epd ask`'s arguments for an embedded run on the test clip
(`embedded_ask_args`), and a fresh interpreter (`run_epd`) where the process as a user starts it
is under test."""

from __future__ import annotations

import subprocess

from tests.stack import ROOT, child_env, epd_command

QUESTION = "what colour is the square?"


def run_epd(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        epd_command(*args), capture_output=True, text=True, env=child_env(), cwd=ROOT, timeout=timeout
    )


def embedded_ask_args(tiny_models, media_files) -> list[str]:
    """`epd ask` embedded on the clip, 8 frames, 12 tokens, --json."""
    return [
        "ask",
        str(media_files["mp4"]),
        QUESTION,
        "--model",
        str(tiny_models["qwen2_vl"]),
        "--num-frames",
        "8",
        "--max-new-tokens",
        "12",
        "--json",
    ]
