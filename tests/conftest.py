"""Shared fixtures: tiny real checkpoints, test media, and a real loopback stack.

Tests are marked by folder: tests/unit -> unit, tests/integration -> integration, tests/e2e -> e2e.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest

from tests import leak_check

os.environ.setdefault("OMP_NUM_THREADS", "1")
leak_check.install()

_ROOT = Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        rel = Path(str(item.fspath)).resolve().relative_to(_ROOT.resolve())
        if rel.parts and rel.parts[0] in ("unit", "integration", "e2e"):
            item.add_marker(getattr(pytest.mark, rel.parts[0]))


@pytest.fixture(autouse=True)
def _no_leaks(request, caplog):
    """Fails the test that leaves a gRPC channel open, a gRPC server serving, a child process or a
    thread running (see tests/leak_check.py; EPD_LEAK_CHECK=off|report). Autouse at the root, so it
    is set up after the module and session fixtures (their threads are running when it takes its
    snapshot: not the test's) and torn down after the test's own ones."""
    if leak_check.MODE == "off":
        yield
        return
    scope = leak_check.begin_test()
    yield
    leak_check.release_logged_errors([*caplog.get_records("setup"), *caplog.get_records("call")])
    leaks = leak_check.check_test(scope, lambda: _wider_fixture_values(request))
    if leaks:
        _leak_reports.append((request.node.nodeid, leaks))
        if leak_check.MODE == "fail":
            pytest.fail("left open by this test:\n" + "\n".join(leaks), pytrace=False)


_leak_reports: list[tuple[str, list[str]]] = []


@pytest.fixture
def closing():
    """`closing(thing)` returns `thing` and closes it at the test's end (its `close()`), for what a
    test makes inline and drops: an `EncoderEngine`'s decode workers, a stage's request drivers.
    Nothing else ends their threads before the interpreter's exit."""
    with contextlib.ExitStack() as stack:
        yield lambda thing: stack.enter_context(contextlib.closing(thing))


def _wider_fixture_values(request) -> list:
    """The values of the test's module- and session-scoped fixtures (whose objects may open
    channels or start processes during the test, theirs to close)."""
    return [
        fixturedef.cached_result[0]
        for fixturedefs in request.node._fixtureinfo.name2fixturedefs.values()
        for fixturedef in fixturedefs
        if fixturedef.scope != "function" and getattr(fixturedef, "cached_result", None)
    ]


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if leak_check.MODE == "off":
        return
    fixtures = leak_check.leftovers()
    tests = _leak_reports if leak_check.MODE == "report" else []  # in fail mode, each test's error says it
    if not (tests or fixtures):
        return
    terminalreporter.section("left open (tests/leak_check.py)")
    for nodeid, leaks in tests:
        terminalreporter.write_line(f"{nodeid}:")
        for leak in leaks:
            terminalreporter.write_line("    " + leak.replace("\n", "\n    "))
    if fixtures:
        terminalreporter.write_line("by module or session fixtures, at the end of the run:")
        for leak in fixtures:
            terminalreporter.write_line("    " + leak.replace("\n", "\n    "))


def pytest_sessionfinish(session, exitstatus):
    if leak_check.MODE == "fail" and leak_check.leftovers() and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """Qwen2-VL and Qwen2.5-VL checkpoints built from the real configs, saved with save_pretrained."""
    from epd.model_runtime.tiny_model import TinyVLMSpec, build_checkpoint
    from tests.stack import share_weights_of

    root = tmp_path_factory.mktemp("models")
    models = {
        family: build_checkpoint(root / family, TinyVLMSpec(family=family))
        for family in ("qwen2_vl", "qwen2_5_vl")
    }
    # The stacks on tiny Qwen2-VL (most of them) share its weights, as `epd serve`'s services do:
    # the exactness and batch-invariance tests run on the shared copy.
    share_weights_of(models["qwen2_vl"])
    return models


@pytest.fixture(scope="session")
def media_files(tmp_path_factory) -> dict[str, Path]:
    """A real H.264 MP4 (8 s at 10 fps, 80 frames) and a PNG, made with PyAV and Pillow."""
    import numpy as np
    from PIL import Image

    from tests.media import make_video

    root = tmp_path_factory.mktemp("media")
    files = {
        "mp4": make_video(root / "clip.mp4", codec="h264", size=(112, 84), fps=10.0, seconds=8.0, gop=20),
        "mp4_b": make_video(
            root / "clip_b.mp4", codec="h264", size=(96, 64), fps=10.0, seconds=4.0, gop=10, pattern="noise"
        ),
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
    from tests.stack import Stack

    with Stack(tiny_models["qwen2_vl"], tmp_path_factory.mktemp("logs_shared"), http=True) as s:
        yield s
