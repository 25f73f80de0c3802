"""Fixtures of the browser tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium (tests/e2e/chromium.py), one per test module."""
    from tests.e2e.chromium import CHROMIUM, CHROMIUM_ARGS, sync_api

    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield b
        b.close()
