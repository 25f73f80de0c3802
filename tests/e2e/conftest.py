"""Fixtures of the e2e tests: the browser tests' Chromium, and the CLI runs that several files read
(session-scoped, so each runs once)."""

from __future__ import annotations

import json

import pytest

from tests.e2e.cli_runs import QUESTION, embedded_ask_args, run_epd
from tests.reference import decode_for_test, reference_tokens


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium (tests/e2e/chromium.py), one per test module."""
    from tests.e2e.chromium import CHROMIUM, CHROMIUM_ARGS, sync_api

    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield b
        b.close()


@pytest.fixture(scope="session")
def embedded_json(tiny_models, media_files) -> dict:
    """What `embedded_ask_args` prints: run once (a process that imports torch and loads the model,
    ~10 s on two cores) for the three tests that read it: its own fields, the stack's answer to the
    same request (the same fields), and the pruned run's savings (the unpruned side)."""
    proc = run_epd(*embedded_ask_args(tiny_models, media_files))
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.fixture(scope="session")
def expected(tiny_models, media_files):
    video = decode_for_test(media_files["mp4"], 8)
    return reference_tokens(tiny_models["qwen2_vl"], video, QUESTION, 12)
