"""A process that ran model calls exits cleanly, closed or not: no model thread (nor video decode
worker) is left running when the interpreter finalizes, and the process does not abort.

Why: the model threads are daemons. One still inside a torch call when the interpreter finalizes
is ended by pthread_exit as the call returns and asks for the GIL; the unwinding through torch's
C++ frames aborts the process ("terminate called without an active exception", SIGABRT). A script
that left an answer while its prefill ran and then exited, with the pipeline closed or not,
aborted about half the time: `ModelThread.close` did not wait for the call running, and nothing
stopped a pipeline never closed.

How: each case runs in a child Python, which registers an atexit hook before importing epd
(atexit runs the last registered first, so the hook runs after epd's own) that lists the epd
threads still alive. The child leaves a model call running when it ends: its caller's task is
cancelled by `asyncio.run`'s end, and the call goes on (`BUSY_S` of torch matrix products); or
the video decode threads (whose frame resize is torchvision's) inside such a resize.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CHILD_TIMEOUT_S = 120.0

CHILD = r"""
import atexit, sys, threading

def report():  # registered before epd is imported: runs after epd's atexit handlers
    alive = sorted(t.name for t in threading.enumerate() if t.name.startswith(("model_", "video-decode")))
    print("alive at exit: " + ",".join(alive), flush=True)

atexit.register(report)

import asyncio, time
from pathlib import Path
import torch

BUSY_S = 1.0
mode, model, media = sys.argv[1:4]
started = threading.Event()

def busy():  # a model step that is still running when its caller is gone
    started.set()
    a = torch.randn(256, 256)
    end = time.monotonic() + BUSY_S
    while time.monotonic() < end:
        torch.mm(a, a)

async def leave_a_call_running(pool):
    asyncio.ensure_future(pool.run(busy))  # cancelled when asyncio.run ends; the call runs on
    await asyncio.to_thread(started.wait)

if mode == "decoder-open":  # an encoder service's decode pool at its exit, frames being resized
    from epd.video.parallel_decoder import ParallelDecoder
    from epd.video.types import SamplingOptions

    def resize(rgb):  # the model's resize (torchvision) runs on the decode threads
        busy()
        return rgb

    stream = ParallelDecoder().iter_groups(Path(media).read_bytes(), SamplingOptions(num_frames=8),
                                           group_size=1, frame_resizer=lambda num_frames: resize)
    started.wait()
elif mode == "pool-closed":
    from epd.stages.model_thread import ModelThread
    pool = ModelThread(workers=2)
    asyncio.run(leave_a_call_running(pool))
    pool.close()
else:  # pipeline-open
    from epd.gateway.embedded import build_embedded_pipeline
    from epd.model_runtime.config import ModelConfig
    from tests.embedded import ask_tokens

    pipeline = build_embedded_pipeline(ModelConfig(model=model))

    async def ask_and_leave():
        tokens = await ask_tokens(pipeline, Path(media), "what colour is the shape?", 4, 4)
        await leave_a_call_running(pipeline.model_thread)
        return tokens

    print("tokens:", asyncio.run(ask_and_leave()), flush=True)
"""


def _run_child(mode: str, model: Path, media: Path) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "OMP_NUM_THREADS": "1",
    }
    return subprocess.run(
        [sys.executable, "-c", CHILD, mode, str(model), str(media)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
    )


@pytest.mark.parametrize("mode", ["pool-closed", "pipeline-open", "decoder-open"])
def test_a_process_exits_cleanly_with_a_model_call_still_running(mode, tiny_models, media_files):
    """pool-closed: `ModelThread.close()` waits for the running call; pipeline-open (a script that
    never closes its pipeline): the atexit handlers close the model threads and decode
    workers, and wait; decoder-open: the decode workers, inside a frame's resize, likewise."""
    child = _run_child(mode, tiny_models["qwen2_vl"], media_files["mp4"])
    assert "terminate called" not in child.stderr, child.stderr[-2000:]
    assert child.returncode == 0, f"exit status {child.returncode}: {child.stderr[-2000:]}"
    alive = [line for line in child.stdout.splitlines() if line.startswith("alive at exit:")]
    assert alive == ["alive at exit: "], f"epd threads alive when the interpreter finalizes: {alive}"


def test_epd_ask_in_process_ends_the_threads_it_started(tiny_models, media_files, capsys):
    """`main(["ask", ...])` embedded, in a process that goes on (a test, a notebook): its pipeline is
    closed when it returns, its model threads, decode workers and tokenizer threads ended (they
    were left to the interpreter's exit, one set per call: a test process held hundreds)."""
    import threading

    from epd.cli.main import main
    from tests import leak_check

    before = set(threading.enumerate())
    code = main(
        ["ask", str(media_files["mp4"]), "what colour is the square?", "--model", str(tiny_models["qwen2_vl"]),
         "--json", "--num-frames", "4", "--max-new-tokens", "2"]
    )  # fmt: skip
    assert code == 0, capsys.readouterr().out
    assert leak_check.threads_left(before) == []


def test_epd_ask_whose_timeout_passed_ends_the_threads_it_started(tiny_models, media_files, capsys):
    """`epd ask --timeout S`: when the question's deadline passes, one line says what to raise,
    the exit status is 124 (`EXIT_TIMEOUT`), and the cancelled request's threads end with the
    pipeline's close, in a process that goes on. The deadline (1 ms) passes during the request's
    first step, whatever the machine's speed: nothing is timed."""
    import threading

    from epd.cli.ask import EXIT_TIMEOUT
    from epd.cli.main import main
    from tests import leak_check

    before = set(threading.enumerate())
    code = main(
        ["ask", str(media_files["mp4"]), "what colour is the square?", "--model", str(tiny_models["qwen2_vl"]),
         "--num-frames", "4", "--max-new-tokens", "2", "--timeout", "0.001"]
    )  # fmt: skip
    err = capsys.readouterr().err
    assert code == EXIT_TIMEOUT == 124, err
    assert err.splitlines()[-1] == (
        "epd: no answer within 0.001 s (--timeout): raise --timeout, or ask for less (fewer "
        "--max-new-tokens, --num-frames or --max-frames)"
    ), err
    assert leak_check.threads_left(before) == []


ASK_AS_THE_CONSOLE_SCRIPT = r"""
import atexit, sys

atexit.register(lambda: print("the interpreter's teardown ran", file=sys.stderr, flush=True))
sys.argv = ["epd", *sys.argv[1:]]
from epd.cli.main import main

sys.exit(main())  # what the `epd` console script runs
"""


@pytest.mark.parametrize("timeout_s, code", [(None, 0), ("0.001", 124)], ids=["answered", "timed-out"])
def test_epd_ask_leaves_without_the_interpreters_teardown_once_it_has_printed(
    timeout_s, code, tiny_models, media_files
):
    """`epd ask` as a user runs it (the console script's `sys.exit(main())`, in a process of its own)
    leaves as `epd serve` does, by `os._exit` (`epd.cli.process_exit`), once it has printed its
    answer (or why there is none) and closed its pipeline: an exit through the interpreter's
    teardown could abort in a grammar compile or model call still running. Its answer is whole on
    stdout, its exit status the one it returned; an atexit hook registered before epd never runs."""
    import json

    args = ["ask", str(media_files["mp4"]), "what colour is the square?", "--model", str(tiny_models["qwen2_vl"]),
            "--num-frames", "4", "--max-new-tokens", "6", "--json",
            *(["--timeout", timeout_s] if timeout_s else [])]  # fmt: skip
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "OMP_NUM_THREADS": "1",
    }
    child = subprocess.run(
        [sys.executable, "-c", ASK_AS_THE_CONSOLE_SCRIPT, *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
    )
    assert child.returncode == code, child.stderr[-2000:]
    assert "the interpreter's teardown ran" not in child.stderr, child.stderr[-2000:]
    assert "Traceback" not in child.stderr and "terminate called" not in child.stderr, child.stderr[-2000:]
    if code == 0:
        answer = json.loads(child.stdout)  # one whole line: flushed before the exit
        assert child.stdout.endswith("}\n") and answer["finish_reason"] in ("stop", "length")
        assert 0 < len(answer["token_ids"]) <= 6
    else:
        assert child.stdout == "" and "(--timeout): raise --timeout" in child.stderr.splitlines()[-1]
