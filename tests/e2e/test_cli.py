"""The CLI as a user runs it, in subprocesses: `epd ask` embedded and against `epd serve`.

A fresh interpreter (`run_epd`) where the process as a user starts it is under test: the embedded
JSON run (read by three tests), the terminal run on the default model, `epd serve`, the refusals of
bad arguments. The others check what `epd ask` does and prints: forked from the session's zygote
(`run_epd_forked`: the same `main`, without importing torch again)."""

from __future__ import annotations

import json
import re
import signal
import subprocess
from pathlib import Path

import pytest

from epd.cli.allocator import find_tcmalloc, uses_tcmalloc
from epd.cli.health import is_serving
from epd.cli.mkl_dispatch import find_compiler
from tests.reference import decode_for_test, reference_tokens, reference_tokens_for_messages
from tests.stack import ROOT, bound_ports, child_env, epd_command, run_epd_forked, serving_pid

QUESTION = "what colour is the square?"


def run_epd(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        epd_command(*args), capture_output=True, text=True, env=child_env(), cwd=ROOT, timeout=timeout
    )


def embedded_ask_args(tiny_models, media_files) -> list[str]:
    """`epd ask` embedded on the clip, 8 frames, 12 tokens, --json."""
    return [
        "ask",
        str(media_files["mp4"]),
        QUESTION,
        "--model",
        str(tiny_models["qwen2_vl"]),
        "--num-frames",
        "8",
        "--max-new-tokens",
        "12",
        "--json",
    ]


@pytest.fixture(scope="module")
def embedded_json(tiny_models, media_files) -> dict:
    """What `embedded_ask_args` prints: run once (a process that imports torch and loads the model,
    ~10 s on two cores) for the three tests that read it: its own fields, the stack's answer to the
    same request (the same fields), and the pruned run's savings (the unpruned side)."""
    proc = run_epd(*embedded_ask_args(tiny_models, media_files))
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


# `epd serve --kv-budget-bytes/--kv-store-bytes` (decode's KV memory, prefill's KV store), read
# back from the gateway's /metrics: each service's own budget, as it reports it in GetLoad.
MEMORY_FLAGS = ["--kv-budget-bytes", "50000000", "--kv-store-bytes", "60000000"]
MEMORY_GAUGES = {
    ("epd_engine_memory_total_bytes", "decode"): 50_000_000,
    ("epd_kv_store_total_bytes", "prefill"): 60_000_000,
}
# `epd serve --served-model-name`, the gateway's: the id GET /v1/models lists.
SERVED_MODEL = "Qwen/Qwen2-VL-tiny"


def listed_models(http_port: int) -> list[str]:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v1/models", timeout=30) as resp:
        return [model["id"] for model in json.load(resp)["data"]]


def stage_gauges(http_port: int) -> dict[tuple[str, str], set[float]]:
    """The gateway's /metrics: each sample's values by (name, stage), over the stage's replicas."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    values: dict[tuple[str, str], set[float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if "stage" in sample.labels:
                values.setdefault((sample.name, sample.labels["stage"]), set()).add(sample.value)
    return values


@pytest.fixture(scope="module")
def expected(tiny_models, media_files):
    video = decode_for_test(media_files["mp4"], 8)
    return reference_tokens(tiny_models["qwen2_vl"], video, QUESTION, 12)


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


def test_ask_against_epd_serve(tiny_models, media_files, expected, embedded_json, tmp_path):
    """The stack as a user starts it; with the default --allocator auto its model services run on
    tcmalloc where the machine has it (CI installs it), on glibc's malloc where not. The KV memory
    flags given to `epd serve` are the budgets its decode and prefill report, and its
    --served-model-name the id its gateway's /v1/models lists."""
    ports_file = tmp_path / "stack.ports.json"
    env = child_env()
    env.pop("LD_PRELOAD", None)  # the launcher's choice, not the test runner's
    serve = subprocess.Popen(
        epd_command(
            "serve",
            "--model",
            str(tiny_models["qwen2_vl"]),
            # every port one the kernel picks: --ports-file names them
            *("--gateway-port", "0", "--encoder-port", "0", "--prefill-port", "0", "--decode-port", "0"),
            *("--http-port", "auto", "--ports-file", str(ports_file)),
            *MEMORY_FLAGS,
            "--served-model-name",
            SERVED_MODEL,
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=ROOT,
    )
    try:
        # `epd serve` prints its ready line once every service reports SERVING.
        line = serve.stdout.readline()
        while line and "stack ready" not in line:
            line = serve.stdout.readline()
        assert "stack ready" in line, "epd serve exited before it was ready"
        bound = json.loads(ports_file.read_text())
        ports = [bound["grpc"], *(bound[stage][0] for stage in ("encoder", "prefill", "decode"))]
        http_port = bound["http"]
        assert is_serving(f"127.0.0.1:{ports[0]}")
        services = [serving_pid(port) for port in ports[1:]]
        assert None not in services
        assert [uses_tcmalloc(pid) for pid in services] == [find_tcmalloc() is not None] * 3
        proc = run_epd(
            "ask",
            str(media_files["mp4"]),
            QUESTION,
            "--endpoint",
            f"127.0.0.1:{ports[0]}",
            "--num-frames",
            "8",
            "--max-new-tokens",
            "12",
            "--json",
        )
        assert proc.returncode == 0, proc.stderr
        out = json.loads(proc.stdout)
        assert out["token_ids"] == expected
        assert out["kv_num_bytes"] > 0
        # Both modes print the SDK's result: the same fields (the demo model's notice aside).
        assert set(out) == set(embedded_json) - {"notice"}
        assert out["grid_thw"] == embedded_json["grid_thw"]
        assert set(out["timings_ms"]) == set(embedded_json["timings_ms"])
        assert {e["stage"] for e in out["events"]} == {"upload", "video_decode", "encode", "prefill",
                                                       "kv_transfer", "generate"}  # fmt: skip
        gauges = stage_gauges(http_port)
        assert {key: gauges.get(key) for key in MEMORY_GAUGES} == {k: {v} for k, v in MEMORY_GAUGES.items()}
        assert listed_models(http_port) == [SERVED_MODEL]
    finally:
        serve.send_signal(signal.SIGINT)
        code = serve.wait(timeout=60)
    assert code == 0
    # Every service stopped with the stack: nothing listens any more.
    assert not any(is_serving(f"127.0.0.1:{p}", timeout_s=0.5) for p in ports)


def wait_until_serving(serve: subprocess.Popen, grpc_port: int, timeout_s: float = 180) -> None:
    """Until `epd serve --colocate` answers health checks on its gRPC port (it has no ready line)."""
    import time

    deadline = time.monotonic() + timeout_s
    while not is_serving(f"127.0.0.1:{grpc_port}", timeout_s=1.0):
        assert serve.poll() is None and time.monotonic() < deadline, "epd serve --colocate did not start"
        time.sleep(0.2)


def test_serve_colocate_is_one_process_with_the_same_apis_and_answers(
    tiny_models, media_files, expected, tmp_path
):
    """`epd serve --colocate`: the front door and the three stages in one process, on the stack's
    ports; answers equal generate()'s; /metrics shows the three in-process cores, with the KV
    memory flags' budgets, and /v1/models lists --served-model-name. With --allocator system it stays on glibc's malloc (the default's
    tcmalloc is tested with the stack above). Its stderr has no weights-loading bar, as the stack's has none."""
    import urllib.request

    import psutil

    ports_file = tmp_path / "colocated.ports.json"
    env = child_env()
    env.pop("LD_PRELOAD", None)
    stderr = tmp_path / "colocated.stderr"
    with stderr.open("wb") as err:  # the child writes to its copy
        serve = subprocess.Popen(
            epd_command("serve", "--colocate", "--allocator", "system", "--model", str(tiny_models["qwen2_vl"]),
                        "--gateway-port", "0", "--http-port", "auto", "--ports-file", str(ports_file), *MEMORY_FLAGS,
                        "--served-model-name", SERVED_MODEL),
            stdout=subprocess.DEVNULL, stderr=err, env=env, cwd=ROOT,
        )  # fmt: skip
    try:
        bound = bound_ports(ports_file, serve, "epd serve --colocate")
        grpc_port, http_port = bound["grpc"], bound["http"]
        wait_until_serving(serve, grpc_port)
        assert psutil.Process(serve.pid).children(recursive=True) == [], "one process, no services"
        assert not uses_tcmalloc(serve.pid)
        proc = run_epd("ask", str(media_files["mp4"]), QUESTION, "--endpoint", f"127.0.0.1:{grpc_port}",
                       "--num-frames", "8", "--max-new-tokens", "12", "--json")  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["token_ids"] == expected
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=30) as resp:
            text = resp.read().decode()
        from prometheus_client.parser import text_string_to_metric_families

        steps = {
            (s.labels["stage"], s.labels["replica"]): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name == "epd_engine_steps_total"
        }
        assert set(steps) == {(stage, "local") for stage in ("encoder", "prefill", "decode")}
        assert all(v > 0 for v in steps.values()), steps
        gauges = stage_gauges(http_port)
        assert {key: gauges.get(key) for key in MEMORY_GAUGES} == {k: {v} for k, v in MEMORY_GAUGES.items()}
        assert listed_models(http_port) == [SERVED_MODEL]
    finally:
        serve.send_signal(signal.SIGINT)
        code = serve.wait(timeout=60)
    assert code == 0
    assert not is_serving(f"127.0.0.1:{grpc_port}", timeout_s=0.5)
    assert "Loading weights" not in stderr.read_text(errors="replace")


@pytest.mark.skipif(find_compiler() is None, reason="no C compiler (cc, gcc or $CC) to build its library")
def test_serve_with_mkl_dispatch_features_preloads_mkls_library(tiny_models, media_files, expected, tmp_path):
    """`epd serve --colocate --mkl-dispatch features` builds its one-function library into the
    user's cache, runs itself again with it preloaded (beside tcmalloc where installed), says so
    at start-up, and answers. On this model and clip the answer equals generate()'s without the
    library (its kernels round differently, which only a near tie would show)."""
    from epd.cli.mkl_dispatch import shim_path

    ports_file = tmp_path / "colocated.ports.json"
    env = {**child_env(), "EPD_CACHE_DIR": str(tmp_path)}
    env.pop("LD_PRELOAD", None)
    serve = subprocess.Popen(
        epd_command("--log-level", "INFO", "serve", "--colocate", "--mkl-dispatch", "features", "--model",
                    str(tiny_models["qwen2_vl"]), "--gateway-port", "0", "--ports-file", str(ports_file)),
        stdout=subprocess.DEVNULL, stderr=(log := (tmp_path / "serve.log").open("w")), env=env, cwd=ROOT,
    )  # fmt: skip
    try:
        grpc_port = bound_ports(ports_file, serve, "epd serve --colocate --mkl-dispatch features")["grpc"]
        wait_until_serving(serve, grpc_port)
        library = shim_path(tmp_path)
        assert library.is_file()
        maps = (Path("/proc") / str(serve.pid) / "maps").read_text()
        assert str(library) in maps
        assert ("libtcmalloc" in maps) == (find_tcmalloc() is not None)
        proc = run_epd("ask", str(media_files["mp4"]), QUESTION, "--endpoint", f"127.0.0.1:{grpc_port}",
                       "--num-frames", "8", "--max-new-tokens", "12", "--json")  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["token_ids"] == expected
    finally:
        serve.send_signal(signal.SIGINT)
        code = serve.wait(timeout=60)
        log.close()
    err = (tmp_path / "serve.log").read_text()
    assert code == 0, err
    # The start-up note: MKL's kernels by instruction set, never its generic ones with a hint.
    assert "MKL kernels: " in err and "(generic: MKL's choice" not in err, err


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


# -- conversations: --question in turns, --interactive --------------------------------------------

FOLLOW_UP = "which appears first?"


def _conversation_reference(model_dir, media_path, questions: list[str]) -> tuple[list[list[int]], list[str]]:
    """generate()'s tokens and text for each turn of `questions` asked in turn, each prompted with
    the earlier questions and answers (the processor's chat form), as epd sends them."""
    from transformers import AutoProcessor

    tokenizer = AutoProcessor.from_pretrained(model_dir).tokenizer
    video = decode_for_test(media_path, 8)
    ids: list[list[int]] = []
    answers: list[str] = []
    messages: list[dict] = []
    for i, question in enumerate(questions):
        content = [{"type": "text", "text": question}]
        messages.append({"role": "user", "content": ([{"type": "video"}] if i == 0 else []) + content})
        ids.append(reference_tokens_for_messages(model_dir, video, messages, 12))
        answers.append(tokenizer.decode(ids[-1], skip_special_tokens=True))
        messages.append({"role": "assistant", "content": [{"type": "text", "text": answers[-1]}]})
    return ids, answers


@pytest.fixture(scope="module")
def conversation_reference(tiny_models, media_files):
    return _conversation_reference(tiny_models["qwen2_vl"], media_files["mp4"], [QUESTION, FOLLOW_UP])


def test_ask_embedded_questions_in_turns_are_one_conversation(
    tiny_models, media_files, conversation_reference
):
    """--question twice: one process, one pipeline; the second turn carries the first answer."""
    ids, answers = conversation_reference
    proc = run_epd_forked(
        "ask",
        str(media_files["mp4"]),
        "--question",
        QUESTION,
        "--question",
        FOLLOW_UP,
        "--model",
        str(tiny_models["qwen2_vl"]),
        "--num-frames",
        "8",
        "--max-new-tokens",
        "12",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    turns = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [t["turn"] for t in turns] == [1, 2] and [t["question"] for t in turns] == [QUESTION, FOLLOW_UP]
    assert [t["token_ids"] for t in turns] == ids
    assert [t["answer"] for t in turns] == answers
    assert turns[1]["encoder_cache_hit"], "the pipeline (and its caches) outlived the first turn"
    assert turns[1]["num_prompt_tokens"] > turns[0]["num_prompt_tokens"]


def test_ask_interactive_reads_questions_until_an_empty_line(
    tiny_models, media_files, conversation_reference
):
    _, answers = conversation_reference
    proc = run_epd_forked(
        "ask",
        str(media_files["mp4"]),
        "--interactive",
        "--model",
        str(tiny_models["qwen2_vl"]),
        "--num-frames",
        "8",
        "--max-new-tokens",
        "12",
        stdin=f"{QUESTION}\n{FOLLOW_UP}\n\nnot asked: after the empty line\n",
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "".join(f"{a}\n" for a in answers)
    assert sum(line.startswith("epd: 8 frames") for line in proc.stderr.splitlines()) == 2
    assert "not asked" not in proc.stderr


def test_ask_messages_cannot_be_combined_with_turns(media_files, tmp_path):
    path = tmp_path / "messages.json"
    path.write_text("[]")
    proc = run_epd("ask", str(media_files["mp4"]), "--messages", str(path), "--question", QUESTION)
    assert proc.returncode == 2 and "cannot be combined" in proc.stderr


def test_ask_no_video_is_a_text_only_conversation(tiny_models, tmp_path):
    """`epd ask --no-video QUESTION`: the question alone (no encoder: no video_decode or encode
    time), generate()'s tokens on it; with --question, a text-only conversation whose second turn
    reuses the first's prompt. Mixing it with a VIDEO or a media part is refused, saying what to change."""
    from tests.reference import text_only_reference

    model = str(tiny_models["qwen2_vl"])
    proc = run_epd_forked("ask", "--no-video", "hello, who are you?", "--question", "and then?", "--model", model,
                          "--max-new-tokens", "12", "--json")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    first, second = (json.loads(line) for line in proc.stdout.strip().splitlines())
    question = [{"role": "user", "content": [{"type": "text", "text": "hello, who are you?"}]}]
    assert first["token_ids"] == text_only_reference(tiny_models["qwen2_vl"], question, 12)
    assert first["num_visual_tokens"] == 0 and first["timings_ms"]["encode"] == 0.0
    assert first["timings_ms"]["video_decode"] == 0.0 and second["num_reused_prompt_tokens"] > 0
    with_media = tmp_path / "messages.json"
    with_media.write_text(
        json.dumps([{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "?"}]}])
    )
    for args, says in (
        (["--no-video", "samples/sample.mp4", QUESTION], "give the QUESTION alone"),
        ([QUESTION.replace(" ", "_")], "no such file"),
        (["--messages", str(with_media)], "give VIDEO, the path of a video or image"),
        (["--no-video", "--messages", str(with_media)], "give VIDEO instead of --no-video"),
    ):
        refused = run_epd_forked("ask", *args, "--model", model)
        assert refused.returncode == 2 and says in refused.stderr, (args, refused.stderr)


def test_ask_endpoint_says_which_flag_the_sdk_refuses():
    """Against --endpoint, a value the SDK's own checks refuse before any call is a usage error
    (exit 2) saying what to change; it was "INTERNAL: internal error; the server log has details",
    with no server involved (nothing listens on port 9: the check comes before connecting)."""
    for flags, says in (
        (["--top-p", "2"], "top_p must be in (0, 1]"),
        (["--max-new-tokens", "-3"], "max_new_tokens must be >= 1"),
        (["--temperature", "-1"], "temperature must be a finite number >= 0"),
        (["--logprobs", "-1"], "logprobs must be >= 0"),
    ):
        refused = run_epd_forked("ask", "--no-video", QUESTION, "--endpoint", "127.0.0.1:9", *flags)
        assert refused.returncode == 2 and says in refused.stderr, (flags, refused.stderr)
        assert "INTERNAL" not in refused.stderr and "Traceback" not in refused.stderr


def test_ask_timeout_is_each_questions_deadline_through_the_stack_too(media_files, shared_stack):
    """`epd ask --endpoint ... --timeout S`: S is each question's gRPC deadline (the SDK's
    timeout_s, which the gateway passes on to the stages); past it, one line says what to raise
    and the exit status is 124, as embedded (`test_clean_exit`), not the SDK's "raise timeout_s"
    with exit 1. A deadline of 1 ms passes before the request is through, whatever the machine;
    one of 5 minutes does not cut an answer."""
    ask = ["ask", str(media_files["mp4"]), QUESTION, "--endpoint", shared_stack.gateway, "--num-frames", "4",
           "--max-new-tokens", "4", "--json"]  # fmt: skip
    late = run_epd_forked(*ask, "--timeout", "0.001")
    assert late.returncode == 124, late.stderr
    assert late.stderr.splitlines()[-1].startswith(
        "epd: no answer within 0.001 s (--timeout): raise --timeout"
    )
    assert late.stdout == "" and "Traceback" not in late.stderr
    answered = run_epd_forked(*ask, "--timeout", "300")
    assert answered.returncode == 0, answered.stderr
    assert json.loads(answered.stdout)["finish_reason"] in ("stop", "length")


RAW_PROMPT = "Once upon a time, in a land far away,"


def test_ask_prompt_continues_a_raw_prompt_embedded_and_through_the_stack(tiny_models, shared_stack):
    """`epd ask --prompt TEXT`: no chat template, no media (no encoder: no video_decode or encode
    time), the tokens `model.generate(tokenizer(TEXT).input_ids, do_sample=False)` gives, embedded
    and against a gateway (--endpoint, the SDK's `prompt=`) alike."""
    from tests.reference import raw_reference

    model = str(tiny_models["qwen2_vl"])
    ids, want = raw_reference(model, RAW_PROMPT, 12)
    assert len(set(want)) > 2, "the tiny model repeats one token; the comparison would prove little"
    for where in (["--model", model], ["--endpoint", shared_stack.gateway]):
        proc = run_epd_forked("ask", "--prompt", RAW_PROMPT, *where, "--max-new-tokens", "12", "--json")
        assert proc.returncode == 0, (where, proc.stderr)
        out = json.loads(proc.stdout)
        assert out["token_ids"] == want, where
        assert out["num_prompt_tokens"] == len(ids) and out["num_visual_tokens"] == 0, where
        assert out["timings_ms"]["encode"] == 0.0 and out["timings_ms"]["video_decode"] == 0.0, where
    proc = run_epd_forked("ask", "--prompt", RAW_PROMPT, "--model", model, "--max-new-tokens", "4")
    assert proc.returncode == 0 and proc.stdout.strip(), proc.stderr  # the text answer, as a question's


def test_ask_logprobs_embedded_and_through_the_stack(tiny_models, shared_stack):
    """`epd ask --logprobs K --prompt-logprobs K`: the result's logprobs (--json), one per answer
    token with its K alternatives, and one per prompt token (the first with none), the same
    numbers embedded and against a gateway; as text, a table after the answer, a row per token.
    More than the server's --max-logprobs is the server's INVALID_ARGUMENT."""
    model = str(tiny_models["qwen2_vl"])
    flags = ["--max-new-tokens", "6", "--logprobs", "2", "--prompt-logprobs", "1"]
    outs = []
    for where in (["--model", model], ["--endpoint", shared_stack.gateway]):
        proc = run_epd_forked("ask", "--prompt", RAW_PROMPT, *where, *flags, "--json")
        assert proc.returncode == 0, (where, proc.stderr)
        out = json.loads(proc.stdout)
        assert [lp["token_id"] for lp in out["logprobs"]] == out["token_ids"], where
        assert all(len(lp["top"]) == 2 for lp in out["logprobs"]), where
        assert len(out["prompt_logprobs"]) == out["num_prompt_tokens"] and out["prompt_logprobs"][0] is None
        assert all(len(lp["top"]) == 1 and lp["rank"] >= 1 for lp in out["prompt_logprobs"][1:]), where
        outs.append(out)
    embedded, remote = outs
    assert embedded["token_ids"] == remote["token_ids"]
    for name in ("logprobs", "prompt_logprobs"):
        numbers = [[lp and lp["logprob"] for lp in out[name]] for out in outs]
        assert numbers[0][1:] == pytest.approx(numbers[1][1:], abs=1e-4), name

    proc = run_epd_forked("ask", "--prompt", RAW_PROMPT, "--endpoint", shared_stack.gateway, *flags)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    start = lines.index("logprobs of the answer's tokens (6; top 2 at each position):")
    rows = lines[start + 2 : start + 8]
    assert [row.split()[1] for row in rows] == [repr(lp["token"]).split()[0] for lp in remote["logprobs"]]
    assert (
        f"logprobs of the prompt's tokens ({remote['num_prompt_tokens']}; top 1 at each position):" in lines
    )

    refused = run_epd_forked(
        "ask", "--prompt", RAW_PROMPT, "--endpoint", shared_stack.gateway, "--logprobs", "21"
    )
    assert refused.returncode == 1 and "INVALID_ARGUMENT" in refused.stderr, refused.stderr
    assert "between 0 and 20 (--max-logprobs)" in refused.stderr


def test_ask_prompt_with_a_video_or_a_question_is_refused_saying_what_to_drop(media_files, tmp_path):
    messages = tmp_path / "messages.json"
    messages.write_text(json.dumps([{"role": "user", "content": "hi"}]))
    for args, says in (
        ([str(media_files["mp4"]), "--prompt", "x"], "drop a VIDEO or QUESTION argument"),
        ([str(media_files["mp4"]), QUESTION, "--prompt", "x"], "drop a VIDEO or QUESTION argument"),
        (["--prompt", "x", "--messages", str(messages)], "drop --messages"),
        (["--prompt", "x", "--question", QUESTION], "drop --question"),
        (["--prompt", "x", "--no-video"], "drop --no-video"),
        (["--prompt", ""], "--prompt is empty"),
    ):
        refused = run_epd_forked("ask", *args)
        assert refused.returncode == 2 and says in refused.stderr, (args, refused.stderr)
        assert "Traceback" not in refused.stderr


# A text-only conversation ending with the assistant's (partial) answer, the processor's chat form.
ASSISTANT_LAST = [
    {"role": "user", "content": [{"type": "text", "text": "name a colour"}]},
    {"role": "assistant", "content": [{"type": "text", "text": "The colour is"}]},
]


def test_ask_continue_final_message_continues_the_assistants_message(tiny_models, shared_stack, tmp_path):
    """`epd ask --messages FILE --continue-final-message` (FILE ending with the assistant's message):
    generate()'s tokens on `apply_chat_template(add_generation_prompt=False, continue_final_message=True)`
    (the flag implies the first), embedded and against a gateway (the SDK's keyword options);
    `--no-add-generation-prompt` alone renders without a new answer's opening. Without the flags,
    an answer after the assistant's message, which differs (so the flags are what is tested)."""
    from tests.reference import template_reference

    model = str(tiny_models["qwen2_vl"])
    path = tmp_path / "messages.json"
    path.write_text(json.dumps(ASSISTANT_LAST))
    continued = template_reference(
        model, ASSISTANT_LAST, 12, add_generation_prompt=False, continue_final_message=True
    )
    closed = template_reference(model, ASSISTANT_LAST, 12, add_generation_prompt=False)
    after = template_reference(model, ASSISTANT_LAST, 12)
    assert len({tuple(continued[1]), tuple(closed[1]), tuple(after[1])}) == 3, (
        "the three renderings answer alike"
    )
    ask = ["ask", "--no-video", "--messages", str(path), "--max-new-tokens", "12", "--json"]
    for where in (["--model", model], ["--endpoint", shared_stack.gateway]):
        for flags, (prompt_ids, want) in (
            (["--continue-final-message"], continued),
            (["--no-add-generation-prompt"], closed),
            ([], after),
        ):
            proc = run_epd_forked(*ask, *flags, *where)
            assert proc.returncode == 0, (where, flags, proc.stderr)
            out = json.loads(proc.stdout)
            assert out["token_ids"] == want and out["num_prompt_tokens"] == len(prompt_ids), (where, flags)


def test_ask_template_flags_without_messages_are_refused_saying_what_to_change(tmp_path):
    user_last = tmp_path / "messages.json"
    user_last.write_text(json.dumps([{"role": "user", "content": "hi"}]))
    give = "give --messages FILE (ending with the assistant's message to continue it), or drop"
    for args, says in (
        (["--no-video", QUESTION, "--continue-final-message"], f"{give} --continue-final-message"),
        (["--no-video", QUESTION, "--no-add-generation-prompt"], f"{give} --no-add-generation-prompt"),
        (["--prompt", "x", "--continue-final-message"], f"{give} --continue-final-message"),
        (
            ["--no-video", "--messages", str(user_last), "--continue-final-message"],
            "end with the assistant's message to continue",
        ),
    ):
        refused = run_epd_forked("ask", *args)
        assert refused.returncode == 2 and says in refused.stderr, (args, refused.stderr)
        assert "Traceback" not in refused.stderr
