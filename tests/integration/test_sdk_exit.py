"""A script that uses the blocking SDK client (`EpdClient`, whose event loop runs on its own
`epd-client` thread) and exits without closing it exits 0, promptly, with nothing on stderr: after
a call, after breaking out of a stream, and with a stream left half read.

How: each case runs in a child Python against a real stack (the session's `shared_stack`). The
child's stderr must be empty: no "terminate called", no exception from a thread, no "Exception
ignored" from a channel or a generator finalized late. `CHILD_TIMEOUT_S` is a deadline for a hang,
not a timing assertion.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.stack import ROOT, child_env

CHILD_TIMEOUT_S = 120.0

CHILD = r"""
import sys
from epd.client import EpdClient

mode, address, media = sys.argv[1:4]
LONG = dict(num_frames=4, max_new_tokens=4000, ignore_eos=True)  # still generating when the child leaves
client = EpdClient(address)
if mode == "after-a-call":
    print(client.ask(media, "what colour is the shape?", num_frames=4, max_new_tokens=3).answer)
elif mode == "broke-out-of-a-stream":
    for event in client.stream(media, "what colour is the shape?", **LONG):
        print(type(event).__name__)
        break
elif mode == "stream-half-read":
    events = client.stream(media, "what colour is the shape?", **LONG)
    print(type(next(events)).__name__)
print("leaving", flush=True)
"""


@pytest.mark.parametrize("mode", ["after-a-call", "broke-out-of-a-stream", "stream-half-read"])
def test_a_script_that_never_closes_its_client_exits_cleanly(mode, shared_stack, media_files):
    child = subprocess.run(
        [sys.executable, "-c", CHILD, mode, shared_stack.gateway, str(media_files["mp4"])],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
    )
    assert child.returncode == 0, f"exit status {child.returncode}: {child.stderr[-3000:]}"
    assert child.stdout.endswith("leaving\n"), child.stdout
    assert child.stderr == "", child.stderr[-3000:]
