"""No memory held between requests: after one large request, every serving process's RSS returns
to within 10% of its idle level (issue #22, item 4): the stack of the suite (its services forked
from the test's zygote, on glibc's malloc), and `epd serve --colocate` as a user starts it (on
tcmalloc where the machine has it: `--allocator auto`), which gives its allocator's free memory
back once idle (epd/transport/idle_memory.py).

Before, the encoder kept the last large request's decoded frames (a request and its decode tasks
pointed at each other, so only Python's cyclic GC, which may not run for many requests, freed
them): one 96-frame 720p request left it ~270 MB (+37%) above idle.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest

from epd.cli.allocator import find_tcmalloc, uses_tcmalloc
from epd.cli.health import is_serving
from epd.client import EpdClient
from tests.media import make_video
from tests.stack import ROOT, bound_ports, child_env, epd_command

QUESTION = "what colour is the circle?"
MAX_GROWTH = 0.10


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


@pytest.fixture(scope="module")
def stack(shared_stack):
    return shared_stack


@pytest.fixture(scope="module")
def big_clip(tmp_path_factory) -> Path:
    """64 frames of 1280x720 are ~180 MB of RGB: more than 10% of any process's idle RSS. Both tests
    only read it: made once."""
    return Path(
        make_video(
            tmp_path_factory.mktemp("big") / "big.mp4", size=(1280, 720), fps=30.0, seconds=3.0, gop=30
        )
    )


def test_rss_returns_to_idle_after_a_large_request(stack, media_files, big_clip):
    big = big_clip
    with EpdClient(stack.gateway, timeout_s=300) as client:
        for _ in range(2):  # first requests allocate what every later one reuses (kernels, pools)
            client.ask(media_files["mp4"], QUESTION, num_frames=8, max_new_tokens=4)
        idle = {name: rss_bytes(proc.pid) for name, proc in stack.procs.items()}
        result = client.ask(big, QUESTION, num_frames=64, max_pixels=1280 * 720, max_new_tokens=4)
        assert result.num_frames == 64
        # The gateway answers once the last token is out; stages finish tidying just after, and
        # give their free memory back at their first idle half-second: a few seconds is plenty.
        settle_by = time.monotonic() + 5.0
        while True:
            after = {name: rss_bytes(proc.pid) for name, proc in stack.procs.items()}
            if all(after[n] <= idle[n] * (1 + MAX_GROWTH) for n in idle) or time.monotonic() > settle_by:
                break
            time.sleep(0.25)
    change = {
        name: f"{idle[name] / 2**20:.0f} -> {after[name] / 2**20:.0f} MiB ({after[name] / idle[name] - 1:+.1%})"
        for name in idle
    }
    print("RSS idle -> after a 64-frame 720p request:", change)  # docs/benchmarks.md quotes it (pytest -s)
    grown = {name: change[name] for name in idle if after[name] > idle[name] * (1 + MAX_GROWTH)}
    assert grown == {}, f"RSS still above idle + {MAX_GROWTH:.0%} after a large request: {grown}"


def test_rss_returns_to_idle_after_a_large_request_on_the_servers_own_allocator(
    tiny_models, media_files, big_clip, tmp_path
):
    """tcmalloc keeps freed spans for reuse: without the idle release the colocated server stayed
    ~190 MB (about a fifth) above idle after this request."""
    big = big_clip
    ports_file = tmp_path / "colocated.ports.json"
    env = child_env()
    env.pop("LD_PRELOAD", None)  # the server's own choice (--allocator auto), not the test runner's
    serve = subprocess.Popen(
        epd_command(
            "serve",
            "--colocate",
            "--model",
            str(tiny_models["qwen2_vl"]),
            "--gateway-port",
            "0",
            "--http-port",
            "0",
            "--ports-file",
            str(ports_file),
        ),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
        cwd=ROOT,
    )
    try:
        port = bound_ports(ports_file, serve, "epd serve --colocate")["grpc"]
        deadline = time.monotonic() + 180
        while not is_serving(f"127.0.0.1:{port}", timeout_s=1.0):
            assert serve.poll() is None and time.monotonic() < deadline, "epd serve --colocate did not start"
            time.sleep(0.2)
        assert uses_tcmalloc(serve.pid) == (find_tcmalloc() is not None)
        with EpdClient(f"127.0.0.1:{port}", timeout_s=300) as client:
            for _ in range(2):
                client.ask(media_files["mp4"], QUESTION, num_frames=8, max_new_tokens=4)
            time.sleep(2.0)  # past the idle release of the warm-up's memory
            idle = rss_bytes(serve.pid)
            result = client.ask(big, QUESTION, num_frames=64, max_pixels=1280 * 720, max_new_tokens=4)
            assert result.num_frames == 64
        # Released at the first idle half-second after the work; a few seconds is plenty.
        settle_by = time.monotonic() + 5.0
        while (after := rss_bytes(serve.pid)) > idle * (1 + MAX_GROWTH) and time.monotonic() < settle_by:
            time.sleep(0.25)
        print(
            f"colocated RSS idle -> after a 64-frame 720p request: {idle / 2**20:.0f} -> {after / 2**20:.0f} MiB"
        )
        assert after <= idle * (1 + MAX_GROWTH), f"{idle / 2**20:.0f} -> {after / 2**20:.0f} MiB"
    finally:
        serve.send_signal(signal.SIGINT)
        serve.wait(timeout=60)
