"""Headless Chromium for the web demo's tests: Debian's chromium (`apt-get install -y chromium`)
driven by Playwright for Python (`pip install playwright`; no `playwright install`). A test module
that imports this is skipped, with that hint, when either is missing; the `browser` fixture is in
conftest.py."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
if not Path(CHROMIUM).exists():
    pytest.skip("needs Debian's chromium: apt-get install -y chromium", allow_module_level=True)
sync_api = pytest.importorskip(
    "playwright.sync_api", reason="needs Playwright for Python: pip install playwright"
)

CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run",
]  # fmt: skip
