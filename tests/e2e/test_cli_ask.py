"""`epd ask` as a user runs it, embedded, in subprocesses: its JSON, its progress and its answer on a
terminal, --regex, a messages file, --pruning, a reader that went away, a missing file.

A fresh interpreter (`run_epd`) where the process as a user starts it is under test: the embedded
JSON run (conftest's `embedded_json`, which tests/e2e/test_cli_serve.py reads too), the terminal
run on the default model, the refusals of bad arguments. The others check what `epd ask` does and
prints: forked from the session's zygote (`run_epd_forked`: the same `main`, without importing
torch again)."""

from __future__ import annotations

import json
import re
import signal
import subprocess

import pytest

from epd.cli.mkl_dispatch import find_compiler
from tests.e2e.cli_runs import QUESTION, embedded_ask_args, run_epd
from tests.reference import decode_for_test, reference_tokens_for_messages
from tests.stack import ROOT, child_env, epd_command, run_epd_forked


def test_ask_embedded_json(embedded_json, expected):
    out = embedded_json
    assert out["token_ids"] == expected
    assert out["num_frames"] == 8
    assert out["num_visual_tokens"] > 0
    assert {"video_decode", "encode", "prefill", "kv_transfer", "generate", "ttft", "total"} <= set(
        out["timings_ms"]
    )
    assert out["timings_ms"]["decode"] == out["timings_ms"]["video_decode"]  # the old name, until 0.3
    assert len(out["grid_thw"]) == 3 and out["num_prompt_tokens"] > 0 and len(out["frame_timestamps_s"]) == 8
    assert [e["stage"] for e in out["events"]][:1] == ["video_decode"]


def test_ask_with_a_regex_answers_text_it_matches(tiny_models, media_files):
    """Structured outputs from the command line (embedded): the answer keeps to --regex and ends
    when it is complete, well within --max-new-tokens."""
    regex = "(red|green|blue) (circle|square)"
    args = embedded_ask_args(tiny_models, media_files)
    args[args.index("--max-new-tokens") + 1] = "32"
    # forked from the session's zygote: what `epd ask` does with the flag, not its start-up
    proc = run_epd_forked(*args, "--regex", regex)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert re.fullmatch(regex, result["answer"]) and result["finish_reason"] == "stop", result
    proc = run_epd_forked(*args, "--regex", "(a")
    assert proc.returncode != 0 and "the structured-output regex does not compile" in proc.stderr


def test_ask_embedded_text_streams_progress(tiny_models, media_files):
    proc = run_epd_forked(
        "ask",
        str(media_files["mp4"]),
        QUESTION,
        "--model",
        str(tiny_models["qwen2_vl"]),
        "--num-frames",
        "4",
        "--max-new-tokens",
        "4",
    )
    assert proc.returncode == 0, proc.stderr
    assert (
        "[video_decode] done" in proc.stderr
        and "[encode] done" in proc.stderr
        and "[prefill] done" in proc.stderr
    )
    assert "video_decode" in proc.stderr.splitlines()[-1] and "ttft" in proc.stderr.splitlines()[-1]


def test_ask_shows_the_answer_whole_on_a_terminal():
    """README's first question on the default model, stdout and stderr on one stream as a terminal
    shows them. The first token ("t" of "three") leaves with prefill's answer, before the
    kv_transfer event: stage lines that come once the answer has begun wait for its end instead of
    cutting it in two."""
    proc = subprocess.run(
        epd_command("ask", "samples/sample.mp4", "how many objects are there in the video?"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=child_env(),
        cwd=ROOT,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout
    lines = proc.stdout.splitlines()
    assert "three" in lines, proc.stdout
    kv_done = next(i for i, line in enumerate(lines) if "[kv_transfer] done" in line)
    assert lines.index("three") < kv_done and "epd: 6 frames" in lines[-1]


def test_ask_embedded_messages_file_keeps_the_part_order(tiny_models, media_files, tmp_path):
    """--messages FILE: text before the video, as the model's template renders it."""
    messages = [{"role": "user", "content": [{"type": "text", "text": QUESTION}, {"type": "video"}]}]
    path = tmp_path / "messages.json"
    path.write_text(json.dumps(messages))
    proc = run_epd_forked(
        "ask",
        str(media_files["mp4"]),
        "--messages",
        str(path),
        "--model",
        str(tiny_models["qwen2_vl"]),
        "--num-frames",
        "8",
        "--max-new-tokens",
        "12",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    video = decode_for_test(media_files["mp4"], 8)
    assert json.loads(proc.stdout)["token_ids"] == reference_tokens_for_messages(
        tiny_models["qwen2_vl"], video, messages, 12
    )
    both = run_epd("ask", str(media_files["mp4"]), QUESTION, "--messages", str(path))
    assert both.returncode == 2 and "give a QUESTION or --messages FILE" in both.stderr


def test_ask_missing_file_fails_clearly(tmp_path):
    proc = run_epd("ask", str(tmp_path / "nope.mp4"), QUESTION)
    assert proc.returncode == 2
    assert "no such file" in proc.stderr


def test_ask_whose_reader_has_gone_stops_quietly(tiny_models, media_files):
    """`epd ask ... | head -1`, `| true`: the answer's reader closed the pipe. That is no server's
    failure; it printed "INTERNAL: internal error; the server log has details" (a log no server
    wrote) and exit 1. Now nothing on stderr, and the exit status of a process a closed pipe stops."""
    proc = subprocess.Popen(
        epd_command(*embedded_ask_args(tiny_models, media_files)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(),
        cwd=ROOT,
    )
    proc.stdout.close()  # before the model has loaded: the answer is written to a closed pipe
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 128 + signal.SIGPIPE, err
    assert "INTERNAL" not in err and "Traceback" not in err and "Exception ignored" not in err, err


@pytest.mark.skipif(find_compiler() is None, reason="no C compiler (cc, gcc or $CC) to build its library")
def test_ask_with_mkl_dispatch_features_preloads_mkls_library(tiny_models, media_files, expected, tmp_path):
    """`epd ask --mkl-dispatch features` (embedded: the model runs in its own process) builds the
    library into the user's cache and runs itself again with it preloaded, as `epd serve` does: the
    process that loads the model says MKL's kernels go by the CPU's instruction set (its vendor
    check, looked up as MKL's calls find it, answers yes: the library is mapped there), and its
    answer equals generate()'s without the library on this model and clip."""
    from epd.cli.mkl_dispatch import shim_path
    from epd.model_runtime.mkl_kernels import GENERIC_KERNELS, mkl_kernels

    env = {**child_env(), "EPD_CACHE_DIR": str(tmp_path)}
    env.pop("LD_PRELOAD", None)
    proc = subprocess.run(
        epd_command("--log-level", "INFO", *embedded_ask_args(tiny_models, media_files),
                    "--mkl-dispatch", "features"),
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=180,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["token_ids"] == expected
    assert shim_path(tmp_path).is_file()
    # The model process's start-up note. Where MKL picks generic kernels (this test process, a CPU
    # that is not Intel's), only the preloaded library makes it say "by the CPU's instruction set".
    if mkl_kernels() == GENERIC_KERNELS:
        assert "MKL kernels: by the CPU's instruction set" in proc.stderr, proc.stderr
    assert "MKL kernels: " in proc.stderr and "(generic: MKL's choice" not in proc.stderr, proc.stderr


def test_ask_with_pruning_preset_reports_savings(tiny_models, media_files, embedded_json):
    off = embedded_json  # the same request without --pruning
    proc = run_epd_forked(
        *embedded_ask_args(tiny_models, media_files),
        "--pruning",
        "balanced",
        "--pruning-knob",
        "prefill_drop_layer=1",
    )
    assert proc.returncode == 0, proc.stderr
    on = json.loads(proc.stdout)
    assert off["pruning"]["stages"] == []
    assert {s["stage"] for s in on["pruning"]["stages"]} >= {"prefill_drop", "kv_compress"}
    assert on["kv_num_bytes"] < off["kv_num_bytes"]


def test_ask_with_bad_pruning_knob_fails_clearly(tiny_models, media_files):
    proc = run_epd_forked(
        "ask",
        str(media_files["mp4"]),
        QUESTION,
        "--model",
        str(tiny_models["qwen2_vl"]),
        "--pruning-knob",
        "kv_keep_ratio=2",
    )
    assert proc.returncode == 1
    assert "INVALID_ARGUMENT" in proc.stderr and "kv_keep_ratio must be in (0, 1]" in proc.stderr
