"""Only the services that run the model need xgrammar: a stack whose gateway cannot import it (a
`sitecustomize` on the gateway's PYTHONPATH alone sets `sys.modules["xgrammar"] = None`) serves a
JSON-schema request end to end, its tokens those of the masked reference; a spec that does not
compile is refused by prefill with the compiler's reason, a 400. And compiling has a deadline:
prefill and decode started with `--structured-compile-timeout-s 0.5` refuse a spec that compiles
for seconds with a 400 saying to simplify it, asked once or twice, and go on serving others."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.integration.structured_cases import (
    CASES,
    NUM_FRAMES,
    SLOW_REGEX,
    chat,
    check_text,
    masked_references,
)
from tests.reference import decode_for_test
from tests.stack import QUICK_CLOSE, Stack, child_env

TIMEOUT_S = 0.5


@pytest.fixture(scope="module")
def video(media_files):
    return decode_for_test(media_files["mp4"], NUM_FRAMES)


def test_a_gateway_without_xgrammar_serves_structured_outputs_and_compiling_has_a_deadline(
    tiny_models, media_files, video, tmp_path
):
    shim = tmp_path / "no_xgrammar"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text("import sys\n\nsys.modules['xgrammar'] = None\n")
    gateway_env = {"PYTHONPATH": f"{shim}:{child_env()['PYTHONPATH']}"}
    probe = subprocess.run([sys.executable, "-c", "import xgrammar"], env={**child_env(), **gateway_env})
    assert probe.returncode != 0, "the shim leaves xgrammar importable"
    want = masked_references(tiny_models["qwen2_vl"], video, ["json_schema"])["json_schema"]
    deadline = ["--structured-compile-timeout-s", str(TIMEOUT_S), *QUICK_CLOSE]
    extra = {"gateway": [], "prefill": deadline, "decode": deadline}
    with Stack(
        tiny_models["qwen2_vl"], tmp_path / "logs", extra=extra, gateway_env=gateway_env, http=True
    ) as stack:
        port = stack.http_port
        status, body = chat(port, media_files, **CASES["json_schema"][0])
        assert status == 200, body
        choice = body["choices"][0]
        assert choice["token_ids"] == want and choice["finish_reason"] == "stop"
        check_text("json_schema", choice["message"]["content"])

        status, body = chat(port, media_files, guided_regex="[a-")
        assert status == 400, body
        assert "the structured-output regex does not compile: Regex parsing error" in body["error"]["message"]

        for _ in range(2):  # the second is refused without another compile
            status, body = chat(port, media_files, guided_regex=SLOW_REGEX)
            assert status == 400, body
            message = body["error"]["message"]
            assert (
                f"regex took longer than {TIMEOUT_S:g} s to compile" in message and "simplify it" in message
            )

        status, body = chat(port, media_files, **CASES["json_schema"][0])  # still served, at once
        assert status == 200 and body["choices"][0]["token_ids"] == want, body
