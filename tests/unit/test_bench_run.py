"""bench/common.py's `run_bench` and `start_server`: a bench ended by SIGTERM still stops the
servers it started, and one killed by SIGKILL leaves none running either.

Benches start their servers in a session of their own (so that `stop` can end each one's process
group), so the servers get none of the bench's signals; with SIGTERM's default the bench died
without its `finally: stop(proc)` and left them running (four stacks of a killed A/B, 2026-11-30).
SIGKILL runs no `finally`: the kernel sends the servers SIGTERM (`start_server`'s parent-death
signal)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil

from bench.common import start_server
from tests.stack import ROOT

# A bench's shape: a server in its own session, stopped in `finally`, the script run by run_bench.
BENCH = textwrap.dedent(
    """
    import sys, time
    from bench.common import run_bench, start_server, stop

    def main():
        proc = start_server([sys.executable, "-c", "import time; time.sleep(120)"])
        try:
            print(proc.pid, flush=True)
            time.sleep(120)
        finally:
            stop(proc)
        return 0

    run_bench(main)
    """
)


def _start_bench() -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-c", BENCH], stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT
    )


def _running(process: psutil.Process) -> bool:
    """Alive: neither gone nor a zombie left for its new parent (init, or a subreaper) to reap."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_bench_ended_by_sigterm_stops_its_server_and_exits_143():
    bench = _start_bench()
    server = None
    try:
        assert bench.stdout is not None
        server = psutil.Process(int(bench.stdout.readline()))
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=60) == 128 + signal.SIGTERM  # SystemExit, not death by the signal
        assert not server.is_running() or server.status() == psutil.STATUS_ZOMBIE, (
            "the server was left running"
        )
    finally:
        if bench.poll() is None:
            bench.kill()
        if server is not None and server.is_running():
            server.kill()


def test_a_bench_killed_by_sigkill_leaves_no_server_running():
    """No handler of the bench sees SIGKILL and no `finally` runs: the server, in a session of its
    own, ends because the kernel sends it SIGTERM when the bench dies (PR_SET_PDEATHSIG)."""
    bench = _start_bench()
    server = None
    try:
        assert bench.stdout is not None
        server = psutil.Process(int(bench.stdout.readline()))
        bench.kill()
        bench.wait(timeout=60)
        deadline = time.monotonic() + 30.0  # a bound on a server left running, not a timing assertion
        while _running(server) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _running(server), "the server outlived the bench killed by SIGKILL"
    finally:
        if bench.poll() is None:
            bench.kill()
        if server is not None and _running(server):
            server.kill()


def test_a_server_is_started_from_the_main_thread_only():
    """The parent-death signal fires when the thread that forked the server ends: a server started
    from a worker thread would be stopped with that thread."""
    raised: list[BaseException] = []

    def start() -> None:
        try:
            start_server([sys.executable, "-c", "pass"])
        except RuntimeError as exc:
            raised.append(exc)

    worker = threading.Thread(target=start)
    worker.start()
    worker.join()
    assert len(raised) == 1 and "start servers from the main thread" in str(raised[0]), raised
