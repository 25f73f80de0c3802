"""The SDK's bookkeeping without a server: retry decisions and backoff, media sources (path,
bytes, seekable and one-shot file objects); the gRPC API-key check; the blocking client's thread
and loop when it fails to start or is used after close(). The requests built from a call's
options: test_request.py."""

from __future__ import annotations

import gc
import hashlib
import io
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from epd.client import NO_RETRY, AsyncEpdClient, EpdClient, EpdError, MediaSource, RetryPolicy
from epd.client.channel import ChannelSettings, channel_credentials, open_channel
from epd.client.client import _call_error
from epd.transport.auth import bearer_token, key_matches


def test_backoff_grows_then_caps():
    policy = RetryPolicy(max_attempts=6, initial_backoff_s=0.5, max_backoff_s=3.0, multiplier=2.0)
    assert [policy.backoff_s(a) for a in range(1, 6)] == [0.5, 1.0, 2.0, 3.0, 3.0]


def test_only_unavailable_before_the_first_token_is_retried_and_only_so_often():
    policy = RetryPolicy(max_attempts=3)
    assert policy.should_retry(grpc.StatusCode.UNAVAILABLE, attempt=1, saw_token=False)
    assert not policy.should_retry(grpc.StatusCode.UNAVAILABLE, attempt=1, saw_token=True)
    assert not policy.should_retry(grpc.StatusCode.UNAVAILABLE, attempt=3, saw_token=False)
    assert not policy.should_retry(grpc.StatusCode.INVALID_ARGUMENT, attempt=1, saw_token=False)
    assert not policy.should_retry(grpc.StatusCode.DEADLINE_EXCEEDED, attempt=1, saw_token=False)


def test_resource_exhausted_is_retried_only_when_the_server_said_busy():
    """Listed as retryable, RESOURCE_EXHAUSTED re-sent an upload over the server's limit (HTTP's
    413) as often as a full queue (HTTP's 429); only the latter may succeed later."""
    policy = RetryPolicy(retryable=(grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED))
    assert policy.should_retry(grpc.StatusCode.RESOURCE_EXHAUSTED, attempt=1, saw_token=False, busy=True)
    assert not policy.should_retry(grpc.StatusCode.RESOURCE_EXHAUSTED, attempt=1, saw_token=False)
    assert not RetryPolicy().should_retry(
        grpc.StatusCode.RESOURCE_EXHAUSTED, attempt=1, saw_token=False, busy=True
    )


def test_bad_retry_policies_are_refused():
    with pytest.raises(ValueError, match="max_attempts must be >= 1"):
        RetryPolicy(max_attempts=0)
    with pytest.raises(ValueError, match="initial_backoff_s <= max_backoff_s"):
        RetryPolicy(initial_backoff_s=2.0, max_backoff_s=1.0)


class OneShot(io.RawIOBase):
    """A pipe-like file: readable once, not seekable."""

    def __init__(self, data: bytes) -> None:
        self.buf = io.BytesIO(data)

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        return self.buf.readinto(b)


@pytest.mark.parametrize("kind", ["path", "str", "bytes", "file", "one_shot"])
def test_every_media_source_gives_the_same_chunks_twice(tmp_path, kind):
    data = bytes(range(256)) * 41  # 10,496 bytes -> 11 chunks of 1000
    path = tmp_path / "clip.mp4"
    path.write_bytes(data)
    f = open(path, "rb")  # noqa: SIM115 - closed below
    f.read(10)  # a seekable file is uploaded from where it stands, like shutil.copyfileobj
    media = {
        "path": path,
        "str": str(path),
        "bytes": data,
        "file": f,
        "one_shot": io.BufferedReader(OneShot(data)),
    }
    expected = data[10:] if kind == "file" else data
    source = MediaSource(media[kind], chunk_bytes=1000)
    for _ in range(2):  # a retried call re-sends from the start
        chunks = list(source.chunks())
        assert b"".join(chunks) == expected and max(len(c) for c in chunks) == 1000
    assert source.num_bytes == len(expected)
    assert source.sha256 == hashlib.sha256(expected).hexdigest()
    f.close()


def test_media_source_errors_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such video file"):
        MediaSource(tmp_path / "missing.mp4")
    with pytest.raises(IsADirectoryError, match="is a directory; pass a video or image file"):
        MediaSource(tmp_path)  # was "no such video file", of a directory that is there
    with pytest.raises(TypeError, match="must be a path, bytes or a binary file object, not int"):
        MediaSource(3)  # type: ignore[arg-type]


def test_a_header_over_the_message_limit_is_refused_before_any_call():
    """gRPC refused to send it with "Sent message larger than max (5000022 vs. 4194304)"; the
    endpoint here answers nothing, so any call made would be UNAVAILABLE instead."""
    with EpdClient("127.0.0.1:1", retry=NO_RETRY) as client:
        with pytest.raises(EpdError, match="send a shorter conversation") as info:
            client.ask(b"video bytes", "x" * (5 << 20))
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED


@pytest.mark.parametrize(
    "settings,match",
    [
        ({"timeout_s": None}, "timeout_s must be a positive number of seconds"),
        ({"timeout_s": 0}, "timeout_s must be a positive number of seconds"),
        ({"chunk_bytes": 8 << 20}, "chunk_bytes must be from 1 to"),
        ({"chunk_bytes": 0}, "chunk_bytes must be from 1 to"),
    ],
)
def test_a_client_setting_out_of_range_is_refused_when_the_client_is_made(settings, match):
    """timeout_s=None failed each call with "unsupported operand type(s) for +"; a chunk over the
    message limit failed each upload with gRPC's "Sent message larger than max"."""
    with pytest.raises(ValueError, match=match):
        AsyncEpdClient("127.0.0.1:1", **settings)


def test_api_key_goes_out_as_bearer_metadata_and_is_checked_exactly():
    metadata = ChannelSettings(api_key="s3cret", metadata=(("x-team", "vision"),)).call_metadata()
    assert metadata == (("authorization", "Bearer s3cret"), ("x-team", "vision"))
    assert bearer_token(metadata) == "s3cret" and key_matches("s3cret", "s3cret")
    assert bearer_token([("authorization", "Basic s3cret")]) == ""
    assert not key_matches("s3cre", "s3cret") and not key_matches("", "s3cret")


def test_tls_needs_an_existing_root_certificate_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="root certificates file not found"):
        channel_credentials(ChannelSettings(root_certificates_path=str(tmp_path / "ca.pem")))
    with pytest.raises(FileNotFoundError, match="root certificates file not found"):
        # made, not first called
        AsyncEpdClient("127.0.0.1:1", root_certificates_path=str(tmp_path / "ca.pem"))


def test_a_client_certificate_needs_its_key_and_existing_files(tmp_path):
    with pytest.raises(ValueError, match="client_certificate_path and client_key_path go together"):
        ChannelSettings(client_certificate_path=str(tmp_path / "client.pem"))
    settings = ChannelSettings(
        client_certificate_path=str(tmp_path / "client.pem"), client_key_path=str(tmp_path / "client.key")
    )
    assert settings.uses_tls  # a client certificate is TLS even without a CA given
    with pytest.raises(FileNotFoundError, match="client certificate file not found"):
        channel_credentials(settings)


def _client_threads() -> int:
    return sum(t.name == "epd-client" for t in threading.enumerate())


def test_a_client_that_fails_to_start_leaves_no_thread_running(tmp_path):
    before = _client_threads()
    for _ in range(3):
        with pytest.raises(FileNotFoundError, match="root certificates file not found"):
            EpdClient("127.0.0.1:1", root_certificates_path=str(tmp_path / "ca.pem"))
        with pytest.raises(ValueError, match="client_certificate_path and client_key_path go together"):
            EpdClient("127.0.0.1:1", client_certificate_path=str(tmp_path / "client.pem"))
    assert _client_threads() == before  # each failure left an event loop running in its thread


def test_a_closed_client_says_so_without_a_warning(tmp_path):
    client = EpdClient("127.0.0.1:1")
    chat = client.conversation(b"some video bytes")
    client.close()
    client.close()  # again: nothing to do
    gc.collect()  # earlier tests' garbage (an event loop they left) warns now, not in the record below
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for call in (lambda: client.ask(b"some video bytes", "q?"), lambda: list(client.stream(b"v", "q?")),
                     lambda: client.upload_or_reuse(b"v", "q?"), lambda: chat.ask("q?")):  # fmt: skip
            with pytest.raises(RuntimeError, match="the client is closed"):
                call()
        gc.collect()  # a coroutine never awaited warns when it is collected
    assert [str(w.message) for w in caught] == []


GONE_WITHIN_S = 30.0
"""How long a dropped client's thread and socket may take to go: a bound for a hang, not a timing check."""


@pytest.fixture
def health_server():
    """A gRPC server with only the health service (a client's call to it connects and is
    answered UNIMPLEMENTED): (its port, a count of the client sockets connected to it)."""
    import psutil
    from grpc_health.v1 import health, health_pb2_grpc

    server = grpc.server(ThreadPoolExecutor(max_workers=1))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()

    def client_sockets() -> int:
        return sum(
            bool(c.raddr) and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED
            for c in psutil.Process().net_connections(kind="tcp")
        )

    try:
        yield port, client_sockets
    finally:
        server.stop(None)


def connected_client(port: int) -> EpdClient:
    client = EpdClient(f"127.0.0.1:{port}", retry=NO_RETRY)
    with pytest.raises(EpdError) as raised:  # a call, so that the channel connects
        client.detokenize([1])
    assert raised.value.code == grpc.StatusCode.UNIMPLEMENTED  # no gateway service there: connected
    return client


def wait_until_gone(expected: tuple[int, int], client_sockets) -> None:
    """Until the client threads and sockets are back to `expected` (a bound for a hang)."""
    end_at = time.monotonic() + GONE_WITHIN_S
    while (_client_threads(), client_sockets()) != expected:
        assert time.monotonic() < end_at, (
            f"{_client_threads()} client threads and {client_sockets()} sockets still open"
        )
        time.sleep(0.05)


def unclosed_warning(port: int) -> str:
    return f"unclosed EpdClient for 127.0.0.1:{port}: close() it, or use `with EpdClient(...) as client:`"


def test_a_client_dropped_without_close_is_closed_by_the_garbage_collector_with_a_warning(health_server):
    """It lived until the interpreter exited (a module-level set held it for the exit's close), its
    thread, event loop, channel and connection with it. Now `del` and a collection close it, with
    a ResourceWarning, as Python's unclosed files and grpc's channels are handled."""
    port, client_sockets = health_server
    threads_before, sockets_before = _client_threads(), client_sockets()
    client = connected_client(port)
    assert _client_threads() == threads_before + 1 and client_sockets() == sockets_before + 1
    gc.collect()  # earlier tests' garbage warns now, not in the record below
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del client
        gc.collect()
    assert [str(w.message) for w in caught if w.category is ResourceWarning] == [unclosed_warning(port)]
    wait_until_gone((threads_before, sockets_before), client_sockets)


def test_a_client_collected_on_its_own_loops_thread_still_closes(health_server, monkeypatch):
    """The collector may run on any thread, the client's own among them (a cycle that holds the
    client, found by a collection its loop's work set off): there the finalizer cannot wait for
    the loop to close the client, as it does from any other thread (it would wait for itself, and
    the thread, channel and connection would stay); it leaves the loop to close it and stop."""
    from epd.client import sync_client

    port, client_sockets = health_server
    threads_before, sockets_before = _client_threads(), client_sockets()
    client = connected_client(port)
    loop, client_thread = client._parts.loop, client._parts.thread
    closed_on: list[threading.Thread] = []
    real_close = sync_client._close
    monkeypatch.setattr(
        sync_client,
        "_close",
        lambda parts: (closed_on.append(threading.current_thread()), real_close(parts)),
    )
    gc.collect()  # earlier tests' garbage warns now, not in the record below
    gc.disable()  # only the collection on the client's thread below may find the cycle
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cycle: list = [client]
            cycle.append(cycle)
            del client, cycle  # only the cycle holds the client now
            loop.call_soon_threadsafe(gc.collect)
            client_thread.join(GONE_WITHIN_S)  # a bound for a hang: the thread stops once the client closed
        assert closed_on == [client_thread]
        assert [str(w.message) for w in caught if w.category is ResourceWarning] == [unclosed_warning(port)]
    finally:
        gc.enable()
    assert not client_thread.is_alive() and loop.is_closed()
    wait_until_gone((threads_before, sockets_before), client_sockets)


def test_asking_about_a_directory_says_it_is_one(tmp_path):
    with EpdClient("127.0.0.1:1") as client, pytest.raises(IsADirectoryError, match="is a directory"):
        client.ask(tmp_path, "q?")


def test_a_server_name_alone_makes_the_channel_tls_not_plaintext():
    """`server_name_override` (epd ask --tls-server-name) means TLS: alone, the channel stayed
    plaintext and sent the API key in clear, so a call to a plaintext server succeeded."""
    import asyncio

    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    async def run() -> str:
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        settings = ChannelSettings(server_name_override="gateway.example", api_key="secret-key")
        channel = open_channel(f"127.0.0.1:{port}", settings, RetryPolicy(), channel_credentials(settings))
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
            return f"plaintext call answered {reply.status}"
        except grpc.aio.AioRpcError as exc:
            return exc.code().name
        finally:
            await channel.close()
            await server.stop(0)

    assert ChannelSettings(server_name_override="gateway.example").uses_tls
    assert asyncio.run(run()) == "UNAVAILABLE"  # a TLS handshake a plaintext server cannot answer


def test_a_passed_deadline_says_what_helps_for_the_call_it_cut():
    # An ask's answer is shortened by fewer tokens or frames; a tokenize call's is not: its
    # message names only the deadline.
    exc = grpc.aio.AioRpcError(
        grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(), grpc.aio.Metadata(), "Deadline Exceeded"
    )
    asked = _call_error(exc, time.monotonic() - 1, 2.0, "or ask for fewer tokens or frames")
    tokenized = _call_error(exc, time.monotonic() - 1, 2.0)
    assert asked.message.endswith("raise timeout_s, or ask for fewer tokens or frames"), asked.message
    assert tokenized.message == "no answer within the call's deadline (2 s, timeout_s); raise timeout_s"
