"""Bad input through the front door gets the right status and a message naming the problem;
the stack keeps serving the next good request."""

from __future__ import annotations

import grpc
import pytest

from epd.client import EpdClient, EpdError
from tests.stack import Stack

UPLOAD_LIMIT_BYTES = 200_000


@pytest.fixture(scope="module")
def stack(tiny_models, tmp_path_factory):
    extra = {"gateway": ["--max-upload-bytes", str(UPLOAD_LIMIT_BYTES)]}
    with Stack(tiny_models["qwen2_vl"], tmp_path_factory.mktemp("logs_bad"), extra=extra) as s:
        yield s


@pytest.fixture(scope="module")
def client(stack):
    with EpdClient(stack.gateway, timeout_s=120) as c:
        yield c


def _bad_files(media_files, tmp_path):
    good = media_files["mp4"].read_bytes()
    return {
        "zero": b"",
        "truncated": good[: len(good) // 3],
        "text": b"this is not a video, just text named clip.mp4\n" * 20,
    }


@pytest.mark.parametrize(
    "kind,code,match",
    [
        ("zero", grpc.StatusCode.INVALID_ARGUMENT, "empty"),
        ("truncated", grpc.StatusCode.INVALID_ARGUMENT, "corrupt, truncated"),
        ("text", grpc.StatusCode.INVALID_ARGUMENT, "corrupt, truncated"),
    ],
)
def test_bad_media(client, media_files, tmp_path, kind, code, match):
    data = _bad_files(media_files, tmp_path)[kind]
    with pytest.raises(EpdError, match=match) as info:
        client.ask(data, "what happens?", max_new_tokens=4)
    assert info.value.code == code
    assert "0x" not in info.value.message  # no decoder internals or addresses leak


def test_absurd_max_frames(client, media_files):
    with pytest.raises(EpdError, match="at most 256") as info:
        client.ask(media_files["mp4"], "what happens?", max_frames=1_000_000)
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_empty_question(client, media_files):
    with pytest.raises(EpdError, match="question is empty") as info:
        client.ask(media_files["mp4"], "   ")
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_upload_over_limit(client):
    with pytest.raises(EpdError, match=f"at most {UPLOAD_LIMIT_BYTES}") as info:
        client.ask(b"\0" * (UPLOAD_LIMIT_BYTES + 1), "what happens?")
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_bad_generation_params(client, media_files):
    with pytest.raises(EpdError, match="max_new_tokens must be between") as info:
        client.ask(media_files["mp4"], "what happens?", max_new_tokens=100_000)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_unknown_media_hash(client):
    with pytest.raises(EpdError, match="not cached") as info:
        client.ask(None, "what happens?", media_sha256="ab" * 32)
    assert info.value.code == grpc.StatusCode.NOT_FOUND


def test_stack_still_serves_after_errors(stack, client, media_files):
    # Runs after the failures above (file order): every process is alive and answers.
    result = client.ask(media_files["mp4"], "what happens?", num_frames=4, max_new_tokens=6)
    assert len(result.token_ids) >= 1
    assert result.num_frames == 4
    assert stack.alive()


def test_decode_refuses_unlisted_kv_source(stack):
    """A client must not make the decoder connect anywhere: kv_address outside --allow-kv-from."""
    from epd.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2

    with grpc.insecure_channel(stack.address("decode")) as channel:
        stub = decode_pb2_grpc.DecodeServiceStub(channel)
        req = decode_pb2.GenerateRequest(
            prefill=prefill_pb2.PrefillResult(kv_handle="x", kv_address="10.1.2.3:80", next_position_ids=[1, 1, 1, 1])
        )
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(req, timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "allow-kv-from" in info.value.details()
