"""bench/bench_tokenize.py against the session's stack: every route answered at every level, the
table printed. No timing assertions."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.stack import ROOT, child_env


def test_the_tokenize_benchmark_times_every_route_at_every_level(shared_stack, tmp_path):
    out = tmp_path / "tokenize.json"
    cmd = [sys.executable, str(ROOT / "bench" / "bench_tokenize.py"), "--openai",
           f"http://127.0.0.1:{shared_stack.http_port}", "--num-calls", "6", "--concurrency", "1,3",
           "--rounds", "2", "--cpu-pid", f"pytest={os.getpid()}", "--output-json", str(out)]  # fmt: skip
    run = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert sorted(report) == ["1", "3"]
    for by_route in report.values():
        assert sorted(by_route) == ["models", "tokenize", "tokenize-chat"]
        assert all(len(t["latencies_ms"]) == 6 and not t["errors"] for t in by_route.values())
        assert all(t["cpu_ms"]["pytest"] >= 0 for t in by_route.values())  # --cpu-pid: measured per route
    rows = [line for line in run.stdout.splitlines() if line.startswith(("| 1 |", "| 3 |"))]
    assert len(rows) == 6 and all("| 6/6 |" in r for r in rows), run.stdout
    assert all("| 1.00x |" in r for r in rows if "| models |" in r)
    assert "| p50 / models | pytest CPU ms/call |" in run.stdout


def test_the_tokenize_benchmark_fails_when_a_route_does(shared_stack):
    """A refused body (a model not served) is an error, not a latency: exit status 1."""
    cmd = [sys.executable, str(ROOT / "bench" / "bench_tokenize.py"), "--openai",
           f"http://127.0.0.1:{shared_stack.http_port}", "--num-calls", "2", "--concurrency", "1",
           "--rounds", "1", "--model", "no-such-model"]  # fmt: skip
    run = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "404" in run.stdout + run.stderr, run.stdout[-2000:] + run.stderr[-2000:]
