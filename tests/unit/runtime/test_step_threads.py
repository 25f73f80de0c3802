"""--num-threads auto: with the stack's shared board, a call takes the cores divided by the stages
busy at that moment; without one, every core for a call that serves one request with nothing else
waiting, one thread otherwise; a fixed count stays fixed. One OpenMP team a process: only the model
threads (the first of a colocated server's) run torch on more than one thread. And the flag's
parsing, and the OpenMP wait policy of processes sharing the cores."""

from __future__ import annotations

import argparse
import os

import pytest
import torch

from epd.cli.flags.arg_types import num_threads
from epd.model_runtime.threads import (
    AUTO,
    StepThreads,
    new_board_path,
    remove_board,
    shared_cores_environment,
)


def test_with_a_board_each_call_takes_the_cores_the_other_stages_leave():
    board = new_board_path()
    try:
        encoder, prefill, decode = (
            StepThreads(AUTO, stage, board) for stage in ("encoder", "prefill", "decode")
        )
        for t in (encoder, prefill, decode):
            t.cores = 4
        assert prefill.for_step(16, 0) == 4, "nobody else busy: every core, whatever the batch"
        encoder.board.set_busy(True)
        assert prefill.for_step(1, 0) == 2
        decode.board.set_busy(True)
        assert prefill.for_step(1, 0) == 1
        encoder.done()
        decode.done()
        assert prefill.for_step(1, 0) == 4, "done() clears the stage's byte"
        assert encoder.for_step(1, 0) == 4
        # Decode's steps take one thread on a shared host, busy board or not (threads.py says why).
        assert decode.for_step(1, 0) == 1 and decode.for_step(32, 0) == 1
    finally:
        remove_board(board)


def test_without_a_board_auto_follows_this_stage_queue(monkeypatch):
    monkeypatch.delenv("EPD_THREADS_BOARD", raising=False)
    t = StepThreads(AUTO, "decode")
    assert t.board is None
    t.cores = 8
    assert t.for_step(1, 0) == 8
    assert t.for_step(1, 3) == 1, "others wait: the other processes are busy too"
    assert t.for_step(4, 0) == 1


def test_a_fixed_count_stays_and_apply_sets_torch_only_on_change():
    before = torch.get_num_threads()
    try:
        assert StepThreads(3).for_step(16, 9) == 3
        t = StepThreads(AUTO)
        t.cores = 2
        t.apply(1, 0)
        assert torch.get_num_threads() == 2 and t.current == 2
        t.apply(5, 0)
        assert torch.get_num_threads() == 1 and t.current == 1
    finally:
        torch.set_num_threads(before)


def test_the_flag_takes_a_count_or_auto():
    assert num_threads("auto") == AUTO and num_threads("4") == 4
    for bad in ("0", "-1", "many"):
        with pytest.raises(argparse.ArgumentTypeError, match="positive number or auto"):
            num_threads(bad)


# -- one process's model threads running several calls at once (`epd serve --colocate`) ----------


def test_each_call_takes_the_cores_divided_by_the_calls_running():
    from epd.model_runtime.threads import CallThreads

    threads = CallThreads(cores=4)
    assert [threads.for_call(n) for n in (1, 2, 3, 4, 8)] == [4, 2, 1, 1, 1]
    before = torch.get_num_threads()
    try:
        assert threads.enter() == 4 and torch.get_num_threads() == 4, "alone: every core"
        assert threads.enter() == 2 and torch.get_num_threads() == 2, "a second call beside it: half"
        threads.exit()
        threads.exit()
        assert threads.enter() == 4, "both left: the next call alone gets every core again"
        threads.exit()
    finally:
        torch.set_num_threads(before)


def test_the_model_threads_set_each_calls_threads_from_the_calls_running():
    import asyncio
    import threading

    from epd.model_runtime.threads import CallThreads
    from epd.stages.model_thread import ModelThread

    before = torch.get_num_threads()
    pool = ModelThread(workers=2, call_threads=CallThreads(cores=4))
    started, release = threading.Event(), threading.Event()

    def held() -> int:
        n = torch.get_num_threads()
        started.set()
        assert release.wait(30)
        return n

    async def scenario():
        first = asyncio.ensure_future(pool.run(held))
        assert await asyncio.to_thread(started.wait, 30)
        beside = await pool.run(torch.get_num_threads)  # runs while `held` holds the other worker
        release.set()
        return await first, beside, await pool.run(torch.get_num_threads)

    try:
        # the call beside it runs on the second model thread: one torch thread (one OpenMP team a process)
        assert asyncio.run(asyncio.wait_for(scenario(), 30)) == (4, 1, 4)
    finally:
        release.set()
        pool.close()
        torch.set_num_threads(before)


def test_only_the_first_model_thread_runs_a_call_on_more_than_one_torch_thread():
    """libgomp keeps one team of workers per OS thread that runs a parallel operation; with more
    workers than cores every idle worker sleeps (threads.py): the second model thread stays on one."""
    from epd.model_runtime.threads import CallThreads

    threads = CallThreads(cores=4)
    before = torch.get_num_threads()
    try:
        assert threads.enter(1) == 1, "alone on the second model thread: still one"
        assert threads.enter(0) == 2, "the first beside it: the cores divided by the calls running"
        threads.exit()
        threads.exit()
        assert threads.enter(0) == 4
        threads.exit()
    finally:
        torch.set_num_threads(before)


def test_a_call_that_runs_alone_runs_on_the_first_model_thread():
    import asyncio
    import threading

    from epd.stages.model_thread import ModelThread

    pool = ModelThread(workers=3)

    async def one_at_a_time() -> list[str]:
        return [await pool.run(lambda: threading.current_thread().name) for _ in range(6)]

    async def single_ones() -> list[str]:  # steps on one torch thread leave the first free
        return [await pool.run_single("decode", lambda: threading.current_thread().name) for _ in range(3)]

    try:
        assert asyncio.run(asyncio.wait_for(one_at_a_time(), 30)) == ["model_0"] * 6
        assert asyncio.run(asyncio.wait_for(single_ones(), 30)) == ["model_2"] * 3
    finally:
        pool.close()


def test_a_pinned_thread_keeps_its_count_when_another_thread_sets_one_later():
    """torch sets a thread's count at its first parallel operation from the count another thread
    set last; a pinned thread has taken that step already."""
    import threading

    from epd.model_runtime.threads import pin_torch_threads

    before = torch.get_num_threads()
    pinned, other_set, seen = threading.Event(), threading.Event(), []

    def model_thread() -> None:
        pin_torch_threads(3)
        pinned.set()
        assert other_set.wait(30)
        torch.ones(1 << 17).add_(1)  # a parallel operation, as a model call's first
        seen.append(torch.get_num_threads())

    worker = threading.Thread(target=model_thread)
    try:
        worker.start()
        assert pinned.wait(30)
        torch.set_num_threads(1)  # e.g. the event loop's own pin, after the model thread's
        other_set.set()
        worker.join(30)
        assert seen == [3]
    finally:
        other_set.set()
        torch.set_num_threads(before)


def test_the_encoders_request_drivers_run_torch_on_one_thread(tiny_models):
    """Each frame group's preprocessing runs on a driver thread: one torch thread there, so the
    encoder's only OpenMP team is its model thread's."""
    import asyncio

    from epd.encoder_svc.config import EncoderConfig
    from epd.encoder_svc.engine import EncoderEngine
    from epd.encoder_svc.stage import LocalEncodeStage
    from epd.model_runtime.config import ModelConfig
    from epd.model_runtime.loader import load_adapter
    from epd.stages.model_thread import ModelThread

    model = ModelConfig(model=str(tiny_models["qwen2_vl"]))
    before = torch.get_num_threads()
    stage = LocalEncodeStage(
        EncoderEngine(EncoderConfig(model=model), load_adapter(model, "encoder")), ModelThread()
    )
    try:
        torch.set_num_threads(2)  # the count new threads would take from the last one set
        assert asyncio.run(stage.drivers.run(lambda cancel: torch.get_num_threads())) == 1
    finally:
        stage.close()  # its request drivers and decode workers
        stage.model_thread.close()
        torch.set_num_threads(before)


def test_processes_sharing_the_cores_get_passive_openmp_waits_unless_the_operator_chose():
    """The loopback stack's model processes: libgomp's idle threads sleep instead of spinning
    (CPU the other stages need); an operator's own OMP_WAIT_POLICY or GOMP_SPINCOUNT stays."""
    assert shared_cores_environment({"PATH": "/bin"}) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert shared_cores_environment({"OMP_WAIT_POLICY": "ACTIVE"}) == {}
    assert shared_cores_environment({"GOMP_SPINCOUNT": "10000"}) == {}


_RENICE_SCRIPT = """
import os, threading
from epd.model_runtime.threads import lower_cpu_priority
started, stop = threading.Event(), threading.Event()
before = threading.Thread(target=lambda: (started.set(), stop.wait()))
before.start(); started.wait()
lower_cpu_priority(3)
after = threading.Thread(target=stop.wait); after.start()
print(sorted(os.getpriority(os.PRIO_PROCESS, int(tid)) for tid in os.listdir("/proc/self/task")))
stop.set()
"""


def test_a_lower_cpu_priority_reaches_the_threads_already_running_and_those_started_later():
    """Linux keeps a nice value per thread: `os.nice` would leave a thread started before it (gRPC's,
    OpenMP's) at the old priority. Run in a child process: a process cannot raise its priority back."""
    import subprocess
    import sys

    from tests.stack import ROOT, child_env

    base = os.getpriority(os.PRIO_PROCESS, 0)
    out = subprocess.run(
        [sys.executable, "-c", _RENICE_SCRIPT],
        capture_output=True,
        text=True,
        check=True,
        env=child_env(),
        cwd=ROOT,
        timeout=60,
    ).stdout
    assert out.strip() == str([min(base + 3, 19)] * 3)  # the main thread, one before, one after


@pytest.mark.parametrize("role", ["encoder", "prefill", "decode"])
def test_a_model_service_leaves_its_event_loop_thread_one_torch_thread(tiny_models, role):
    """The event loop's thread moves tensors (requests, KV caches) and runs no model call: one
    torch thread, so it never starts a second OpenMP team beside the model thread's."""
    import asyncio
    import importlib
    from dataclasses import replace

    from epd.model_runtime.config import ModelConfig
    from epd.model_runtime.threads import AUTO
    from epd.stages.server_config import ServerConfig

    server = importlib.import_module(f"epd.{role}_svc.server")
    config_module = importlib.import_module(f"epd.{role}_svc.config")
    config_class = next(getattr(config_module, n) for n in dir(config_module) if n.lower() == f"{role}config")
    config = replace(
        config_class(),
        model=ModelConfig(model=str(tiny_models["qwen2_vl"]), num_threads=AUTO),
        server=ServerConfig(port=0),
    )

    async def scenario() -> int:
        torch.set_num_threads(2)
        hs = await server.start(config)
        try:
            return torch.get_num_threads()
        finally:
            await hs.stop(0)

    before = torch.get_num_threads()
    try:
        assert asyncio.run(asyncio.wait_for(scenario(), 120)) == 1
    finally:
        torch.set_num_threads(before)


def test_the_colocated_pipeline_leaves_its_caller_one_torch_thread(tiny_models):
    """`epd serve --colocate` builds the pipeline on its event loop's thread: the model loads on the
    first model thread, and the caller keeps one torch thread (no OpenMP team of its own)."""
    import asyncio

    from epd.gateway.embedded import build_embedded_pipeline
    from epd.model_runtime.config import ModelConfig
    from epd.model_runtime.threads import AUTO, num_cores

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    pipeline = build_embedded_pipeline(ModelConfig(model=str(tiny_models["qwen2_vl"]), num_threads=AUTO))
    thread = pipeline.encoder.model_thread
    try:
        assert torch.get_num_threads() == 1
        assert asyncio.run(thread.run(torch.get_num_threads)) == num_cores(), "a call alone: every core"
    finally:
        pipeline.close()
        torch.set_num_threads(before)


def test_a_fixed_count_holds_on_every_model_thread_of_the_colocated_pipeline(tiny_models):
    """`--num-threads N` keeps N for every call, also on the second model thread, which takes its
    count when it starts (not from the caller's one thread, set after the model loads)."""
    import asyncio

    from epd.gateway.embedded import build_embedded_pipeline
    from epd.model_runtime.config import ModelConfig

    before = torch.get_num_threads()
    pipeline = build_embedded_pipeline(ModelConfig(model=str(tiny_models["qwen2_vl"]), num_threads=2))
    thread = pipeline.encoder.model_thread
    try:
        assert torch.get_num_threads() == 1, "the caller runs no model call"
        assert asyncio.run(thread.run_single("decode", torch.get_num_threads)) == 2, "the last model thread"
        assert asyncio.run(thread.run(torch.get_num_threads)) == 2, "the first"
    finally:
        pipeline.close()
        torch.set_num_threads(before)
