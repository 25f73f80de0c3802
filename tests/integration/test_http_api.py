"""The OpenAI-compatible HTTP API, driven by the real `openai` client against a real stack: the
same request gives the same tokens as the gRPC API; the media URL policy refuses what it must
(without connecting anywhere); /v1/models, /health and /metrics answer."""

from __future__ import annotations

import base64
import json
import re
import shutil
import socket
import urllib.error
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from epd.client import VIDEO, EpdClient, Message
from tests.stack import gateway_over

API_KEY = "test-key-123"
MODEL = "tiny-qwen2-vl"
QUESTION = "what colour is the moving square?"
MAX_TOKENS = 8
NUM_FRAMES = 4
TEXT_FIRST = [Message.user(QUESTION, VIDEO)]
"""What `video_message` sends, for the gRPC API (the media part takes the kind found in the bytes)."""


@pytest.fixture(scope="module")
def allowed_dir(tmp_path_factory, media_files):
    root = tmp_path_factory.mktemp("allowed_media")
    shutil.copy(media_files["mp4"], root / "clip.mp4")
    return root


@pytest.fixture(scope="module")
def stack(shared_stack, tmp_path_factory, allowed_dir):
    """A gateway of its own (every flag here is the gateway's) over the session's stages."""
    flags = [
        "--api-key", API_KEY,
        "--served-model-name", MODEL,
        "--allowed-local-media-path", str(allowed_dir),
        # Listed on purpose: the private-address check must refuse them anyway.
        "--allowed-media-domains", "localhost,127.0.0.1,10.1.2.3,allowed.invalid",
    ]  # fmt: skip
    with gateway_over(shared_stack, tmp_path_factory.mktemp("logs_http"), flags, http=True) as s:
        yield s


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{stack.http_port}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def grpc_client(stack):
    with EpdClient(stack.gateway, timeout_s=120, api_key=API_KEY) as c:  # --api-key guards gRPC too
        yield c


def data_url(path, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(path.read_bytes()).decode()


def video_message(url: str, kind: str = "video_url") -> list[dict]:
    return [
        {"role": "user", "content": [{"type": "text", "text": QUESTION}, {"type": kind, kind: {"url": url}}]}
    ]


def ask_http(client, url: str, kind: str = "video_url", **kwargs):
    return client.chat.completions.create(
        model=MODEL,
        messages=video_message(url, kind),
        max_tokens=MAX_TOKENS,
        # vLLM's return_token_ids: the choices list their token ids, compared with gRPC's
        extra_body={"media": {"num_frames": NUM_FRAMES}, "return_token_ids": True},
        **kwargs,
    )


@pytest.mark.parametrize(
    "kind,fmt,mime", [("video_url", "mp4", "video/mp4"), ("image_url", "png", "image/png")]
)
def test_non_streaming_matches_grpc(client, grpc_client, media_files, kind, fmt, mime):
    expected = grpc_client.ask(
        media_files[fmt], messages=TEXT_FIRST, num_frames=NUM_FRAMES, max_new_tokens=MAX_TOKENS
    )
    completion = ask_http(client, data_url(media_files[fmt], mime), kind)

    assert completion.object == "chat.completion"
    assert completion.model == MODEL
    assert completion.epd["token_ids"] == expected.token_ids
    assert completion.choices[0].message.content == expected.answer
    assert completion.choices[0].finish_reason == expected.finish_reason
    assert completion.usage.completion_tokens == len(expected.token_ids)
    assert completion.usage.prompt_tokens == expected.num_prompt_tokens
    assert completion.epd["num_frames"] == expected.num_frames


def test_streaming_matches_grpc(client, grpc_client, media_files):
    expected = grpc_client.ask(
        media_files["mp4"], messages=TEXT_FIRST, num_frames=NUM_FRAMES, max_new_tokens=MAX_TOKENS
    )
    stream = ask_http(
        client, data_url(media_files["mp4"], "video/mp4"), stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)

    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    token_ids = [
        t for c in chunks if c.choices for t in (c.choices[0].model_extra or {}).get("token_ids") or []
    ]
    assert token_ids == expected.token_ids
    assert text == expected.answer
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [expected.finish_reason]
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)


def test_the_epd_object_has_every_field_of_the_sdk_result_under_the_same_names(
    client, grpc_client, media_files
):
    pruning = {"preset": "balanced", "knobs": {"prefill_drop_layer": 1}}
    expected = grpc_client.ask(media_files["mp4"], messages=TEXT_FIRST,
                               num_frames=NUM_FRAMES, max_new_tokens=MAX_TOKENS,
                               pruning="balanced", pruning_knobs={"prefill_drop_layer": 1})  # fmt: skip
    completion = client.chat.completions.create(
        model=MODEL, messages=video_message(data_url(media_files["mp4"], "video/mp4")), max_tokens=MAX_TOKENS,
        extra_body={"media": {"num_frames": NUM_FRAMES}, "pruning": pruning},
    )  # fmt: skip
    sdk = expected.to_dict()
    # The answer is the message content, the logprobs the choice's (OpenAI's form), the prompt's
    # logprobs and ids vLLM's top-level prompt_logprobs and prompt_token_ids; events and attempts
    # are the gRPC call's own.
    names = set(sdk) - {
        "answer", "logprobs", "prompt_logprobs", "prompt_token_ids", "events", "num_attempts",
        "media_num_bytes_sent", "request_id"
    }  # fmt: skip
    assert names <= set(completion.epd), names - set(completion.epd)
    for name in names - {"timings_ms", "pruning", "encoder_cache_hit", "media_sha256"}:
        assert completion.epd[name] == sdk[name], name
    assert set(completion.epd["timings_ms"]) == set(sdk["timings_ms"])  # "decode" too, until 0.3
    assert completion.epd["timings_ms"]["decode"] == completion.epd["timings_ms"]["video_decode"]
    assert completion.epd["pruning"]["stages"] == sdk["pruning"]["stages"]
    assert completion.epd["kept_visual_token_index"] and completion.epd["kept_tokens"]


def test_allowed_local_path_and_file_url(client, grpc_client, allowed_dir, media_files):
    expected = grpc_client.ask(
        media_files["mp4"], messages=TEXT_FIRST, num_frames=NUM_FRAMES, max_new_tokens=MAX_TOKENS
    )
    by_path = ask_http(client, str(allowed_dir / "clip.mp4"))
    by_url = ask_http(client, (allowed_dir / "clip.mp4").as_uri())
    assert by_path.epd["token_ids"] == by_url.epd["token_ids"] == expected.token_ids


def test_local_path_outside_allowed_dir_is_refused(client, allowed_dir, media_files):
    assert not media_files["mp4"].is_relative_to(allowed_dir)
    with pytest.raises(openai.PermissionDeniedError, match="outside the directory") as info:
        ask_http(client, str(media_files["mp4"]))
    assert info.value.status_code == 403
    with pytest.raises(openai.PermissionDeniedError, match="outside the directory"):
        ask_http(client, f"{allowed_dir}/../{media_files['mp4'].parent.name}/clip.mp4")


def test_missing_local_file_is_not_found(client, allowed_dir):
    with pytest.raises(openai.NotFoundError, match="no file at"):
        ask_http(client, str(allowed_dir / "absent.mp4"))


@pytest.fixture
def listener():
    """A TCP listener on loopback: the test checks that nobody connected to it."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        sock.settimeout(0.5)
        yield sock


def _nobody_connected(sock: socket.socket) -> bool:
    try:
        conn, _ = sock.accept()
    except TimeoutError:
        return True
    conn.close()
    return False


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_private_url_is_refused_without_connecting(client, listener, host):
    port = listener.getsockname()[1]
    with pytest.raises(openai.PermissionDeniedError, match="private, loopback or link-local") as info:
        ask_http(client, f"http://{host}:{port}/clip.mp4")
    assert info.value.status_code == 403
    assert _nobody_connected(listener)


def test_private_ten_net_url_is_refused(client):
    with pytest.raises(openai.PermissionDeniedError, match="private, loopback or link-local"):
        ask_http(client, "http://10.1.2.3/clip.mp4")


def test_unlisted_domain_is_refused(client):
    with pytest.raises(openai.PermissionDeniedError, match="not in --allowed-media-domains"):
        ask_http(client, "https://unlisted.example.com/clip.mp4")


def test_missing_or_wrong_api_key(stack):
    for key in ("", "wrong-key"):
        bad = openai.OpenAI(
            base_url=f"http://127.0.0.1:{stack.http_port}/v1", api_key=key or "x", max_retries=0
        )
        if not key:
            bad = bad.with_options(default_headers={"Authorization": ""})
        with pytest.raises(openai.AuthenticationError, match="API key") as info:
            bad.models.list()
        assert info.value.status_code == 401


def test_models(client):
    assert [m.id for m in client.models.list()] == [MODEL]


def test_unknown_model_is_not_found(client, media_files):
    with pytest.raises(openai.NotFoundError, match="GET /v1/models"):
        client.chat.completions.create(
            model="gpt-4o", messages=video_message(data_url(media_files["png"], "image/png"), "image_url")
        )


def test_bad_parameters_get_their_status(client, media_files):
    url = data_url(media_files["mp4"], "video/mp4")
    with pytest.raises(openai.BadRequestError, match="max_new_tokens must be between"):
        client.chat.completions.create(model=MODEL, messages=video_message(url), max_tokens=100_000)
    with pytest.raises(openai.APIStatusError, match="at most 256") as info:
        client.chat.completions.create(
            model=MODEL, messages=video_message(url), extra_body={"media": {"max_frames": 1_000_000}}
        )
    assert info.value.status_code == 413
    # A stream that fails before its first token still gets the error's own status.
    with pytest.raises(openai.BadRequestError, match="corrupt, truncated"):
        client.chat.completions.create(
            model=MODEL,
            messages=video_message("data:video/mp4;base64," + base64.b64encode(b"not a video" * 50).decode()),
            stream=True,
        )
    content = video_message(url)[0]["content"]  # [text, video_url]
    two = [{"role": "user", "content": [*content, content[1]]}]
    with pytest.raises(openai.BadRequestError, match="at most one video or image per request"):
        client.chat.completions.create(model=MODEL, messages=two)


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _sample(metrics_text: str, name: str, labels: str = "") -> float:
    """One sample's value (0 when absent); `labels` in any order, as written in the exposition."""
    wanted = dict(re.findall(r'(\w+)="([^"]*)"', labels))
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == name and sample.labels == wanted:
                return sample.value
    return 0.0


def test_metrics_move_after_a_request(stack, client, media_files):
    _, before = _get(stack.http_port, "/metrics")
    ask_http(client, data_url(media_files["png"], "image/png"), "image_url")
    status, after = _get(stack.http_port, "/metrics")

    assert status == 200
    ok = '{status="OK"}'
    assert _sample(after, "epd_requests_total", ok) == _sample(before, "epd_requests_total", ok) + 1
    assert _sample(after, "epd_time_to_first_token_seconds_count") == (
        _sample(before, "epd_time_to_first_token_seconds_count") + 1
    )
    assert _sample(after, "epd_generation_tokens_total") > _sample(before, "epd_generation_tokens_total")
    route = '{route="/v1/chat/completions",code="200"}'
    assert (
        _sample(after, "epd_http_responses_total", route)
        == _sample(before, "epd_http_responses_total", route) + 1
    )
    assert _sample(after, "epd_requests_in_flight") == 0
    assert "# TYPE epd_e2e_request_latency_seconds histogram" in after


def test_health(stack):
    status, body = _get(stack.http_port, "/health")
    assert status == 200
    assert json.loads(body) == {"status": "ok"}
