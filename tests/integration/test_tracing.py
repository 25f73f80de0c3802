"""One request id through real processes on loopback (epd/transport/tracing.py): the client's
`x-request-id` (HTTP header, or gRPC metadata) comes back in the response, is in the encoder's,
prefill's, decode's and gateway's log lines about the request (each stage's timing line among
them), and ends every error message; without one the gateway makes one and returns it. The
prefill logs in JSON (`--log-format json`), the others in text."""

from __future__ import annotations

import base64
import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest

from epd.client import EpdClient, EpdError
from epd.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.stack import Stack

QUESTION = "what colour is the square?"
WAIT_S = 60.0
NOT_A_VIDEO = b"this is not a video, just text named clip.mp4\n" * 20


class TracingStack(Stack):
    """Services at INFO; prefill's log in JSON lines."""

    def command(self, name: str) -> list[str]:
        cmd = super().command(name)
        at = cmd.index("serve")
        fmt = ["--log-format", "json"] if name == "prefill" else []
        return [*cmd[:at], "--log-level", "INFO", *fmt, *cmd[at:]]


@pytest.fixture(scope="module")
def stack(tiny_models, tmp_path_factory):
    with TracingStack(
        tiny_models["qwen2_vl"],
        tmp_path_factory.mktemp("logs_trace"),
        extra={},
        http=True,
    ) as s:
        yield s


def chat(stack, media: bytes, request_id: str | None) -> tuple[int, dict, dict]:
    """POST /v1/chat/completions: (status, headers, body)."""
    url = "data:video/mp4;base64," + base64.b64encode(media).decode()
    body = {
        "model": "epd",
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": QUESTION},
                    {"type": "video_url", "video_url": {"url": url}},
                ],
            }
        ],
        "max_tokens": 3,
        "media": {"num_frames": 4},
    }
    headers = {"Content-Type": "application/json"}
    if request_id is not None:
        headers["x-request-id"] = request_id
    request = urllib.request.Request(
        f"http://127.0.0.1:{stack.http_port}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers=headers,
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.status, lower(resp.headers), json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, lower(err.headers), json.loads(err.read())


def lower(headers) -> dict[str, str]:
    return {k.lower(): v for k, v in headers.items()}


def lines_with(path: Path, request_id: str) -> list[str]:
    return [line for line in path.read_text().splitlines() if request_id in line]


def wait_for_line(path: Path, request_id: str, text: str) -> str:
    """The first log line of `path` about `request_id` containing `text` (polled: a service
    writes its end-of-call line just after the client has the answer)."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        for line in lines_with(path, request_id):
            if text in line:
                return line
        time.sleep(0.1)
    pytest.fail(f"no line with {text!r} for {request_id} in {path.name}:\n" + path.read_text()[-3000:])


def test_the_clients_id_is_in_the_answer_and_every_services_log(stack, media_files):
    status, headers, body = chat(stack, media_files["mp4"].read_bytes(), "trace-test-123")
    assert status == 200, body
    assert headers["x-request-id"] == "trace-test-123"
    logs = stack.log_dir
    encode = wait_for_line(logs / "encoder.log", "trace-test-123", "encode done")
    assert encode.endswith("request_id=trace-test-123") and "encode_ms=" in encode
    wait_for_line(logs / "encoder.log", "trace-test-123", "rpc /epd.v1.EncoderService/Encode OK total_ms=")
    decode = wait_for_line(logs / "decode.log", "trace-test-123", "decode done")
    assert "kv_transfer_ms=" in decode and "num_tokens=3" in decode
    wait_for_line(logs / "gateway.log", "trace-test-123", "request done")
    # prefill: JSON lines, the id its own field
    wait_for_line(logs / "prefill.log", "trace-test-123", "prefill done")
    records = [json.loads(line) for line in lines_with(logs / "prefill.log", "trace-test-123")]
    messages = {r["message"].split(" ")[0] + " " + r["message"].split(" ")[1]: r for r in records}
    assert messages["prefill done"]["request_id"] == "trace-test-123"
    assert "prefill_ms=" in messages["prefill done"]["message"]
    assert any(r["message"].startswith("kv pull served") for r in records)  # the decoder's pull, same id


def test_a_request_without_an_id_gets_one(stack, media_files):
    status, headers, _ = chat(stack, media_files["mp4"].read_bytes(), None)
    made = headers["x-request-id"]
    assert status == 200 and len(made) == 32 and int(made, 16) >= 0
    wait_for_line(stack.log_dir / "decode.log", made, "decode done")
    # an unusable one (a space, too long) is replaced, not echoed
    _, headers, _ = chat(stack, media_files["mp4"].read_bytes(), "x" * 129)
    assert headers["x-request-id"] != "x" * 129


def test_errors_name_the_request_id(stack):
    status, headers, body = chat(stack, NOT_A_VIDEO, "trace-bad-http")
    assert status == 400
    message = body["error"]["message"]
    assert message.count("(request id trace-bad-http)") == 1, message
    assert headers["x-request-id"] == "trace-bad-http"
    wait_for_line(stack.log_dir / "encoder.log", "trace-bad-http", "INVALID_ARGUMENT")

    with EpdClient(stack.gateway, timeout_s=60.0, metadata=(("x-request-id", "trace-bad-grpc"),)) as client:
        with pytest.raises(EpdError) as failed:
            client.ask(NOT_A_VIDEO, QUESTION, num_frames=4, max_new_tokens=3, request_id="trace-bad-grpc")
    assert failed.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert failed.value.message.count("(request id trace-bad-grpc)") == 1, failed.value.message
    wait_for_line(stack.log_dir / "encoder.log", "trace-bad-grpc", "INVALID_ARGUMENT")


def test_the_header_id_names_every_error_and_comes_back_as_the_metadata(stack, media_files):
    """`AskHeader.request_id` (the SDK's `request_id=`) was adopted only once the pipeline began:
    an error of the header's own settings or of its upload named a made-up id, and the response
    metadata carried that made-up id while the summary carried the client's."""
    data = media_files["mp4"].read_bytes()
    with EpdClient(stack.gateway, timeout_s=60.0) as client:
        with pytest.raises(EpdError, match="question is empty") as failed:
            client.ask(data, "   ", num_frames=4, max_new_tokens=3, request_id="trace-hdr-setting")
    assert failed.value.message.endswith("(request id trace-hdr-setting)"), failed.value.message
    assert failed.value.request_id == "trace-hdr-setting"

    def ask(request_id: str, announced: int):
        header = gateway_pb2.AskHeader(
            question=QUESTION,
            request_id=request_id,
            media_num_bytes=announced,
            generation=common_pb2.GenerationParams(max_new_tokens=3),
        )
        requests = [gateway_pb2.AskRequest(header=header), gateway_pb2.AskRequest(media_chunk=data)]
        with grpc.insecure_channel(stack.gateway) as channel:
            call = gateway_pb2_grpc.GatewayServiceStub(channel).Ask(iter(requests), timeout=60)
            try:
                return list(call), dict(call.initial_metadata()), None
            except grpc.RpcError as exc:
                return [], dict(exc.trailing_metadata() or ()), exc

    _, trailing, error = ask("trace-hdr-upload", len(data) + 1)  # the upload comes up short
    assert error is not None and error.details().endswith("(request id trace-hdr-upload)"), error
    assert trailing["x-request-id"] == "trace-hdr-upload"
    answer, initial, error = ask("trace-hdr-ok", len(data))
    assert error is None and answer[-1].summary.request_id == "trace-hdr-ok"
    assert initial["x-request-id"] == "trace-hdr-ok"  # the same id as the summary's
