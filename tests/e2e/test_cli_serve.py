"""`epd serve` as a user starts it, in subprocesses: the stack (asked with `epd ask --endpoint`,
stopped with SIGINT), `--colocate` in one process, and with `--mkl-dispatch features`; the KV
memory flags' budgets and --served-model-name read back from the gateway's /metrics and
/v1/models; the model services on tcmalloc where the machine has it."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import pytest

from epd.cli.allocator import find_tcmalloc, uses_tcmalloc
from epd.cli.health import is_serving
from epd.cli.mkl_dispatch import find_compiler
from tests.e2e.cli_runs import QUESTION, run_epd
from tests.stack import ROOT, bound_ports, child_env, epd_command, serving_pid

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
