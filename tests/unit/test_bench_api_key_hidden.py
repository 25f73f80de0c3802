"""A bench suite run as a module shows no --api-key in `ps`: every local user reads a process's
command line (/proc/PID/cmdline), and `python -m epd.bench.serve --openai URL --api-key KEY`
showed the key there for as long as the run lasted (`epd bench serve`, through `epd`, hid it)."""

from __future__ import annotations

import socket
import subprocess
import sys

import psutil

from tests.stack import ROOT, child_env


def test_the_serve_bench_run_as_a_module_hides_its_api_key_from_ps():
    key = "key-nobody-else-may-read"
    # A server that takes the bench's connection and never answers: the bench waits on its first
    # request, having parsed its flags, for as long as the test looks.
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        proc = subprocess.Popen(
            [sys.executable, "-m", "epd.bench.serve", "--openai", f"http://127.0.0.1:{port}",
             "--api-key", key, "--no-baselines", "--num-requests", "1", "--num-frames", "2"],
            cwd=ROOT, env=child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )  # fmt: skip
        try:
            server.settimeout(120)  # a deadline, not a timing assertion: the request has come
            connection, _ = server.accept()
            shown = " ".join(psutil.Process(proc.pid).cmdline())
            connection.close()
        finally:
            proc.kill()
            _, err = proc.communicate(timeout=60)
    assert key not in shown and "--api-key ***" in shown, (shown, err.decode()[-2000:])
    assert shown.startswith("python -m epd.bench.serve --openai http://127.0.0.1:"), shown
