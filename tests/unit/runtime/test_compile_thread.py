"""The structured-output compile thread alone (`epd.model_runtime.compile_thread`): compiles run in
turn on one named daemon thread, started at the first submit; `shutdown` cancels what is queued and
lets the running compile end; nothing is taken after it."""

from __future__ import annotations

import threading

import pytest

from epd.model_runtime.compile_thread import COMPILE_THREAD_NAME, CompileThread


def test_compiles_run_in_turn_on_one_named_daemon_thread_started_at_the_first_submit():
    thread = CompileThread()
    assert thread.name.startswith(f"{COMPILE_THREAD_NAME}_") and not thread.running
    seen: list[tuple[str, bool]] = []

    def compile_one(n: int) -> int:
        current = threading.current_thread()
        seen.append((current.name, current.daemon))
        return n * 10

    futures = [thread.submit(lambda n=n: compile_one(n)) for n in range(3)]
    assert [f.result(timeout=30) for f in futures] == [0, 10, 20]
    assert seen == [(thread.name, True)] * 3
    thread.shutdown()
    thread.join(30)
    assert not thread.running


def test_an_error_reaches_its_caller_and_the_thread_goes_on():
    thread = CompileThread()

    def refuse() -> None:
        raise ValueError("does not compile")

    with pytest.raises(ValueError, match="does not compile"):
        thread.submit(refuse).result(timeout=30)
    assert thread.submit(lambda: "next").result(timeout=30) == "next"
    thread.shutdown()


def test_shutdown_cancels_the_queued_compiles_and_lets_the_running_one_end():
    thread = CompileThread()
    started, release = threading.Event(), threading.Event()

    def long_compile() -> str:
        started.set()
        release.wait(30)
        return "done"

    running = thread.submit(long_compile)
    assert started.wait(30)
    queued = thread.submit(lambda: "never")
    thread.shutdown()
    assert queued.cancelled()
    with pytest.raises(RuntimeError, match="cannot compile after the compiler closed"):
        thread.submit(lambda: "late")
    assert thread.running  # shutdown does not wait for the compile it cannot stop
    release.set()
    assert running.result(timeout=30) == "done"
    thread.join(30)
    assert not thread.running
