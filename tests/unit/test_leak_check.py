"""tests/leak_check.py fails the test that leaves a gRPC channel open, a gRPC server serving, a
child process or a thread running, naming what it left and where it was made or started; a test
that closes everything passes, so does one whose thread ends shortly after it, and so does one
whose module fixture's object opens a channel or starts a thread (closed or ended by the fixture,
or named at the end of the run when not). Run as a separate pytest over a module of such tests,
with the project's conftest fixture and hooks."""

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
import concurrent.futures
import logging
import subprocess
import sys
import threading
import time

import grpc
import pytest


class Lazy:
    """Opens its channel and starts its worker thread at its first use, in a test."""

    def __init__(self, target):
        self.target, self.channel, self.worker, self.stop = target, None, None, threading.Event()

    def use(self):
        self.channel = self.channel or grpc.insecure_channel(self.target)
        if self.worker is None:
            self.worker = threading.Thread(target=self.work, name=f"lazy-{self.target}", daemon=True)
            self.worker.start()

    def work(self):
        self.stop.wait()

    def close(self):
        self.channel.close()
        self.stop.set()


@pytest.fixture(scope="module")
def closes_its_channel():
    lazy = Lazy("127.0.0.1:5")
    yield lazy
    lazy.close()


@pytest.fixture(scope="module")
def leaves_its_channel_open():
    yield Lazy("127.0.0.1:6")


@pytest.fixture(scope="module")
def module_thread():
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, name="module-fixture-thread", daemon=True)
    thread.start()
    yield thread
    stop.set()


@pytest.fixture(scope="module")
def on_fixture_loop():
    """Runs a call through the default executor of a module fixture's loop thread (the executor
    starts its threads at the first call, in a test); yields a function, which reaches no thread."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="fixture-loop", daemon=True)
    thread.start()

    def run(fn):
        async def call():
            return await asyncio.get_running_loop().run_in_executor(None, fn)

        return asyncio.run_coroutine_threadsafe(call(), loop).result(10)

    yield run
    loop.call_soon_threadsafe(loop.stop)
    thread.join()
    loop.close()  # shuts its default executor down


def test_a_module_fixtures_loop_starts_its_executor(on_fixture_loop):
    assert on_fixture_loop(int) == 0  # started by the fixture's loop thread: the fixture's


def test_a_module_fixtures_object_opens_a_channel(closes_its_channel, leaves_its_channel_open):
    closes_its_channel.use()  # the fixture's to close: not this test's leak
    leaves_its_channel_open.use()  # nor this, but the fixture never closes it: named at the end


def test_a_module_fixtures_thread_runs(module_thread):
    assert module_thread.is_alive()  # started before the test: not its leak


FOREVER = threading.Event()


def spin_forever():
    FOREVER.wait()


def test_thread_left_running():
    threading.Thread(target=spin_forever, name="leaky-worker", daemon=True).start()


def test_thread_ends_shortly_after():
    threading.Thread(target=time.sleep, args=(0.3,), name="ending-worker").start()


def test_a_logged_errors_frames_keep_no_thread_running():
    """pytest keeps the test's log records to its teardown: the error's traceback keeps the pool."""

    def fail():
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="logged-pool")
        pool.submit(int).result()
        raise ValueError("bad")

    try:
        fail()
    except ValueError as exc:
        logging.getLogger("leaky").warning("failed: %r", exc)


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
    assert "11 passed, 5 errors" in out, out  # each leaky test passes, then errors at its teardown
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
        "test_thread_left_running",
    }, out
    assert "grpc channel to 127.0.0.1:1, not closed" in out
    assert "grpc.aio channel to 127.0.0.1:2, not closed" in out
    assert "grpc.aio server on port(s) [" in out and "not stopped" in out
    assert "child process" in out and "time.sleep(60)" in out
    thread = out.split("thread 'leaky-worker' running test_leaky.spin_forever, still running")[1]
    assert "in test_thread_left_running" in thread.split("\n\n")[0], out  # where it was started
    assert "ending-worker" not in out and "module-fixture-thread" not in out and "logged-pool" not in out, out
    assert "asyncio_0" not in out, out  # the fixture's loop's executor, ended by its teardown
    # where it was made
    assert "test_leaky.py" in out.split("grpc channel to 127.0.0.1:1")[1].split("\n\n")[0]
    fixtures = out.split("by module or session fixtures, at the end of the run:")[1]
    assert "grpc channel to 127.0.0.1:6, not closed" in fixtures and "127.0.0.1:5" not in out, out
    assert "thread 'lazy-127.0.0.1:6' running test_leaky.Lazy.work, still running" in fixtures, out
