"""`epd serve --colocate` and `epd ask --endpoint` as a user runs them: a flag their mode never
reads, written on the command line, stops the command with a usage error naming it (exit 2, before
anything starts or any model loads); the same flag's environment default does not."""

from __future__ import annotations

import subprocess

from tests.stack import ROOT, child_env, epd_command


def run(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        epd_command(*args), capture_output=True, text=True, env=child_env() | env, cwd=ROOT, timeout=120
    )


def test_serve_colocate_refuses_the_stacks_routing_and_stage_ports():
    proc = run("serve", "--colocate", "--routing=round-robin", "--encoder-port", "1", "--gateway-port", "0")
    assert proc.returncode == 2, proc.stderr
    usage, error = proc.stderr.strip().splitlines()[0], proc.stderr.strip().splitlines()[-1]
    assert usage.startswith("usage: epd serve") and "Traceback" not in proc.stderr
    assert error.startswith("epd serve: error: --routing does nothing with --colocate: routing among")
    assert "--encoder-port does nothing with --colocate" in error and "drop it, or drop --colocate" in error


def test_ask_endpoint_refuses_the_embedded_models_flags_not_their_environment_defaults():
    proc = run(
        "ask", "--no-video", "what?", "--endpoint", "127.0.0.1:1", "--device=cuda", "--close-timeout-s", "1",
        EPD_MODEL="some/model", EPD_DTYPE="bfloat16",
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    error = proc.stderr.strip().splitlines()[-1]
    assert error.startswith("epd ask: error: --device does nothing with --endpoint: the flags of the model")
    assert "--close-timeout-s does nothing with --endpoint" in error and "drop --endpoint" in error
    assert "--model" not in error and "--dtype" not in error and "Traceback" not in proc.stderr


def test_serve_colocate_refuses_them_from_a_config_file_and_spelled_with_underscores(tmp_path):
    (path := tmp_path / "serve.yaml").write_text("routing: round-robin\nmax_model_len: 64\n")
    proc = run("serve", "--colocate", "--config", str(path), "--encoder_port", "1")
    assert proc.returncode == 2, proc.stderr
    error = proc.stderr.strip().splitlines()[-1]
    assert (
        error.startswith("epd serve: error: --routing does nothing with --colocate")
        and "Traceback" not in proc.stderr
    )
    assert "--encoder-port does nothing with --colocate" in error
