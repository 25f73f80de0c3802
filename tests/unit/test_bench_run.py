"""bench/common.py's `run_bench`: a bench ended by SIGTERM still stops the servers it started.

Benches start their servers in a session of their own (so that `stop` can end each one's process
group), so the servers get none of the bench's signals; with SIGTERM's default the bench died
without its `finally: stop(proc)` and left them running (four stacks of a killed A/B, 2026-11-30)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import psutil

from tests.stack import ROOT

# A bench's shape: a server in its own session, stopped in `finally`, the script run by run_bench.
BENCH = textwrap.dedent(
    """
    import subprocess, sys, time
    from bench.common import run_bench, stop

    def main():
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
        try:
            print(proc.pid, flush=True)
            time.sleep(120)
        finally:
            stop(proc)
        return 0

    run_bench(main)
    """
)


def test_a_bench_ended_by_sigterm_stops_its_server_and_exits_143():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    bench = subprocess.Popen(
        [sys.executable, "-c", BENCH], stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT
    )
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
