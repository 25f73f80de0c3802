"""tests/leak_check.py fails the test that leaves a gRPC channel open, a gRPC server serving or a
child process running, naming what it left and where it was made; a test that closes everything
passes, and so does one whose module fixture's object opens a channel (closed by the fixture, or
named at the end of the run when not). Run as a separate pytest over a module of such tests, with
the project's conftest fixture and hooks."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CONFTEST = """
from tests.conftest import _no_leaks, pytest_sessionfinish, pytest_terminal_summary  # noqa: F401 - under test
"""

LEAKY_TESTS = '''
import asyncio
import subprocess
import sys

import grpc
import pytest


class Lazy:
    """Opens its channel at its first use, in a test."""

    def __init__(self, target):
        self.target, self.channel = target, None

    def use(self):
        self.channel = self.channel or grpc.insecure_channel(self.target)


@pytest.fixture(scope="module")
def closes_its_channel():
    lazy = Lazy("127.0.0.1:5")
    yield lazy
    lazy.channel.close()


@pytest.fixture(scope="module")
def leaves_its_channel_open():
    yield Lazy("127.0.0.1:6")


def test_a_module_fixtures_object_opens_a_channel(closes_its_channel, leaves_its_channel_open):
    closes_its_channel.use()  # the fixture's to close: not this test's leak
    leaves_its_channel_open.use()  # nor this, but the fixture never closes it: named at the end


def test_sync_channel_left_open():
    grpc.insecure_channel("127.0.0.1:1")


def test_aio_channel_dropped_without_close():
    async def scenario():
        channel = grpc.aio.insecure_channel("127.0.0.1:2")
        del channel  # collected, and closed by grpc on the way, but never closed by the test
    asyncio.run(scenario())


SERVERS = []


def test_aio_server_left_serving():
    async def scenario():
        server = grpc.aio.server()
        server.add_insecure_port("127.0.0.1:0")
        await server.start()
        SERVERS.append(server)
    asyncio.run(scenario())


def test_child_process_left_running():
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_everything_closed():
    with grpc.insecure_channel("127.0.0.1:3"):
        pass

    async def scenario():
        async with grpc.aio.insecure_channel("127.0.0.1:4"):
            pass
        server = grpc.aio.server()
        server.add_insecure_port("127.0.0.1:0")
        await server.start()
        await server.stop(None)
    asyncio.run(scenario())
    subprocess.run([sys.executable, "-c", "pass"], check=True)
'''


def test_the_test_that_leaks_fails_and_says_what_it_left(tmp_path):
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_leaky.py").write_text(textwrap.dedent(LEAKY_TESTS))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "EPD_LEAK_CHECK": "fail"}
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-rE",
            "-q",
            "--rootdir",
            str(tmp_path),
            str(tmp_path / "test_leaky.py"),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    assert "6 passed, 4 errors" in out, out  # each leaky test passes, then errors at its teardown
    errors = {
        line.split(" - ")[0].removeprefix("ERROR test_leaky.py::").split()[0]: line
        for line in out.splitlines()
        if line.startswith("ERROR ")
    }
    assert set(errors) == {
        "test_sync_channel_left_open",
        "test_aio_channel_dropped_without_close",
        "test_aio_server_left_serving",
        "test_child_process_left_running",
    }, out
    assert "grpc channel to 127.0.0.1:1, not closed" in out
    assert "grpc.aio channel to 127.0.0.1:2, not closed" in out
    assert "grpc.aio server on port(s) [" in out and "not stopped" in out
    assert "child process" in out and "time.sleep(60)" in out
    # where it was made
    assert "test_leaky.py" in out.split("grpc channel to 127.0.0.1:1")[1].split("\n\n")[0]
    fixtures = out.split("by module or session fixtures, at the end of the run:")[1]
    assert "grpc channel to 127.0.0.1:6, not closed" in fixtures and "127.0.0.1:5" not in out, out
