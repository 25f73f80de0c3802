"""vLLM's `--generation-config` through a real stack: a model whose generation_config.json
carries its creator's repetition penalty (1.3) and max_new_tokens answers a request that leaves
them unset exactly as `generate()` does (which starts from the model's generation_config too),
through the gRPC Ask API and the HTTP API alike, with the gateway started alone on its default
flags (prefill reports the model's defaults in its model info); a field the request sets wins;
and under `--generation-config vllm` the same request gets the server's neutral defaults."""

from __future__ import annotations

import base64
import json
import signal
import subprocess
from pathlib import Path

import pytest

from epd.cli.health import is_serving
from epd.client import EpdClient
from tests.local_http import post_json
from tests.reference import decode_for_test, reference_tokens
from tests.stack import ROOT, Stack, bound_ports, child_env, epd_command, run_epd_forked, wait_until

QUESTION = "what colour is the moving square?"
NUM_FRAMES = 4
CREATORS_MAX_NEW_TOKENS = 12


@pytest.fixture(scope="module")
def video(media_files):
    return decode_for_test(media_files["mp4"], NUM_FRAMES)


@pytest.fixture(scope="module")
def creator_model(tiny_models, tmp_path_factory) -> Path:
    """The tiny Qwen2-VL (files linked) whose generation_config.json gains its creator's sampling
    defaults, as Qwen2-VL-2B-Instruct's carries repetition_penalty 1.05."""
    source = tiny_models["qwen2_vl"]
    out = tmp_path_factory.mktemp("creator") / "qwen2_vl"
    out.mkdir()
    for f in source.iterdir():
        if f.name != "generation_config.json":
            (out / f.name).symlink_to(f)
    config = json.loads((source / "generation_config.json").read_text())
    config.update(repetition_penalty=1.3, max_new_tokens=CREATORS_MAX_NEW_TOKENS)
    (out / "generation_config.json").write_text(json.dumps(config))
    return out


def chat_body(media: Path, **fields) -> dict:
    url = "data:video/mp4;base64," + base64.b64encode(media.read_bytes()).decode()
    return {"model": "epd", "media": {"num_frames": NUM_FRAMES}, **fields,
            "messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                                      {"type": "text", "text": QUESTION}]}]}  # fmt: skip


def answer_of(proc: subprocess.CompletedProcess) -> list[int]:
    """The token ids `epd ask --json` printed."""
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])["token_ids"]


def test_the_models_sampling_defaults_apply_where_a_request_leaves_them_unset(
    creator_model, tiny_models, media_files, video, tmp_path
):
    # generate() reads the saved generation_config: the penalty and the length are the model's
    want = reference_tokens(creator_model, video, QUESTION, CREATORS_MAX_NEW_TOKENS)
    plain = reference_tokens(tiny_models["qwen2_vl"], video, QUESTION, CREATORS_MAX_NEW_TOKENS)
    assert want != plain, "the penalty changes nothing here; the comparison would prove little"
    mp4 = media_files["mp4"]

    # Each role started alone (`epd serve gateway` beside `epd serve encoder/prefill/decode`, as
    # compose and Kubernetes start them), the gateway with its default flags: it holds no model
    # folder, and takes the model's defaults from prefill's model info (--generation-config auto).
    with Stack(creator_model, tmp_path / "logs", http=True) as stack:
        with EpdClient(stack.gateway, timeout_s=120) as client:
            assert client.ask(mp4, QUESTION, num_frames=NUM_FRAMES).token_ids == want  # gRPC
            log = (tmp_path / "logs" / "gateway.log").read_text()
            assert f"repetition_penalty=1.3, max_tokens={CREATORS_MAX_NEW_TOKENS}" in log, log
            # the request's own penalty wins
            own = client.ask(mp4, QUESTION, num_frames=NUM_FRAMES, repetition_penalty=1.0)
            assert own.token_ids == plain
        # HTTP: no max_tokens, no penalty
        status, body = post_json(stack.http_port, "/v1/chat/completions", chat_body(mp4))
        assert status == 200 and body["epd"]["token_ids"] == want, body
        # `epd ask --endpoint`: its unset flags are left unset on the wire
        ask = [
            "ask",
            str(mp4),
            QUESTION,
            "--endpoint",
            stack.gateway,
            "--num-frames",
            str(NUM_FRAMES),
            "--json",
        ]
        proc = subprocess.run(
            epd_command(*ask), capture_output=True, text=True, env=child_env(), cwd=ROOT, timeout=180
        )
        assert answer_of(proc) == want

        # --generation-config vllm: the same gateway restarted on its port, the model's ignored.
        stack.procs["gateway"].terminate()
        stack.procs["gateway"].wait(timeout=30)
        stack.extra["gateway"] = ["--generation-config", "vllm"]
        with open(tmp_path / "logs" / "gateway-vllm.log", "w") as out:
            stack.procs["gateway"] = subprocess.Popen(
                stack.command("gateway"),
                stdout=out,
                stderr=subprocess.STDOUT,
                env=stack.gateway_env,
                cwd=ROOT,
            )
        wait_until(lambda: is_serving(stack.gateway, timeout_s=1.0), "the restarted gateway serving")
        status, body = post_json(
            stack.http_port, "/v1/chat/completions", chat_body(mp4, max_tokens=CREATORS_MAX_NEW_TOKENS)
        )
        assert status == 200 and body["epd"]["token_ids"] == plain != want, body


def test_embedded_ask_takes_the_models_defaults_as_vllms_llm_does(
    creator_model, tiny_models, media_files, video
):
    """vLLM's `LLM.generate` with default SamplingParams starts from the model's generation config
    too (`get_default_sampling_params`): embedded `epd ask` without the flags, as the server."""
    want = reference_tokens(creator_model, video, QUESTION, CREATORS_MAX_NEW_TOKENS)
    ask = [
        "ask",
        str(media_files["mp4"]),
        QUESTION,
        "--model",
        str(creator_model),
        "--num-frames",
        str(NUM_FRAMES),
    ]
    assert answer_of(run_epd_forked(*ask, "--json", timeout_s=180)) == want
    off = run_epd_forked(*ask, "--json", "--repetition-penalty", "1", timeout_s=180)  # the flag wins
    assert answer_of(off) == reference_tokens(
        tiny_models["qwen2_vl"], video, QUESTION, CREATORS_MAX_NEW_TOKENS
    )


def test_the_colocated_server_takes_them_from_its_own_prefill(creator_model, media_files, video, tmp_path):
    """`epd serve --colocate` resolves as the gateway does, from its local prefill's model info."""
    want = reference_tokens(creator_model, video, QUESTION, CREATORS_MAX_NEW_TOKENS)
    ports_file = tmp_path / "colocated.ports.json"
    log_path = tmp_path / "colocated.log"
    with open(log_path, "w") as out:
        serve = subprocess.Popen(
            epd_command(
                "serve",
                "--colocate",
                "--model",
                str(creator_model),
                "--gateway-port",
                "0",
                "--http-port",
                "0",
                "--ports-file",
                str(ports_file),
            ),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=child_env(),
            cwd=ROOT,
        )
    try:
        address = f"127.0.0.1:{bound_ports(ports_file, serve, 'epd serve --colocate')['grpc']}"
        wait_until(lambda: is_serving(address, timeout_s=1.0), "epd serve --colocate serving")
        with EpdClient(address, timeout_s=120) as client:
            assert client.ask(media_files["mp4"], QUESTION, num_frames=NUM_FRAMES).token_ids == want
        assert f"repetition_penalty=1.3, max_tokens={CREATORS_MAX_NEW_TOKENS}" in log_path.read_text()
    finally:
        serve.send_signal(signal.SIGINT)
        serve.wait(timeout=60)
