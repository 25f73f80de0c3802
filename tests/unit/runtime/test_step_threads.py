"""--num-threads auto: with the stack's shared board, a call takes the cores divided by the stages
busy at that moment; without one, every core for a call that serves one request with nothing else
waiting, one thread otherwise; a fixed count stays fixed. And the flag's parsing, and the OpenMP wait
policy of processes sharing the cores."""

from __future__ import annotations

import argparse

import pytest
import torch

from epd.cli.main import _num_threads
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
        encoder, prefill, decode = (StepThreads(AUTO, stage, board) for stage in ("encoder", "prefill", "decode"))
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
    assert _num_threads("auto") == AUTO and _num_threads("4") == 4
    for bad in ("0", "-1", "many"):
        with pytest.raises(argparse.ArgumentTypeError, match="positive number or auto"):
            _num_threads(bad)


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
        assert asyncio.run(asyncio.wait_for(scenario(), 30)) == (4, 2, 4)
    finally:
        release.set()
        pool.close()
        torch.set_num_threads(before)


def test_processes_sharing_the_cores_get_passive_openmp_waits_unless_the_operator_chose():
    """The loopback stack's model processes: libgomp's idle threads sleep instead of spinning
    (CPU the other stages need); an operator's own OMP_WAIT_POLICY or GOMP_SPINCOUNT stays."""
    assert shared_cores_environment({"PATH": "/bin"}) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert shared_cores_environment({"OMP_WAIT_POLICY": "ACTIVE"}) == {}
    assert shared_cores_environment({"GOMP_SPINCOUNT": "10000"}) == {}
