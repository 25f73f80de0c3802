"""`epd serve`'s model services share one copy of the weights (epd/model_runtime/shared_weights.py):
the zygote loads the checkpoint once, and prefill and decode (and a replica restarted later) assign
its tensors to their parameters, so the pages stay the zygote's, shared copy on write, after
requests too (nothing writes to a weight). With --no-share-weights each loads its own.

Measured on real processes through /proc/PID/smaps_rollup, on a checkpoint whose language model is
~31 MiB, so that a private copy of it stands out of a service's other memory: with sharing each of
prefill and decode holds at least 80% of a copy fewer private dirty pages, and the pair's PSS of
anonymous memory is lower by more than one copy. The answers are the same either way (the
exactness and batch-invariance tests run on shared weights too: tests/conftest.py's tiny Qwen2-VL
is preloaded by the session's zygote)."""

from __future__ import annotations

import base64
import json
import os
import signal
import time
from pathlib import Path

import pytest

from epd.cli.health import is_serving
from epd.model_runtime.hf_loading import language_key, safetensors_files
from tests.local_http import post_json
from tests.stack import VerboseStack, launch_stack, serving_pid, stop_launcher

RESTART_WAIT_S = 120.0  # a deadline for a restart to be seen, not a timing assertion


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory) -> Path:
    """A Qwen2-VL checkpoint with a ~31 MiB float32 language model (wide MLPs, ten layers)."""
    from epd.model_runtime.tiny_model import TinyVLMSpec, build_checkpoint

    spec = TinyVLMSpec(family="qwen2_vl", intermediate_size=4096, num_hidden_layers=10)
    return build_checkpoint(tmp_path_factory.mktemp("wide") / "qwen2_vl", spec)


def _language_bytes(model: Path) -> int:
    """Bytes of the checkpoint's language model (the tensors prefill and decode load)."""
    from safetensors.torch import load_file

    root, files = safetensors_files(str(model))
    return sum(
        tensor.nbytes
        for name in files
        for key, tensor in load_file(root / name).items()
        if language_key(key) is not None
    )


def _memory_kib(pid: int) -> dict[str, int]:
    """/proc/PID/smaps_rollup's fields, in KiB."""
    fields = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, _, value = line.partition(":")
        fields[key] = int(value.split()[0])
    return fields


def _chat(http_port: int, video: bytes) -> tuple[int, dict]:
    """(HTTP status, the JSON answer) of a greedy question about `video`."""
    url = "data:video/mp4;base64," + base64.b64encode(video).decode()
    content = [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": "what moves?"}]
    body = {
        "model": "epd",
        "max_tokens": 6,
        "temperature": 0,
        "media": {"num_frames": 4},
        "messages": [{"role": "user", "content": content}],
    }
    return post_json(http_port, "/v1/chat/completions", body)


def _answer(http_port: int, video: bytes) -> list[int]:
    status, answer = _chat(http_port, video)
    assert status == 200, answer
    return answer["epd"]["token_ids"]


def _restarted(
    launcher, port: int, killed: int, http_port: int, video: bytes, log: Path
) -> tuple[int, list[int]]:
    """Once the launcher has forked a new decode on `port` after `killed` and the stack answers
    again: (its pid, the answer)."""
    deadline = time.monotonic() + RESTART_WAIT_S
    while (pid := serving_pid(port)) in (None, killed) or not is_serving(f"127.0.0.1:{port}", timeout_s=1.0):
        assert launcher.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.2)
    while (reply := _chat(http_port, video))[0] != 200:  # the gateway sees it at its next check
        assert reply[0] in (502, 503, 504) and time.monotonic() < deadline, reply
        time.sleep(0.5)
    return pid, reply[1]["epd"]["token_ids"]


def _served(model: Path, tmp_path: Path, video: bytes, *flags: str, restart_decode: bool = False) -> dict:
    """A stack on `model` with `flags` (at INFO) after one request: its answer, prefill's and
    decode's smaps_rollup, the stack's log; with `restart_decode`, also the smaps_rollup of a decode
    killed and forked again, after another request (and that answer)."""
    tmp_path.mkdir()
    log, ports_file = tmp_path / "stack.log", tmp_path / "stack.ports.json"
    launcher, _ = launch_stack(model, log, ports_file, *flags, log_level="INFO")
    seen: dict = {}
    try:
        bound = json.loads(ports_file.read_text())
        seen["answer"] = _answer(bound["http"], video)
        pids = {role: serving_pid(bound[role][0]) for role in ("prefill", "decode")}
        for role, pid in pids.items():
            assert pid is not None, role
            seen[role] = _memory_kib(pid)
        if restart_decode:
            assert pids["decode"] is not None
            os.kill(pids["decode"], signal.SIGKILL)
            pid, seen["answer after the restart"] = _restarted(
                launcher, bound["decode"][0], pids["decode"], bound["http"], video, log
            )
            seen["restarted decode"] = _memory_kib(pid)
    finally:
        seen["exit"] = stop_launcher(launcher)
        seen["log"] = log.read_text()
    return seen


def test_prefill_and_decode_share_the_zygotes_copy_of_the_weights(wide_model, media_files, tmp_path):
    video = media_files["mp4"].read_bytes()
    copy_kib = _language_bytes(wide_model) // 1024
    assert copy_kib > 30 * 1024  # the model is as wide as meant
    on = _served(wide_model, tmp_path / "on", video, restart_decode=True)
    off = _served(wide_model, tmp_path / "off", video, "--no-share-weights")

    assert on["exit"] == off["exit"] == 0, (on["log"], off["log"])
    assert on["answer"] == on["answer after the restart"] == off["answer"]
    assert "weights: loaded once (float32) by the zygote and shared" in on["log"], on["log"]
    # prefill, decode and the restarted decode (the encoder's is its tower)
    assert on["log"].count("MiB of LanguageOnly shared with the zygote's copy") == 3, on["log"]
    assert "weights: each model service loads its own copy (--no-share-weights)" in off["log"], off["log"]
    assert "shared with the zygote's copy" not in off["log"]
    for role in ("prefill", "decode", "restarted decode"):
        fewer = off[role.split()[-1]]["Private_Dirty"] - on[role]["Private_Dirty"]
        assert fewer > 0.8 * copy_kib, (
            f"{role}: {fewer} KiB fewer private pages with sharing, a copy is {copy_kib}"
        )
    pair_on = on["prefill"]["Pss_Anon"] + on["decode"]["Pss_Anon"]
    pair_off = off["prefill"]["Pss_Anon"] + off["decode"]["Pss_Anon"]
    assert pair_on < pair_off - copy_kib, (pair_on, pair_off, copy_kib)


def test_the_sessions_stacks_on_tiny_qwen2_vl_run_on_shared_weights(tiny_models, tmp_path):
    """The exactness and batch-invariance tests' stacks (tests/stack.py, on tiny Qwen2-VL) take their
    weights from the session's zygote, as `epd serve`'s services do."""
    with VerboseStack(tiny_models["qwen2_vl"], tmp_path):
        pass
    for role in ("prefill", "decode"):
        log = (tmp_path / f"{role}.log").read_text()
        assert "MiB of LanguageOnly shared with the zygote's copy" in log, log
    assert (
        "of Qwen2VisionTransformerPretrainedModel shared with the zygote's copy"
        in (tmp_path / "encoder.log").read_text()
    )
