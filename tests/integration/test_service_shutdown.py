"""Each model service closes what it holds after its drain, its model thread last
(`HealthyServer.closers`), so that no thread of ours is left running when it exits.

Why: `epd serve` leaves by `os._exit`, so a thread left running costs nothing today; but a daemon
thread inside a torch call when the interpreter finalizes aborts the process ("terminate called
without an active exception", `epd.stages.model_thread`), and any change that exits normally would
hit it. Only the encoder closed its decode workers and request drivers; every model thread, prefill's
tokenizer thread and decode's KV channels were left to the exit.

How: a real stack serves a request (a /tokenize too: prefill's tokenizer thread starts at the first)
and gets SIGTERM; each service (the gateway too) names the threads still running after it stopped,
in its log (`epd.cli.serve._log_threads_left`), and must name none, and exit 0.
"""

from __future__ import annotations

import json
import signal
import subprocess
import urllib.request

import grpc
import pytest

from epd.client import EpdClient
from tests.stack import ROOT, Stack, child_env, epd_command, stage_replica, wait_until_serving


def test_each_model_service_closes_its_threads_after_the_drain(tiny_models, media_files, tmp_path):
    stack = Stack(tiny_models["qwen2_vl"], tmp_path / "logs", http=True)
    with stack:
        with EpdClient(stack.gateway) as client:
            result = client.ask(
                media_files["mp4"], "what colour is the shape?", num_frames=4, max_new_tokens=3
            )
        assert result.answer is not None
        body = json.dumps({"prompt": "a red circle"}).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{stack.http_port}/tokenize", body, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=120) as answer:
            assert json.load(answer)["count"] > 0
    for role in ("encoder", "prefill", "decode", "gateway"):
        log = (tmp_path / "logs" / f"{role}.log").read_text()
        assert "threads still running after the service stopped" not in log, f"{role}:\n{log[-3000:]}"
        assert "after the drain failed" not in log, f"{role}:\n{log[-3000:]}"
        assert stack.procs[role].returncode == 0, (
            f"{role} exit status {stack.procs[role].returncode}:\n{log[-3000:]}"
        )


SLOW_REGEX = "a*" * 10000
"""A regex xgrammar compiles for many minutes (half as long, 5000 repeats, ran over 200 s on the
tiny vocabulary on the 2-core VM), far past the close's one deadline (`--close-timeout-s`, 30 s
by default, CLOSE_TIMEOUT_S here) and the tests' hang guards, within the 64 KiB a spec may have."""
CLOSE_TIMEOUT_S = "2"
"""The processes' close deadline here (`--close-timeout-s`): the same waits and warnings as the
default's 30 s, in a fraction of the time."""


def test_prefill_with_a_compile_still_running_names_it_and_exits_within_its_close(tiny_models, tmp_path):
    """A structured output's compile cannot be stopped (xgrammar), and one past its deadline
    (`--structured-compile-timeout-s`) is left running on its thread. SIGTERM: the prefill service
    waits for it within its close's one deadline (`close_in_turn`, after the tokenizer threads and
    the model thread; --close-timeout-s), names it in a WARNING when the deadline passes, and exits 0 anyway
    (`os._exit`, which does not wait for the thread). Before, the close did not know the compile
    threads: it neither waited for nor named them. The exit is awaited with the launcher's bound
    for a service's stop (a hang guard, not a timing assertion)."""
    from epd.cli.launcher import stop_wait_s
    from epd.model_runtime.sampling import StructuredOutputs
    from epd.transport.convert import structured_to_proto
    from epd.v1 import prefill_pb2, prefill_pb2_grpc

    flags = (
        "--structured-compile-timeout-s",
        "0.5",
        "--grace-period",
        "0",
        "--close-timeout-s",
        CLOSE_TIMEOUT_S,
    )
    with stage_replica("prefill", tiny_models["qwen2_vl"], tmp_path, *flags) as (address, proc):
        wait_until_serving(address, proc)
        request = prefill_pb2.CompileStructuredOutputsRequest(
            structured_outputs=structured_to_proto(StructuredOutputs(regex=SLOW_REGEX)), request_id="slow"
        )
        with grpc.insecure_channel(address) as channel:
            with pytest.raises(grpc.RpcError) as refused:
                prefill_pb2_grpc.PrefillServiceStub(channel).CompileStructuredOutputs(request, timeout=120)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
        assert "compile" in refused.value.details(), refused.value.details()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=stop_wait_s(0, float(CLOSE_TIMEOUT_S)) + 60)
    log = (tmp_path / "prefill-2.log").read_text()
    assert code == 0, log[-3000:]
    assert "grammar compile threads grammar_compile_0 still compile after close" in log, log[-3000:]
    assert "threads still running after the service stopped: grammar_compile_0\n" in log, log[-3000:]


def test_ask_embedded_with_a_compile_still_running_exits_after_its_error(tiny_models):
    """`epd ask` (embedded) leaves through the interpreter's exit, which joined every
    `ThreadPoolExecutor` thread, a compile past its deadline too: it printed the constraint's
    error, then waited for the compile to end (minutes) before exiting. The compile threads are
    daemons now (as the model threads), and `epd ask` closes its pipeline once the error is
    printed: the compile is waited for within the close's one deadline (--close-timeout-s) and
    named in a warning, once (the exit hooks find nothing left to wait for again). The run is
    bounded only as a hang guard (the compile runs far longer)."""
    argv = [
        "ask",
        "--no-video",
        "what is it?",
        "--model",
        str(tiny_models["qwen2_vl"]),
        "--regex",
        SLOW_REGEX,
    ]
    try:
        proc = subprocess.run(
            epd_command(*argv, "--structured-compile-timeout-s", "0.5", "--close-timeout-s", CLOSE_TIMEOUT_S),
            capture_output=True,
            text=True,
            env=child_env(),
            cwd=ROOT,
            timeout=150,
        )
    except subprocess.TimeoutExpired as exc:  # its command line holds the 20 000-character regex
        pytest.fail(f"epd ask did not exit after its error: the compile held it\n{str(exc.stderr)[-3000:]}")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "epd: INVALID_ARGUMENT: the structured-output regex took longer than 0.5 s" in proc.stderr
    assert proc.stderr.count("grammar compile threads grammar_compile_0 still compile after close") == 1, (
        proc.stderr
    )
