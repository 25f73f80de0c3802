"""The client SDK (`epd_client`) against a real stack on loopback: typed streams in order, the
sync and asyncio clients agree, errors carry their status, deadlines, uploads by path / bytes /
file object / hash, the API key on gRPC, retries of UNAVAILABLE while a gateway starts, and a
stream left early cancelled on the server."""

from __future__ import annotations

import asyncio
import gc
import hashlib
import io
import shutil
import subprocess
import sys
import threading
import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from epd.cli.health import is_serving
from epd.client import (
    NO_RETRY,
    AskResult,
    AsyncEpdClient,
    EpdClient,
    EpdError,
    RetryPolicy,
    Stage,
    StageEvent,
    StreamEvent,
    TokenDelta,
)
from epd.gateway.config import GatewayConfig
from epd.gateway.pipeline import Pipeline
from epd.gateway.server import remote_pipeline
from epd.gateway.servicer import GatewayServicer
from epd.transport.ports_file import free_port
from epd.v1 import gateway_pb2_grpc
from tests.stack import ROOT, Stack, child_env, epd_command

API_KEY = "sdk-test-key"
QUESTION = "what colour is the moving square?"
OPTIONS = {"num_frames": 4, "max_new_tokens": 6}
LONG_ANSWER = {"num_frames": 4, "max_new_tokens": 4000, "ignore_eos": True}
"""Thousands of tokens: still being generated long after a client that reads three leaves."""
WAIT_S = 120.0


@pytest.fixture(scope="module")
def stack(tiny_models, tmp_path_factory):
    extra = {"gateway": ["--api-key", API_KEY]}
    with Stack(tiny_models["qwen2_vl"], tmp_path_factory.mktemp("logs_sdk"), extra=extra, http=True) as s:
        yield s


@pytest.fixture(scope="module")
def client(stack):
    with EpdClient(stack.gateway, timeout_s=120, api_key=API_KEY) as c:
        yield c


@pytest.fixture(scope="module")
def expected(client, media_files) -> AskResult:
    return client.ask(media_files["mp4"], QUESTION, **OPTIONS)


def test_stream_yields_stage_events_then_tokens_then_the_result(client, media_files, expected):
    items = list(client.stream(media_files["mp4"], QUESTION, **OPTIONS))
    kinds = [type(item).__name__ for item in items]
    first_token = kinds.index("TokenDelta")
    stages_before = {item.stage for item in items[:first_token] if isinstance(item, StageEvent)}
    assert {"encode", "prefill"} <= stages_before, kinds  # "video_decode" too unless the encoder cache hit
    assert isinstance(items[-1], AskResult) and kinds.count("AskResult") == 1
    deltas = [item for item in items if isinstance(item, TokenDelta)]
    assert "".join(d.text for d in deltas) == items[-1].answer
    assert [t for d in deltas for t in d.token_ids] == items[-1].token_ids == expected.token_ids
    assert items[-1].num_frames == 4 and len(items[-1].frame_timestamps_s) == 4
    assert {"encode", "prefill", "ttft", "total"} <= set(items[-1].timings_ms)


def test_every_stage_event_names_a_stage_of_the_enum_and_the_result_carries_them(client, media_files):
    # 3 frames: no other test samples these, so the encoder decodes (a cache hit skips video_decode).
    items = list(client.stream(media_files["mp4"], QUESTION, num_frames=3, max_new_tokens=4, pruning="balanced",
                               pruning_knobs={"prefill_drop_layer": 1}))  # fmt: skip
    events = [item for item in items if isinstance(item, StageEvent)]
    assert all(isinstance(e.stage, Stage) for e in events), [e.stage for e in events]
    assert {e.stage for e in events} == set(Stage)  # every stage reports, under its enum name
    result = items[-1]
    assert isinstance(result, AskResult) and result.events == events
    # Everything the summary carries arrives typed: grid, kept tokens, pruning report, timings.
    assert min(result.grid_thw) >= 1
    assert 0 < len(result.kept_visual_token_index) < result.num_visual_tokens
    assert "prefill_drop" in {s.stage for s in result.pruning.stages}
    assert result.timings_ms.video_decode_ms > 0 and result.timings_ms.ttft_ms > 0
    assert result.num_prompt_tokens > 0 and result.frame_timestamps_s and result.request_id


def test_async_client_streams_the_same_tokens(stack, media_files, expected):
    async def run():
        async with AsyncEpdClient(stack.gateway, timeout_s=120, api_key=API_KEY) as c:
            items = [item async for item in c.stream(media_files["mp4"], QUESTION, **OPTIONS)]
            raw = [
                msg.WhichOneof("kind") async for msg in c.ask_stream(media_files["mp4"], QUESTION, **OPTIONS)
            ]
            return items, raw

    items, raw = asyncio.run(run())
    assert items[-1].token_ids == expected.token_ids
    assert raw[0] == "event" and raw[-1] == "summary" and "delta" in raw


def test_an_async_client_made_before_its_event_loop_answers_in_it(stack, media_files, expected):
    """`client = AsyncEpdClient(...)` then `asyncio.run(main())`: grpc.aio bound the channel to
    the loop of the constructor's thread, and every call failed with "got Future attached to a
    different loop". The channel now opens at the first call; a second loop is told plainly."""
    client = AsyncEpdClient(stack.gateway, timeout_s=120, api_key=API_KEY)

    async def ask(close: bool) -> AskResult:
        try:
            return await client.ask(media_files["mp4"], QUESTION, **OPTIONS)
        finally:
            if close:
                await client.close()

    assert asyncio.run(ask(close=True)).token_ids == expected.token_ids
    with pytest.raises(RuntimeError, match="make one client per event loop"):
        asyncio.run(ask(close=False))


def test_errors_carry_the_grpc_status_and_message(client, media_files):
    with pytest.raises(EpdError, match="question is empty") as info:
        client.ask(media_files["mp4"], "   ", **OPTIONS)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(EpdError, match="send the file itself") as info:
        client.ask(None, QUESTION, media_sha256="cd" * 32, request_id="sdk-error-id", **OPTIONS)
    assert info.value.code == grpc.StatusCode.NOT_FOUND
    # The id as a field too (the HTTP API's x-request-id header), not only at the message's end.
    assert info.value.request_id == "sdk-error-id" and info.value.message.endswith(
        "(request id sdk-error-id)"
    )
    with pytest.raises(TypeError, match="unknown options: \\['num_frame'\\]"):
        client.ask(media_files["mp4"], QUESTION, num_frame=4)


def test_a_tiny_deadline_is_deadline_exceeded(client, media_files):
    with pytest.raises(EpdError, match="DEADLINE_EXCEEDED") as info:
        client.ask(media_files["mp4"], QUESTION, timeout_s=0.001, **OPTIONS)
    assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED


@pytest.mark.parametrize("timeout_s", [0.0, -1.0])
def test_a_passed_deadline_says_to_raise_timeout_s(client, media_files, timeout_s):
    """gRPC's own text was all the caller got: "Deadline Exceeded", which names neither the
    setting nor what to change."""
    with pytest.raises(EpdError, match="raise timeout_s") as info:
        client.ask(media_files["mp4"], QUESTION, timeout_s=timeout_s, **OPTIONS)
    assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and info.value.retry_after_s is None


def test_media_that_fails_to_read_mid_upload_is_an_epd_error_not_a_cancelled_future(client, media_files):
    """grpc.aio cancels a streaming call itself when its request iterator fails (here the file
    object's read during the upload; a deadline passing before the request is written takes the
    same path), and reading its answer then raises CancelledError. The SDK turns that into an
    EpdError with a status (the blocking client raised concurrent.futures.CancelledError)."""
    data = media_files["mp4"].read_bytes()

    class FailsOnUpload(io.BytesIO):  # hashed fine; the upload's second pass fails
        passes = 0

        def seek(self, *args):
            FailsOnUpload.passes += 1
            return super().seek(*args)

        def read(self, *args):
            if FailsOnUpload.passes > 1:
                raise OSError("the disk went away")
            return super().read(*args)

    with pytest.raises(EpdError) as info:
        client.ask(FailsOnUpload(data), QUESTION, **OPTIONS)
    assert info.value.code == grpc.StatusCode.CANCELLED and "could not be sent" in str(info.value)


def test_bytes_and_file_objects_upload_the_same_video(client, media_files, expected):
    data = media_files["mp4"].read_bytes()
    with open(media_files["mp4"], "rb") as f:
        from_file = client.ask(f, QUESTION, **OPTIONS)

    class Pipe(io.RawIOBase):  # not seekable: the SDK must read it once and keep the bytes
        def __init__(self):
            self.buf = io.BytesIO(data)

        def readable(self):
            return True

        def readinto(self, b):
            return self.buf.readinto(b)

    from_pipe = client.ask(io.BufferedReader(Pipe(), buffer_size=1000), QUESTION, **OPTIONS)
    with EpdClient(client.endpoint, timeout_s=120, api_key=API_KEY, chunk_bytes=1000) as small_chunks:
        from_bytes = small_chunks.ask(data, QUESTION, **OPTIONS)  # 13 messages of 1000 bytes
    for result in (from_file, from_pipe, from_bytes):
        assert result.token_ids == expected.token_ids
        assert result.media_num_bytes_sent == len(data)
        assert result.media_sha256 == hashlib.sha256(data).hexdigest()


def test_ask_by_hash_reuses_the_servers_copy(client, media_files, expected):
    sha = hashlib.sha256(media_files["mp4"].read_bytes()).hexdigest()
    by_hash = client.ask(None, QUESTION, media_sha256=sha, **OPTIONS)
    assert by_hash.token_ids == expected.token_ids
    assert by_hash.encoder_cache_hit and by_hash.media_num_bytes_sent == 0


def test_upload_or_reuse_uploads_once_then_reuses(client, media_files):
    path = media_files["mp4_b"]
    first = client.upload_or_reuse(path, QUESTION, num_frames=6, max_new_tokens=4)
    again = client.upload_or_reuse(path, QUESTION, num_frames=6, max_new_tokens=4)
    assert first.media_num_bytes_sent == path.stat().st_size and not first.encoder_cache_hit
    assert again.media_num_bytes_sent == 0 and again.encoder_cache_hit
    assert again.token_ids == first.token_ids


@pytest.mark.parametrize("key", ["", "wrong-key"])
def test_the_gateway_refuses_a_missing_or_wrong_api_key(stack, media_files, key):
    with EpdClient(stack.gateway, timeout_s=60, api_key=key) as c:
        with pytest.raises(EpdError, match="missing or wrong API key") as info:
            c.ask(media_files["mp4"], QUESTION, **OPTIONS)
    assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
    assert is_serving(stack.gateway, timeout_s=5.0)  # health stays open for probes


def test_unavailable_is_retried_until_the_gateway_comes_up(stack, media_files, expected, tmp_path):
    # A port picked here, not port 0 and a ports file: the client dials the address before any
    # gateway exists (what this test is about), so it must be known before the gateway starts;
    # `free_port` holds it until then (no other process can take it; the gateway binds it).
    port = free_port()
    address = f"127.0.0.1:{port}"
    with EpdClient(address, timeout_s=60, api_key=API_KEY, retry=NO_RETRY) as c:
        with pytest.raises(EpdError, match="UNAVAILABLE") as info:
            c.ask(media_files["mp4"], QUESTION, **OPTIONS)
    assert info.value.code == grpc.StatusCode.UNAVAILABLE

    outcome: dict[str, object] = {}

    def ask() -> None:
        retry = RetryPolicy(max_attempts=200, initial_backoff_s=0.1, max_backoff_s=0.5)
        with EpdClient(address, timeout_s=90, api_key=API_KEY, retry=retry) as c:
            try:
                outcome["result"] = c.ask(media_files["mp4"], QUESTION, **OPTIONS)
            except EpdError as exc:
                outcome["error"] = exc

    caller = threading.Thread(target=ask)
    caller.start()
    time.sleep(1.0)  # the first attempts find nothing listening
    command = epd_command(
        "serve", "gateway", "--port", str(port), "--api-key", API_KEY, "--encoder", stack.address("encoder"),
        "--prefill", stack.address("prefill"), "--decode", stack.address("decode"),
    )  # fmt: skip
    with open(tmp_path / "late_gateway.log", "w") as log:
        late = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=child_env(), cwd=ROOT)
    try:
        caller.join(timeout=120)
    finally:
        late.terminate()
        late.wait(timeout=20)
    assert "error" not in outcome, outcome.get("error")
    result = outcome["result"]
    assert isinstance(result, AskResult)
    assert result.token_ids == expected.token_ids
    assert result.num_attempts > 1


@pytest.mark.parametrize(
    "script,args,expect",
    [
        ("ask_sync.py", ["--endpoint", "{grpc}"], "encoder cache hit: True"),
        ("ask_async_stream.py", ["--endpoint", "{grpc}"], "prefill finished"),
        ("openai_http.py", ["--base-url", "{http}"], "frames, TTFT"),
    ],
)
def test_the_examples_run_against_the_stack(stack, script, args, expect):
    """The key from $EPD_API_KEY, as compose/README.md and deploy/README.md tell (`export $(cat
    .env)`): the examples sent none unless given --api-key, and got UNAUTHENTICATED / HTTP 401."""
    addresses = {"grpc": stack.gateway, "http": f"http://127.0.0.1:{stack.http_port}/v1"}
    command = [sys.executable, str(ROOT / "examples" / script), "samples/sample.mp4",
               *(a.format(**addresses) for a in args)]  # fmt: skip
    env = {**child_env(), "EPD_API_KEY": API_KEY}
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert expect in done.stdout + done.stderr


def test_tls_with_a_root_certificate(stack, media_files, expected, tmp_path):
    """The real gateway servicer and pipeline behind a TLS port (as a TLS-terminating front
    door would be), reached with the CA's certificate; a plaintext client is refused."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("needs the openssl command to make a certificate")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
         "-days", "1", "-subj", "/CN=epd-test", "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    config = GatewayConfig(
        encoder_addresses=(stack.address("encoder"),),
        prefill_addresses=(stack.address("prefill"),),
        decode_addresses=(stack.address("decode"),),
    )
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start() -> tuple[grpc.aio.Server, int, Pipeline]:
        server = grpc.aio.server()
        pipeline = remote_pipeline(config)  # its channels belong to this loop
        servicer = GatewayServicer(config, pipeline)
        gateway_pb2_grpc.add_GatewayServiceServicer_to_server(servicer, server)
        credentials = grpc.ssl_server_credentials([(key.read_bytes(), cert.read_bytes())])
        port = server.add_secure_port("127.0.0.1:0", credentials)
        await server.start()
        return server, port, pipeline

    async def stop() -> None:
        await server.stop(0)
        # The stages' channels: left open, they kept reconnecting to the stack's ports after it
        # stopped, and a later test's server on such a port was called through them.
        await pipeline.aclose()

    server, port, pipeline = asyncio.run_coroutine_threadsafe(start(), loop).result()
    try:
        with EpdClient(f"127.0.0.1:{port}", timeout_s=60, root_certificates_path=str(cert)) as c:
            assert c.ask(media_files["mp4"], QUESTION, **OPTIONS).token_ids == expected.token_ids
        with EpdClient(f"127.0.0.1:{port}", timeout_s=20, retry=NO_RETRY) as plaintext:
            with pytest.raises(EpdError, match="UNAVAILABLE"):
                plaintext.ask(media_files["mp4"], QUESTION, **OPTIONS)
    finally:
        asyncio.run_coroutine_threadsafe(stop(), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        thread.join()


def _metric(stack: Stack, name: str, **labels: str) -> float:
    """A sample of the gateway's /metrics, summed over the series that carry `labels`."""
    with urllib.request.urlopen(f"http://127.0.0.1:{stack.http_port}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == name and labels.items() <= sample.labels.items())  # fmt: skip


def _wait_until_idle(stack: Stack) -> None:
    """No request in flight at the gateway and none running in decode's batch. The bound only
    makes a broken build fail instead of hanging."""
    deadline = time.monotonic() + WAIT_S
    while True:
        gateway = _metric(stack, "epd_requests_in_flight")
        decode = _metric(stack, "epd_engine_running_requests", stage="decode")
        if not gateway and not decode:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"{WAIT_S:.0f} s after its client left, the gateway has {gateway:.0f} request(s) in "
                        f"flight and decode runs {decode:.0f}")  # fmt: skip
        time.sleep(0.1)


def _read_three_tokens(items) -> list[StreamEvent]:
    seen = []
    for item in items:
        seen.append(item)
        if sum(isinstance(i, TokenDelta) for i in seen) == 3:
            break
    return seen


def _leave_a_blocking_stream(stack, client, media) -> list[StreamEvent]:
    return _read_three_tokens(client.stream(media, QUESTION, **LONG_ANSWER))  # then `break`


def _leave_a_blocking_conversation(stack, client, media) -> list[StreamEvent]:
    return _read_three_tokens(client.conversation(media, **LONG_ANSWER).stream(QUESTION))


def _leave_an_async_stream(stack, client, media) -> list[StreamEvent]:
    async def run() -> list[StreamEvent]:
        async with AsyncEpdClient(stack.gateway, timeout_s=WAIT_S, api_key=API_KEY) as c:
            stream = c.stream(media, QUESTION, **LONG_ANSWER)
            seen = []
            async for item in stream:
                seen.append(item)
                if sum(isinstance(i, TokenDelta) for i in seen) == 3:
                    break
            await stream.aclose()
            # Still connected: closing the client would cancel its calls whatever the stream did.
            await asyncio.to_thread(_wait_until_idle, stack)
            return seen

    return asyncio.run(run())


@pytest.mark.parametrize("leave", [_leave_a_blocking_stream, _leave_a_blocking_conversation, _leave_an_async_stream],
                         ids=["blocking_break", "conversation_break", "async_aclose"])  # fmt: skip
def test_a_stream_left_early_is_cancelled_on_the_server(stack, client, media_files, expected, leave):
    """The request a client stops reading ends on the server at once (the answer would have run
    on for thousands of tokens): the gateway counts it CANCELLED, never answered, and the stack
    answers the next request."""
    ok_before = _metric(stack, "epd_requests_total", status="OK")
    cancelled_before = _metric(stack, "epd_requests_total", status="CANCELLED")
    seen = leave(stack, client, media_files["mp4"])
    assert not any(isinstance(item, AskResult) for item in seen)
    _wait_until_idle(stack)
    assert _metric(stack, "epd_requests_total", status="CANCELLED") == cancelled_before + 1
    assert _metric(stack, "epd_requests_total", status="OK") == ok_before  # no summary was sent
    assert client.ask(media_files["mp4"], QUESTION, **OPTIONS).token_ids == expected.token_ids


def test_a_conversation_turn_left_early_closes_its_call_at_once(stack, media_files):
    """aclose() on a turn's stream closes the client stream under it before returning (its call is
    cancelled then), not when the garbage collector's finalizer gets to it; the test above cannot
    tell the two apart, as it waits for the server to go idle."""

    async def run() -> None:
        async with AsyncEpdClient(stack.gateway, timeout_s=WAIT_S, api_key=API_KEY) as c:
            conv = c.conversation(media_files["mp4"], **LONG_ANSWER)
            calls = []  # the real client streams the turn reads (held here, so no finalizer closes them)
            turn = conv._turn
            conv._turn = lambda *args: calls.append(turn(*args)) or calls[-1]
            stream = conv.stream(QUESTION)
            num_deltas = 0
            async for item in stream:
                num_deltas += isinstance(item, TokenDelta)
                if num_deltas == 3:
                    break
            await stream.aclose()
            assert len(calls) == 1 and calls[0].ag_frame is None, "the turn's client stream is still open"
            await asyncio.to_thread(_wait_until_idle, stack)

    asyncio.run(run())


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
def test_a_client_closed_in_the_middle_of_a_stream_cancels_it(stack, media_files):
    """close() while a stream is being read, then `break`: the call is cancelled on the server,
    and leaving the stream does not fail on the closed loop ("Event loop is closed", raised where
    no one could catch it, and a coroutine never awaited)."""
    cancelled_before = _metric(stack, "epd_requests_total", status="CANCELLED")
    client = EpdClient(stack.gateway, timeout_s=WAIT_S, api_key=API_KEY)
    num_deltas = 0
    for item in client.stream(media_files["mp4"], QUESTION, **LONG_ANSWER):
        num_deltas += isinstance(item, TokenDelta)
        if num_deltas == 3:
            client.close()
            break
    gc.collect()
    _wait_until_idle(stack)
    assert _metric(stack, "epd_requests_total", status="CANCELLED") == cancelled_before + 1
