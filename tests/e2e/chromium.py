"""Headless Chromium for the web demo's tests: Debian's chromium (`apt-get install -y chromium`)
driven by Playwright for Python (`pip install playwright`; no `playwright install`). A test module
that imports this is skipped, with that hint, when either is missing; the `browser` fixture is in
conftest.py."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

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


@contextmanager
def checked_page(browser: Any, timeout_ms: int) -> Iterator[Any]:
    """A new page (1280 x 1000) in a context of its own; at the end, the test fails if the page had
    an uncaught script error or its Content-Security-Policy blocked anything (Chromium logs each
    thing it blocks to the console)."""
    context = browser.new_context(viewport={"width": 1280, "height": 1000})
    page = context.new_page()
    page.set_default_timeout(timeout_ms)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("console", lambda m: errors.append(m.text) if "Content Security Policy" in m.text else None)
    yield page
    context.close()
    assert not errors, errors  # no uncaught script errors, nothing blocked
