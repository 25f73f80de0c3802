"""No memory held between requests: after one large request, every serving process's RSS returns
to within 10% of its idle level (issue #22, item 4).

Before, the encoder kept the last large request's decoded frames (a request and its decode tasks
pointed at each other, so only Python's cyclic GC, which may not run for many requests, freed
them): one 96-frame 720p request left it ~270 MB (+37%) above idle.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from epd.client import EpdClient
from tests.media import make_video

QUESTION = "what colour is the circle?"
MAX_GROWTH = 0.10


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


@pytest.fixture(scope="module")
def stack(shared_stack):
    return shared_stack


def test_rss_returns_to_idle_after_a_large_request(stack, media_files, tmp_path):
    # 64 frames of 1280x720 are ~180 MB of RGB: more than 10% of any process's idle RSS.
    big = Path(make_video(tmp_path / "big.mp4", size=(1280, 720), fps=30.0, seconds=3.0, gop=30))
    with EpdClient(stack.gateway, timeout_s=300) as client:
        for _ in range(2):  # first requests allocate what every later one reuses (kernels, pools)
            client.ask(media_files["mp4"], QUESTION, num_frames=8, max_new_tokens=4)
        idle = {name: rss_bytes(proc.pid) for name, proc in stack.procs.items()}
        result = client.ask(big, QUESTION, num_frames=64, max_pixels=1280 * 720, max_new_tokens=4)
        assert result.num_frames == 64
        # The gateway answers once the last token is out; stages finish tidying just after.
        time.sleep(1.0)
        after = {name: rss_bytes(proc.pid) for name, proc in stack.procs.items()}
    change = {name: f"{idle[name] / 2**20:.0f} -> {after[name] / 2**20:.0f} MiB ({after[name] / idle[name] - 1:+.1%})"
              for name in idle}
    print("RSS idle -> after a 64-frame 720p request:", change)  # docs/benchmarks.md quotes it (pytest -s)
    grown = {name: change[name] for name in idle if after[name] > idle[name] * (1 + MAX_GROWTH)}
    assert grown == {}, f"RSS still above idle + {MAX_GROWTH:.0%} after a large request: {grown}"
